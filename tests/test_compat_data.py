"""paddle_cluster.compat.paddle: paddle.batch / paddle.reader, the datasets against the real files (slices placed
in Paddle's cache layout), checked downloads, paddle.init and the error for a name that is not there."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import tarfile
import threading
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import dataset_dir

import paddle_cluster.compat.paddle as paddle
from paddle_cluster.compat.missing import NotInCompat
from paddle_cluster.compat.paddle import reader as R
from paddle_cluster.compat.paddle.dataset import common, imikolov, movielens, uci_housing
from paddle_cluster.contract import dataset_home

REPO = Path(__file__).resolve().parent.parent
HOUSING = REPO / "examples" / "fit_a_line" / "housing.data"  # byte-identical to Paddle's (its MD5)
ML1M = dataset_dir("movielens", "ml-1m", var="MOVIELENS_1M")
PTB = dataset_dir("ptb", var="PTB_DIR")
need_ml1m = pytest.mark.skipif(not (ML1M / "movies.dat").is_file(), reason=f"MovieLens 1M not found at {ML1M} "
                               "(set MOVIELENS_1M to a directory with movies.dat, users.dat, ratings*.dat[.gz])")
need_ptb = pytest.mark.skipif(not (PTB / "ptb.train.txt").is_file(),
                              reason=f"PTB not found at {PTB} (set PTB_DIR to a directory with ptb.*.txt)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty dataset cache (``common.DATA_HOME``) and fresh module state."""
    home = tmp_path / "dataset"
    monkeypatch.setattr(common, "DATA_HOME", str(home))
    monkeypatch.setattr(uci_housing, "UCI_TRAIN_DATA", None)
    monkeypatch.setattr(uci_housing, "UCI_TEST_DATA", None)
    monkeypatch.setattr(movielens, "MOVIE_INFO", None)
    return home


# -- readers ---------------------------------------------------------------------------------------------


def items(n):
    return lambda: iter(range(n))


def test_batch_keeps_or_drops_the_last_short_batch():
    assert list(paddle.batch(items(7), 3)()) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(paddle.batch(items(7), 3, drop_last=True)()) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="batch_size=0"):
        paddle.batch(items(3), 0)


def test_shuffle_permutes_within_buffers_with_python_random():
    random.seed(5)
    a = list(R.shuffle(items(10), buf_size=4)())
    random.seed(5)
    assert list(R.shuffle(items(10), buf_size=4)()) == a  # random.seed makes it reproducible, as in Paddle
    assert sorted(a[:4]) == [0, 1, 2, 3] and sorted(a[4:8]) == [4, 5, 6, 7] and sorted(a[8:]) == [8, 9]
    assert sorted(R.shuffle(items(100), 500)()) == list(range(100))


def test_chain_compose_map_firstn_cache():
    assert list(R.chain(items(2), items(3))()) == [0, 1, 0, 1, 2]
    pairs = lambda: iter([(1, 2), (3, 4)])  # noqa: E731
    assert list(R.compose(pairs, items(2))()) == [(1, 2, 0), (3, 4, 1)]
    with pytest.raises(R.ComposeNotAligned):
        list(R.compose(pairs, items(3))())
    assert list(R.compose(pairs, items(3), check_alignment=False)()) == [(1, 2, 0), (3, 4, 1)]
    assert list(R.map_readers(lambda a, b: a * 10 + b, items(3), items(5))()) == [0, 11, 22]
    assert list(R.firstn(items(10), 3)()) == [0, 1, 2]
    calls = []
    c = R.cache(lambda: (calls.append(1), iter([7, 8]))[1])
    assert list(c()) == list(c()) == [7, 8] and len(calls) == 1


def test_buffered_reads_ahead_passes_errors_and_stops_when_abandoned():
    assert list(R.buffered(items(50), 4)()) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    it = R.buffered(failing, 2)()
    assert next(it) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    before = threading.active_count()
    it = R.buffered(items(10 ** 6), 2)()
    next(it)
    it.close()  # the reading thread must not stay blocked on the full queue
    deadline = 50
    while threading.active_count() > before and deadline:
        threading.Event().wait(0.1)
        deadline -= 1
    assert threading.active_count() <= before


# -- uci_housing -----------------------------------------------------------------------------------------


def test_uci_housing_records_normalisation_and_split(cache):
    (cache / "uci_housing").mkdir(parents=True)
    (cache / "uci_housing" / "housing.data").write_bytes(HOUSING.read_bytes())
    raw = np.loadtxt(HOUSING)
    assert raw.shape == (506, 14)
    norm = (raw[:, :13] - raw[:, :13].mean(axis=0)) / (raw[:, :13].max(axis=0) - raw[:, :13].min(axis=0))
    train, test = list(paddle.dataset.uci_housing.train()()), list(paddle.dataset.uci_housing.test()())
    assert (len(train), len(test)) == (404, 102)
    x, y = train[0]
    assert x.shape == (13,) and y.shape == (1,) and x.dtype == y.dtype == np.float64
    np.testing.assert_allclose(np.stack([s[0] for s in train + test]), norm, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.concatenate([s[1] for s in train + test]), raw[:, 13])
    assert y[0] == 24.0  # the first row's price
    assert uci_housing.predict_reader()[0].shape == (13,)


def test_cache_layout_follows_home_and_paddle_data_home(tmp_path, monkeypatch):
    monkeypatch.delenv("PADDLE_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dataset_home() == str(tmp_path / ".cache" / "paddle" / "dataset")
    monkeypatch.setenv("PADDLE_DATA_HOME", str(tmp_path / "elsewhere"))
    assert dataset_home() == str(tmp_path / "elsewhere")


def test_download_checks_md5_and_leaves_nothing_partial(cache, tmp_path, capsys):
    src = tmp_path / "housing.data"
    src.write_bytes(HOUSING.read_bytes())
    good = hashlib.md5(src.read_bytes()).hexdigest()
    assert good == uci_housing.MD5
    bad_url = (tmp_path / "missing" / "housing.data").as_uri()
    with pytest.raises(common.DatasetError, match=r"uci_housing: .*housing\.data is not in the dataset cache"):
        common.fetch("uci_housing", [bad_url], good)
    with pytest.raises(common.DatasetError, match="downloaded MD5"):
        common.fetch("uci_housing", [src.as_uri()], "0" * 32)
    assert not any((cache / "uci_housing").iterdir())  # the refused download was removed
    path = common.fetch("uci_housing", [bad_url, src.as_uri()], good)  # the first location fails, the second works
    assert path == str(cache / "uci_housing" / "housing.data") and common.md5file(path) == good
    assert "downloading" in capsys.readouterr().err


def test_a_cached_file_with_another_md5_is_used_and_said_once(cache, capsys):
    (cache / "uci_housing").mkdir(parents=True)
    rows = HOUSING.read_text().splitlines()[:200]  # a slice: every feature still varies (CHAS from row 143)
    (cache / "uci_housing" / "housing.data").write_text("\n".join(rows) + "\n")
    assert len(list(uci_housing.train()())) == 160
    common.fetch("uci_housing", uci_housing.URLS, uci_housing.MD5)
    assert capsys.readouterr().err.count("not PaddlePaddle's d4accdce") == 1


# -- movielens -------------------------------------------------------------------------------------------


def _ml1m_zip(cache: Path, n_ratings: int) -> list:
    ratings = sorted(ML1M.glob("ratings*.dat*"))[0]
    opener = gzip.open if ratings.suffix == ".gz" else open
    with opener(ratings, "rt", encoding="latin-1") as f:
        lines = [next(f) for _ in range(n_ratings)]
    (cache / "movielens").mkdir(parents=True)
    with zipfile.ZipFile(cache / "movielens" / "ml-1m.zip", "w") as z:
        z.write(ML1M / "movies.dat", "ml-1m/movies.dat")
        z.write(ML1M / "users.dat", "ml-1m/users.dat")
        z.writestr("ml-1m/ratings.dat", "".join(lines).encode("latin-1"))
    return [line.strip().split("::") for line in lines]


@need_ml1m
def test_movielens_records_split_and_dictionaries(cache):
    raw = _ml1m_zip(cache, 3000)
    train, test = list(paddle.dataset.movielens.train()()), list(paddle.dataset.movielens.test()())
    assert len(train) + len(test) == 3000
    draws = np.random.RandomState(0).random_sample(3000)  # Paddle: np.random.seed(0), one draw per line
    assert len(test) == int((draws < 0.1).sum())
    expect_test = [r for r, d in zip(raw, draws) if d < 0.1]
    users = {int(u): (g, int(a), int(j)) for u, g, a, j, _ in
             (line.split("::") for line in (ML1M / "users.dat").read_text(encoding="latin-1").splitlines())}
    movies = {int(m): (t, c) for m, t, c in
              (line.split("::") for line in (ML1M / "movies.dat").read_text(encoding="latin-1").splitlines())}
    titles, cats = movielens.get_movie_title_dict(), movielens.movie_categories()
    assert sorted(titles) == list(titles) and sorted(cats) == list(cats)
    assert len(cats) == 18 and cats["Action"] == 0
    for rec, (uid, mid, rating, _) in zip(test, expect_test):
        assert len(rec) == 8
        g, age, job = users[int(uid)]
        title, genres = movies[int(mid)]
        words = title[:title.rindex("(")].lower().split()
        assert rec[:5] == [int(uid), 0 if g == "M" else 1, movielens.age_table.index(age), job, int(mid)]
        assert rec[5] == [cats[c] for c in genres.split("|")]
        assert rec[6] == [titles[w] for w in words]
        assert rec[7] == [float(rating) * 2 - 5.0]
    assert train[0][:5] == [1, 1, 0, 10, 1193]  # user 1: F, under 18, occupation 10; first rating: movie 1193
    assert movielens.max_user_id() == 6040 and movielens.max_movie_id() == 3952 and movielens.max_job_id() == 20


def test_legacy_random_state_draws_match_one_by_one():
    rs = np.random.RandomState(0)
    one_by_one = [rs.random_sample() for _ in range(1000)]
    assert np.array_equal(np.random.RandomState(0).random_sample(1000), one_by_one)


# -- imikolov --------------------------------------------------------------------------------------------


def _ptb_tgz(cache: Path, n_lines: int) -> dict:
    parts = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for split in ("train", "valid", "test"):
            lines = (PTB / f"ptb.{split}.txt").read_text().splitlines(keepends=True)[:n_lines]
            data = "".join(lines).encode()
            info = tarfile.TarInfo(f"./simple-examples/data/ptb.{split}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
            parts[split] = [line.split() for line in lines]
    (cache / "imikolov").mkdir(parents=True)
    (cache / "imikolov" / "simple-examples.tgz").write_bytes(buf.getvalue())
    return parts


@need_ptb
def test_imikolov_dictionary_ngrams_and_sequences(cache):
    parts = _ptb_tgz(cache, 400)
    count = Counter(w for line in parts["train"] + parts["valid"] for w in line)
    n_lines = len(parts["train"]) + len(parts["valid"])
    count.update({"<s>": n_lines, "<e>": n_lines})
    del count["<unk>"]
    d = paddle.dataset.imikolov.build_dict(min_word_freq=5)
    kept = sorted((w for w, c in count.items() if c > 5), key=lambda w: (-count[w], w))
    assert d == {**{w: i for i, w in enumerate(kept)}, "<unk>": len(kept)}

    unk = d["<unk>"]
    grams = list(imikolov.train(d, 5)())
    expect = []
    for words in parts["train"]:
        ids = [d.get(w, unk) for w in ["<s>", *words, "<e>"]]
        expect += [tuple(ids[i - 5:i]) for i in range(5, len(ids) + 1)]
    assert grams == expect and all(isinstance(g, tuple) and len(g) == 5 for g in grams)
    seqs = list(imikolov.test(d, 0, imikolov.DataType.SEQ)())
    first = [d.get(w, unk) for w in parts["valid"][0]]
    assert seqs[0] == ([d["<s>"], *first], [*first, d["<e>"]]) and len(seqs) == len(parts["valid"])
    assert all(len(s) <= 10 for s, _ in imikolov.test(d, 10, imikolov.DataType.SEQ)())


# -- paddle.init and missing names -----------------------------------------------------------------------


def test_init_reads_paddle_init_variables_and_keywords_override(monkeypatch, capsys):
    for k in list(os.environ):
        if k.startswith("PADDLE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PADDLE_INIT_TRAINER_COUNT", "3")
    monkeypatch.setenv("PADDLE_INIT_PSERVERS", "10.0.0.1,10.0.0.2")
    monkeypatch.setenv("PADDLE_INIT_PORT", "7164")
    monkeypatch.setenv("PADDLE_INIT_NUM_GRADIENT_SERVERS", "2")
    cfg = paddle.init(use_gpu=False, trainer_id=1, ports_num=2)
    assert cfg.flags["trainer_count"] == "3" and cfg.flags["trainer_id"] == "1" and not cfg.use_gpu
    assert [str(e) for e in cfg.env.pservers] == ["10.0.0.1:7164", "10.0.0.2:7164"]
    assert (cfg.env.trainers, cfg.env.trainer_id, cfg.env.ports_num) == (2, 1, 2)
    assert paddle.init_config() is cfg
    local = paddle.init(use_gpu="True", trainer_count=1, pservers="")
    assert local.use_gpu and "use_gpu is ignored" in capsys.readouterr().err


@pytest.mark.parametrize("where,name", [(paddle, "v2"), (paddle.reader, "xmap_readers"),
                                        (paddle.dataset, "mnist"), (paddle.dataset.uci_housing, "fluid_model")])
def test_a_missing_name_is_named_and_points_to_the_docs(where, name):
    with pytest.raises(NotInCompat) as e:
        getattr(where, name)
    assert f"{where.__name__.replace('paddle_cluster.compat.', '')}.{name} is not provided" in str(e.value)
    assert "docs/migrating.md" in str(e.value)
    assert not hasattr(where, name)  # still an AttributeError for hasattr / getattr with a default
