"""``paddle.dataset.uci_housing``: the Boston housing regression set, as PaddlePaddle read it.

Each of the 13 features is normalised over the whole file as ``(x - mean) / (max - min)``; the first 80 % of
the 506 rows (404) are the training set, the rest (102) the test set. A sample is ``(features, price)``: float64
arrays of shape (13,) and (1,), the rows of ``np.fromfile`` exactly as Paddle yielded them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from ...missing import module_getattr
from . import common

__all__ = ["feature_names", "fetch", "load_data", "predict_reader", "test", "train"]
__getattr__ = module_getattr(__name__, "paddle.dataset.uci_housing")

URL = "http://paddlemodels.bj.bcebos.com/uci_housing/housing.data"
URLS = (URL, "https://archive.ics.uci.edu/ml/machine-learning-databases/housing/housing.data")
MD5 = "d4accdce7a25600298819f8e28e8d593"
feature_names = ["CRIM", "ZN", "INDUS", "CHAS", "NOX", "RM", "AGE", "DIS", "RAD", "TAX", "PTRATIO", "B", "LSTAT"]

UCI_TRAIN_DATA: Optional[np.ndarray] = None
UCI_TEST_DATA: Optional[np.ndarray] = None


def load_data(filename: str, feature_num: int = 14, ratio: float = 0.8) -> None:
    """Read and normalise ``filename`` into ``UCI_TRAIN_DATA`` / ``UCI_TEST_DATA`` (once per process)."""
    global UCI_TRAIN_DATA, UCI_TEST_DATA
    if UCI_TRAIN_DATA is not None and UCI_TEST_DATA is not None:
        return
    data = np.fromfile(filename, sep=" ")
    if data.size == 0 or data.size % feature_num:
        raise common.DatasetError(f"{filename}: expected rows of {feature_num} numbers, got {data.size} numbers")
    data = data.reshape(-1, feature_num)
    maximums, minimums, avgs = data.max(axis=0), data.min(axis=0), data.sum(axis=0) / data.shape[0]
    for i in range(feature_num - 1):
        data[:, i] = (data[:, i] - avgs[i]) / (maximums[i] - minimums[i])
    offset = int(data.shape[0] * ratio)
    UCI_TRAIN_DATA, UCI_TEST_DATA = data[:offset], data[offset:]


def _path() -> str:
    return common.fetch("uci_housing", URLS, MD5)


def _reader(which: Callable[[], np.ndarray]) -> Callable[[], Iterator[Tuple[np.ndarray, np.ndarray]]]:
    load_data(_path())

    def reader() -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        for d in which():
            yield d[:-1], d[-1:]

    return reader


def train() -> Callable[[], Iterator[Tuple[np.ndarray, np.ndarray]]]:
    """Reader of the 404 training samples."""
    return _reader(lambda: UCI_TRAIN_DATA)


def test() -> Callable[[], Iterator[Tuple[np.ndarray, np.ndarray]]]:
    """Reader of the 102 test samples."""
    return _reader(lambda: UCI_TEST_DATA)


def predict_reader() -> Tuple[Any, ...]:
    """The features of the first test sample, as a one-element tuple."""
    load_data(_path())
    assert UCI_TEST_DATA is not None
    return (UCI_TEST_DATA[0][:-1],)


def fetch() -> None:
    _path()
