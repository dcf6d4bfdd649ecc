"""``paddle.dataset.imikolov``: the Penn Treebank text of Mikolov's ``simple-examples``, as PaddlePaddle read it.

``build_dict(min_word_freq=50)`` counts the words of ``ptb.train.txt`` and ``ptb.valid.txt`` (plus one ``<s>`` and
one ``<e>`` per line), keeps those seen more than ``min_word_freq`` times, numbers them by (-count, word) and
gives ``<unk>`` the last id. ``train(word_idx, n)`` / ``test(word_idx, n)`` read ``ptb.train.txt`` /
``ptb.valid.txt``: with ``DataType.NGRAM`` every line becomes ``<s> words <e>`` and yields each window of ``n``
ids as a tuple (lines shorter than ``n`` yield nothing); with ``DataType.SEQ`` a line yields
``([<s>] + ids, ids + [<e>])``, skipped when longer than ``n`` (``n <= 0``: no limit). Unknown words map to
``<unk>``. Dictionary keys are ``str`` (Paddle under Python 3 mixed ``bytes`` words with ``str`` markers).
"""

from __future__ import annotations

import collections
import posixpath
import tarfile
from typing import Callable, Dict, Iterable, Iterator, List, Optional

from ...missing import module_getattr
from . import common

__all__ = ["DataType", "build_dict", "fetch", "test", "train", "word_count"]
__getattr__ = module_getattr(__name__, "paddle.dataset.imikolov")

URL = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
URLS = (URL, "https://dataset.bj.bcebos.com/imikolov%2Fsimple-examples.tgz")
MD5 = "30177ea32e27c525793142b6bf2c8e2d"
TRAIN_FILE = "./simple-examples/data/ptb.train.txt"
TEST_FILE = "./simple-examples/data/ptb.valid.txt"


class DataType:
    NGRAM = 1
    SEQ = 2


def word_count(f: Iterable[str], word_freq: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """Adds the words of ``f``'s lines, and one ``<s>`` and ``<e>`` per line, to ``word_freq``."""
    if word_freq is None:
        word_freq = collections.defaultdict(int)
    for line in f:
        for w in line.strip().split():
            word_freq[w] += 1
        word_freq["<s>"] += 1
        word_freq["<e>"] += 1
    return word_freq


def _read(member: str) -> List[str]:
    """Lines of one member of the cached archive (found with or without the leading ``./``)."""
    with tarfile.open(common.fetch("imikolov", URLS, MD5)) as tf:
        want = posixpath.normpath(member)
        for info in tf.getmembers():
            if posixpath.normpath(info.name) == want and info.isfile():
                f = tf.extractfile(info)
                assert f is not None
                return f.read().decode("utf-8").splitlines()
    raise common.DatasetError(f"imikolov: the archive has no {member}")


def build_dict(min_word_freq: int = 50) -> Dict[str, int]:
    """word -> id over train + valid, by (-count, word), words seen more than ``min_word_freq`` times."""
    freq = word_count(_read(TEST_FILE), word_count(_read(TRAIN_FILE)))
    freq.pop("<unk>", None)  # it gets the last id below
    kept = sorted(((w, c) for w, c in freq.items() if c > min_word_freq), key=lambda x: (-x[1], x[0]))
    word_idx = {w: i for i, (w, _) in enumerate(kept)}
    word_idx["<unk>"] = len(kept)
    return word_idx


def _reader_creator(member: str, word_idx: Dict[str, int], n: int, data_type: int) -> Callable[[], Iterator]:
    if data_type not in (DataType.NGRAM, DataType.SEQ):
        raise ValueError(f"data_type={data_type!r}: expected DataType.NGRAM or DataType.SEQ")
    if data_type == DataType.NGRAM and n < 1:
        raise ValueError(f"n={n}: an n-gram needs n >= 1")

    def reader() -> Iterator:
        unk = word_idx["<unk>"]
        for line in _read(member):
            if data_type == DataType.NGRAM:
                words = ["<s>", *line.strip().split(), "<e>"]
                if len(words) >= n:
                    ids = [word_idx.get(w, unk) for w in words]
                    for i in range(n, len(ids) + 1):
                        yield tuple(ids[i - n:i])
            else:
                ids = [word_idx.get(w, unk) for w in line.strip().split()]
                src, trg = [word_idx["<s>"], *ids], [*ids, word_idx["<e>"]]
                if n > 0 and len(src) > n:
                    continue
                yield src, trg

    return reader


def train(word_idx: Dict[str, int], n: int, data_type: int = DataType.NGRAM) -> Callable[[], Iterator]:
    """Reader over ``ptb.train.txt``."""
    return _reader_creator(TRAIN_FILE, word_idx, n, data_type)


def test(word_idx: Dict[str, int], n: int, data_type: int = DataType.NGRAM) -> Callable[[], Iterator]:
    """Reader over ``ptb.valid.txt`` (Paddle's "test" set)."""
    return _reader_creator(TEST_FILE, word_idx, n, data_type)


def fetch() -> None:
    common.fetch("imikolov", URLS, MD5)
