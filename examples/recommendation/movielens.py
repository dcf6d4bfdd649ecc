"""MovieLens readers for ml-1m (``::`` files) and ml-100k (tab/pipe files), the split, and the download.

Both formats end up in one ``Dataset``: per-user categorical features (gender, age bucket, occupation),
per-movie id sequences (genres, title words) and an (n, 3) ratings array of (user, movie, rating).
Stdlib + numpy only: this runs on every trainer node.
"""

from __future__ import annotations

import glob
import gzip
import os
import re
import shutil
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

ML1M_URL = "https://files.grouplens.org/datasets/movielens/ml-1m.zip"
# ml-1m's age codes; ml-100k's raw ages are bucketed onto the same codes.
AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)
N_AGE = len(AGE_BUCKETS)
N_GENDER = 2
_YEAR = re.compile(r"\s*\(\d{4}\)\s*$")


@dataclass
class Dataset:
    """Everything the model reads. Ids are the files' own (1-based, not contiguous in general)."""

    name: str
    ratings: np.ndarray  # (n, 3) int64: user id, movie id, rating 1..5
    user_gender: Dict[int, int]  # 0 = M, 1 = F
    user_age: Dict[int, int]  # index into AGE_BUCKETS
    user_job: Dict[int, int]  # occupation index
    n_jobs: int
    movie_genres: Dict[int, List[int]]  # genre ids (0-based, into genre_names)
    movie_words: Dict[int, List[int]]  # title word ids (0-based, into words)
    movie_title: Dict[int, str]
    genre_names: List[str]
    words: List[str]

    def vocab_sizes(self) -> Dict[str, int]:
        """Each embedding table's id space (what its pserver table declares): one past the largest id."""
        users = max(int(self.ratings[:, 0].max(initial=0)), max(self.user_gender, default=0)) + 1
        movies = max(int(self.ratings[:, 1].max(initial=0)), max(self.movie_genres, default=0),
                     max(self.movie_title, default=0)) + 1
        return {"user": users, "movie": movies, "genre": max(1, len(self.genre_names)), "word": max(1, len(self.words))}


def age_bucket(age: int) -> int:
    """Index of the ml-1m age group holding ``age`` (1: under 18, 18: 18-24, ..., 56: 56+)."""
    return max(0, int(np.searchsorted(AGE_BUCKETS, age, side="right")) - 1)


def title_words(title: str) -> List[str]:
    """Lower-case words of a title without its trailing ``(year)``, as Paddle's movielens reader does."""
    return _YEAR.sub("", title).lower().split()


def _word_ids(titles: Dict[int, str]) -> Tuple[Dict[int, List[int]], List[str]]:
    words = sorted({w for t in titles.values() for w in title_words(t)})
    index = {w: i for i, w in enumerate(words)}
    return {m: [index[w] for w in title_words(t)] for m, t in titles.items()}, words


def _read_text(path: str, encoding: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode(encoding)


def _int_table(text: str, sep: str, cols: int) -> np.ndarray:
    """Integer columns of a separated text file, parsed in one numpy call (ratings files are large)."""
    flat = np.array(text.replace(sep, " ").split(), dtype=np.int64)
    if len(flat) % cols:
        raise ValueError(f"expected {cols} integer fields per line")
    return flat.reshape(-1, cols)


def ratings_files(data_dir: str) -> List[str]:
    """ml-1m ratings file(s): ``ratings.dat`` or any ``ratings*.dat[.gz]`` (e.g. a partial copy)."""
    exact = os.path.join(data_dir, "ratings.dat")
    if os.path.isfile(exact):
        return [exact]
    found = sorted(glob.glob(os.path.join(data_dir, "ratings*.dat")) + glob.glob(os.path.join(data_dir,
                                                                                            "ratings*.dat.gz")))
    return found[:1]


def detect(data_dir: str) -> str:
    """``ml-1m`` or ``ml-100k`` by the files present; a clear error when neither is there."""
    if os.path.isfile(os.path.join(data_dir, "users.dat")) and ratings_files(data_dir):
        return "ml-1m"
    if os.path.isfile(os.path.join(data_dir, "u.data")):
        return "ml-100k"
    raise FileNotFoundError(f"{data_dir} holds neither ml-1m files (users.dat, movies.dat, ratings*.dat[.gz]) "
                            f"nor ml-100k files (u.data, u.user, u.item)")


def load(data_dir: str) -> Dataset:
    kind = detect(data_dir)
    return load_ml1m(data_dir) if kind == "ml-1m" else load_ml100k(data_dir)


def load_ml1m(data_dir: str) -> Dataset:
    """``users.dat`` (UserID::Gender::Age::Occupation::Zip), ``movies.dat`` (latin-1
    MovieID::Title::Genre|Genre) and ``ratings*.dat[.gz]`` (UserID::MovieID::Rating::Timestamp)."""
    gender, age, job = {}, {}, {}
    for line in _read_text(os.path.join(data_dir, "users.dat"), "latin-1").splitlines():
        if not line.strip():
            continue
        uid, g, a, occ, _zip = line.split("::")
        gender[int(uid)] = 1 if g == "F" else 0
        age[int(uid)] = age_bucket(int(a))
        job[int(uid)] = int(occ)
    titles, genre_lists = {}, {}
    for line in _read_text(os.path.join(data_dir, "movies.dat"), "latin-1").splitlines():
        if not line.strip():
            continue
        mid, title, genres = line.split("::")
        titles[int(mid)] = title
        genre_lists[int(mid)] = [g for g in genres.split("|") if g]
    genre_names = sorted({g for gs in genre_lists.values() for g in gs})
    gindex = {g: i for i, g in enumerate(genre_names)}
    words_of, words = _word_ids(titles)
    files = ratings_files(data_dir)
    if not files:
        raise FileNotFoundError(f"no ratings.dat or ratings*.dat[.gz] in {data_dir}")
    ratings = _int_table(_read_text(files[0], "latin-1"), "::", 4)[:, :3]
    return Dataset("ml-1m", ratings, gender, age, job, max(job.values(), default=0) + 1,
                   {m: [gindex[g] for g in gs] for m, gs in genre_lists.items()}, words_of, titles, genre_names, words)


def load_ml100k(data_dir: str) -> Dataset:
    """``u.user`` (id|age|gender|occupation|zip), ``u.item`` (latin-1, id|title|dates|url|19 genre flags)
    and ``u.data`` (user<TAB>item<TAB>rating<TAB>timestamp)."""
    occ_file = os.path.join(data_dir, "u.occupation")
    users = [line.split("|") for line in _read_text(os.path.join(data_dir, "u.user"), "latin-1").splitlines()
             if line.strip()]
    if os.path.isfile(occ_file):
        jobs = [w.strip() for w in _read_text(occ_file, "latin-1").splitlines() if w.strip()]
    else:
        jobs = sorted({u[3] for u in users})
    jindex = {j: i for i, j in enumerate(jobs)}
    gender, age, job = {}, {}, {}
    for uid, a, g, occ, _zip in users:
        gender[int(uid)] = 1 if g == "F" else 0
        age[int(uid)] = age_bucket(int(a))
        job[int(uid)] = jindex.setdefault(occ, len(jindex))
    genre_file = os.path.join(data_dir, "u.genre")
    genre_names = [line.split("|")[0] for line in _read_text(genre_file, "latin-1").splitlines() if line.strip()] \
        if os.path.isfile(genre_file) else [f"genre{i}" for i in range(19)]
    titles, genres = {}, {}
    for line in _read_text(os.path.join(data_dir, "u.item"), "latin-1").splitlines():
        if not line.strip():
            continue
        f = line.split("|")
        titles[int(f[0])] = f[1]
        genres[int(f[0])] = [i for i, flag in enumerate(f[5:]) if flag.strip() == "1"]
    words_of, words = _word_ids(titles)
    ratings = _int_table(_read_text(os.path.join(data_dir, "u.data"), "latin-1"), "\t", 4)[:, :3]
    return Dataset("ml-100k", ratings, gender, age, job, len(jindex), genres, words_of, titles, genre_names, words)


def split(n: int, test_fraction: float = 0.1, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Seeded random split of rating indices ``0..n-1``: (train, test), each sorted."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def data_dir_from(arg: Optional[str], environ: Optional[Dict[str, str]] = None,
                  cache: Optional[str] = None) -> str:
    """``--data``, else ``$MOVIELENS_DIR``, else the official ml-1m zip downloaded into ``cache``."""
    env = os.environ if environ is None else environ
    if arg:
        return arg
    if env.get("MOVIELENS_DIR"):
        return env["MOVIELENS_DIR"]
    return download_ml1m(cache or os.path.join(os.getcwd(), "data"))


def download_ml1m(cache: str, url: str = ML1M_URL, timeout: float = 60.0) -> str:
    """Fetch and unpack GroupLens's ml-1m zip into ``cache/ml-1m`` (skipped when already there)."""
    target = os.path.join(cache, "ml-1m")
    if os.path.isfile(os.path.join(target, "ratings.dat")):
        return target
    os.makedirs(cache, exist_ok=True)
    print(f"no --data DIR or MOVIELENS_DIR given: downloading {url}", file=sys.stderr, flush=True)
    # Private temp names: several trainers on one node may download at once; the rename is atomic.
    tmpdir = tempfile.mkdtemp(prefix=".ml-1m.", dir=cache)
    try:
        zpath = os.path.join(tmpdir, "ml-1m.zip")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r, open(zpath, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise RuntimeError(f"cannot download {url} ({e}); this machine looks offline: pass --data DIR "
                               f"(or set MOVIELENS_DIR) naming an ml-1m or ml-100k directory") from None
        with zipfile.ZipFile(zpath) as z:
            z.extractall(tmpdir)
        try:
            os.replace(os.path.join(tmpdir, "ml-1m"), target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "ratings.dat")):
                raise
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return target

