"""``paddle.dataset.common``: the dataset cache and its downloads, in PaddlePaddle's layout.

A dataset file lives at ``DATA_HOME/<module>/<name>`` where ``<name>`` is the last part of the URL it came from,
exactly where PaddlePaddle put it, so an existing ``~/.cache/paddle/dataset`` is used as it is. ``DATA_HOME`` is
``$PADDLE_DATA_HOME`` when set, else ``~/.cache/paddle/dataset`` (``/tmp/.cache/...`` when the home directory is
not writable, as in Paddle); assigning ``common.DATA_HOME`` works as in Paddle.

A missing file is downloaded from the original public locations in order, checked against the MD5 Paddle used,
and renamed into place only when it matches, so the cache never holds a partial download. A file already in the
cache is used even when its MD5 differs (a copy you placed, a slice for tests): that is said once on stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import urllib.request
from typing import Optional, Sequence, Set

from ....contract import dataset_home
from ....ps.atomic import file_digest
from ...missing import module_getattr

__all__ = ["DATA_HOME", "DatasetError", "download", "md5file"]
__getattr__ = module_getattr(__name__, "paddle.dataset.common")


DATA_HOME = dataset_home()
DOWNLOAD_TIMEOUT = 60.0
_warned: Set[str] = set()


class DatasetError(RuntimeError):
    """A dataset file is neither in the cache nor downloadable; the message names the file and the fix."""


def md5file(fname: str) -> str:
    return file_digest(fname, "md5")


def _name(url: str) -> str:
    return url.split("/")[-1]


def fetch(module_name: str, urls: Sequence[str], md5sum: str, save_name: Optional[str] = None) -> str:
    """Path of the dataset file: the cached copy under any of the URLs' names, else a verified download."""
    dirname = os.path.join(DATA_HOME, module_name)
    names = [save_name] if save_name else list(dict.fromkeys(_name(u) for u in urls))
    for name in names:
        path = os.path.join(dirname, name)
        if os.path.isfile(path):
            if path not in _warned and md5file(path) != md5sum:
                _warned.add(path)
                print(f"paddle.dataset: {path} has MD5 {md5file(path)}, not PaddlePaddle's {md5sum}; using it as "
                      "it is (delete it to download the original)", file=sys.stderr, flush=True)
            return path
    errors = []
    for url in urls:
        path = os.path.join(dirname, save_name or _name(url))
        try:
            _download(url, path, md5sum)
            return path
        except (OSError, ValueError) as e:
            errors.append(f"{url}: {e}")
    raise DatasetError(f"{module_name}: {os.path.join(dirname, names[0])} is not in the dataset cache and could not "
                       f"be downloaded ({'; '.join(errors)}); copy the file there (MD5 {md5sum}) or set "
                       "PADDLE_DATA_HOME to a directory that has it")


def _download(url: str, path: str, md5sum: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"paddle.dataset: downloading {url} to {path}", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as r:
            shutil.copyfileobj(r, out, 1 << 20)
        got = md5file(tmp)
        if got != md5sum:
            raise ValueError(f"downloaded MD5 {got}, expected {md5sum}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def download(url: str, module_name: str, md5sum: str, save_name: Optional[str] = None) -> str:
    """PaddlePaddle's ``download``: the cached file of ``url`` (downloaded and checked when missing)."""
    return fetch(module_name, [url], md5sum, save_name)
