"""``paddle.dataset.movielens``: MovieLens 1M ratings, as PaddlePaddle's reader yielded them.

A sample is ``[user_id, gender, age, job, movie_id, category_ids, title_word_ids, [score]]``: gender 0 for M
and 1 for F, age the index of the user's age group in ``age_table``, job the occupation code, the ids of the
movie's genres and of the lower-cased words of its title (without the ``(year)``), and the rating mapped to
``rating * 2 - 5`` (1..5 -> -3..5). A rating goes to the test set when the next draw of a legacy numpy
``RandomState(rand_seed)`` is below ``test_ratio`` -- Paddle's ``np.random.seed(rand_seed)`` split, the same
rows, without reseeding numpy's global generator.

One difference: Paddle numbered title words and genres in the iteration order of a Python ``set``, which
changes from process to process under Python 3; here they are numbered in sorted order, so every trainer of a
job agrees on them.
"""

from __future__ import annotations

import functools
import re
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from ...missing import module_getattr
from . import common

__all__ = ["MovieInfo", "UserInfo", "age_table", "fetch", "get_movie_title_dict", "max_job_id", "max_movie_id",
           "max_user_id", "movie_categories", "movie_info", "test", "train", "user_info"]
__getattr__ = module_getattr(__name__, "paddle.dataset.movielens")

URL = "http://files.grouplens.org/datasets/movielens/ml-1m.zip"
URLS = (URL, "https://dataset.bj.bcebos.com/movielens%2Fml-1m.zip")
MD5 = "c4d9eecfca2ab87c1945afe126590906"
age_table = [1, 18, 25, 35, 45, 50, 56]
_TITLE = re.compile(r"^(.*)\((\d+)\)$")


class MovieInfo:
    """A movie: id, genres, title (without the year)."""

    def __init__(self, index: Any, categories: List[str], title: str) -> None:
        self.index = int(index)
        self.categories = categories
        self.title = title

    def value(self) -> List[Any]:
        assert CATEGORIES_DICT is not None and MOVIE_TITLE_DICT is not None
        return [self.index, [CATEGORIES_DICT[c] for c in self.categories],
                [MOVIE_TITLE_DICT[w.lower()] for w in self.title.split()]]

    def __repr__(self) -> str:
        return f"<MovieInfo id({self.index}), title({self.title}), categories({self.categories})>"


class UserInfo:
    """A user: id, gender, age group, occupation."""

    def __init__(self, index: Any, gender: str, age: Any, job_id: Any) -> None:
        self.index = int(index)
        self.is_male = gender == "M"
        self.age = age_table.index(int(age))
        self.job_id = int(job_id)

    def value(self) -> List[int]:
        return [self.index, 0 if self.is_male else 1, self.age, self.job_id]

    def __repr__(self) -> str:
        return (f"<UserInfo id({self.index}), gender({'M' if self.is_male else 'F'}), age({age_table[self.age]}), "
                f"job({self.job_id})>")


MOVIE_INFO: Optional[Dict[int, MovieInfo]] = None
MOVIE_TITLE_DICT: Optional[Dict[str, int]] = None
CATEGORIES_DICT: Optional[Dict[str, int]] = None
USER_INFO: Optional[Dict[int, UserInfo]] = None


def _lines(package: zipfile.ZipFile, name: str) -> List[str]:
    with package.open(name) as f:
        return f.read().decode("latin").splitlines()


def _initialize_meta_info() -> str:
    global MOVIE_INFO, MOVIE_TITLE_DICT, CATEGORIES_DICT, USER_INFO
    fn = common.fetch("movielens", URLS, MD5)
    if MOVIE_INFO is not None:
        return fn
    movies: Dict[int, MovieInfo] = {}
    words, genres = set(), set()
    with zipfile.ZipFile(fn) as package:
        for line in _lines(package, "ml-1m/movies.dat"):
            if not line.strip():
                continue
            movie_id, title, categories = line.strip().split("::")
            cats = categories.split("|")
            m = _TITLE.match(title)
            title = m.group(1) if m else title
            movies[int(movie_id)] = MovieInfo(movie_id, cats, title)
            genres.update(cats)
            words.update(w.lower() for w in title.split())
        users = {}
        for line in _lines(package, "ml-1m/users.dat"):
            if line.strip():
                uid, gender, age, job, _ = line.strip().split("::")
                users[int(uid)] = UserInfo(uid, gender, age, job)
    MOVIE_TITLE_DICT = {w: i for i, w in enumerate(sorted(words))}
    CATEGORIES_DICT = {c: i for i, c in enumerate(sorted(genres))}
    USER_INFO, MOVIE_INFO = users, movies
    return fn


def _reader(rand_seed: int = 0, test_ratio: float = 0.1, is_test: bool = False) -> Iterator[List[Any]]:
    fn = _initialize_meta_info()
    assert MOVIE_INFO is not None and USER_INFO is not None
    with zipfile.ZipFile(fn) as package:
        lines = _lines(package, "ml-1m/ratings.dat")
    # One draw per line, as Paddle drew them; drawn at once, which gives the same numbers as drawing one by one.
    draws = np.random.RandomState(rand_seed).random_sample(len(lines))
    for line, r in zip(lines, draws):
        if (r < test_ratio) == is_test and line.strip():
            uid, mov_id, rating, _ = line.strip().split("::")
            yield USER_INFO[int(uid)].value() + MOVIE_INFO[int(mov_id)].value() + [[float(rating) * 2 - 5.0]]


def _reader_creator(**kwargs: Any) -> Callable[[], Iterator[List[Any]]]:
    return lambda: _reader(**kwargs)


train = functools.partial(_reader_creator, is_test=False)
test = functools.partial(_reader_creator, is_test=True)


def _loaded(name: str) -> Any:
    """The module's global ``name`` (``MOVIE_INFO``, ...), read from the dataset on first use, as in Paddle."""
    _initialize_meta_info()
    return globals()[name]


def get_movie_title_dict() -> Dict[str, int]:
    return _loaded("MOVIE_TITLE_DICT")


def movie_categories() -> Dict[str, int]:
    return _loaded("CATEGORIES_DICT")


def movie_info() -> Dict[int, MovieInfo]:
    return _loaded("MOVIE_INFO")


def user_info() -> Dict[int, UserInfo]:
    return _loaded("USER_INFO")


def max_movie_id() -> int:
    return max(movie_info())


def max_user_id() -> int:
    return max(user_info())


def max_job_id() -> int:
    return max(u.job_id for u in user_info().values())


def fetch() -> None:
    common.fetch("movielens", URLS, MD5)
