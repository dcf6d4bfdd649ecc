"""examples/recommendation: the MovieLens parsers and split, and a real launcher run on a slice of ml-100k."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import checkout_env, dataset_dir, local_conf

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "recommendation"
ML100K = dataset_dir("movielens", "ml-100k", var="MOVIELENS_100K")


def _load_example_module(name: str):
    # By path, not via sys.path: the example's module names (model, movielens) are generic.
    spec = importlib.util.spec_from_file_location(f"recommendation_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


movielens = _load_example_module("movielens")

needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(),
                                  reason=f"MovieLens ml-100k not found at {ML100K} (set MOVIELENS_100K)")


# -- parsers ---------------------------------------------------------------------------------------------


def write_ml1m(d: Path, ratings_name: str = "ratings.PARTIAL-test.dat.gz") -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "users.dat").write_bytes(b"1::F::1::10::48067\n2::M::56::16::70072\n3::M::25::15::55117\n")
    # latin-1 bytes on purpose: 0xe9 is e-acute, invalid as UTF-8.
    (d / "movies.dat").write_bytes(b"1::Toy Story (1995)::Animation|Children's|Comedy\n"
                                   b"2::Caf\xe9 Society (1995)::Drama\n"
                                   b"3::Untitled (2000)::\n")
    with gzip.open(d / ratings_name, "wb") as f:
        f.write(b"1::1::5::978300760\n1::2::3::978302109\n2::1::4::978301968\n3::3::1::978300275\n")


def test_ml1m_parser_reads_partial_gz_and_latin1_titles(tmp_path):
    write_ml1m(tmp_path)
    assert movielens.detect(str(tmp_path)) == "ml-1m"
    ds = movielens.load(str(tmp_path))
    assert ds.name == "ml-1m"
    assert ds.ratings.tolist() == [[1, 1, 5], [1, 2, 3], [2, 1, 4], [3, 3, 1]]
    assert ds.user_gender == {1: 1, 2: 0, 3: 0}
    assert [movielens.AGE_BUCKETS[ds.user_age[u]] for u in (1, 2, 3)] == [1, 56, 25]
    assert ds.user_job == {1: 10, 2: 16, 3: 15} and ds.n_jobs == 17
    assert ds.movie_title[2] == "Caf\u00e9 Society (1995)"
    assert ds.genre_names == ["Animation", "Children's", "Comedy", "Drama"]
    assert ds.movie_genres == {1: [0, 1, 2], 2: [3], 3: []}
    assert [ds.words[i] for i in ds.movie_words[2]] == ["caf\u00e9", "society"]  # year dropped, lower case
    assert [ds.words[i] for i in ds.movie_words[1]] == ["toy", "story"]


def test_ml1m_prefers_plain_ratings_dat(tmp_path):
    write_ml1m(tmp_path)
    (tmp_path / "ratings.dat").write_text("2::2::2::1\n")
    assert movielens.load(str(tmp_path)).ratings.tolist() == [[2, 2, 2]]


def test_ml100k_parser_reads_tabs_pipes_and_genre_flags(tmp_path):
    (tmp_path / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n3|15|M|student|32067\n")
    (tmp_path / "u.occupation").write_text("other\nstudent\ntechnician\n")
    flags = ["0"] * 19
    a, b = list(flags), list(flags)
    a[3] = a[5] = "1"  # Animation, Comedy
    b[8] = "1"  # Drama
    (tmp_path / "u.item").write_bytes(
        b"1|Toy Story (1995)|01-Jan-1995||http://x|" + "|".join(a).encode() + b"\n"
        b"2|Gr\xe9goire Moulin (2001)|01-Jan-2001||http://y|" + "|".join(b).encode() + b"\n")
    (tmp_path / "u.data").write_text("1\t2\t4\t881250949\n3\t1\t1\t891717742\n2\t1\t5\t878887116\n")
    assert movielens.detect(str(tmp_path)) == "ml-100k"
    ds = movielens.load(str(tmp_path))
    assert ds.name == "ml-100k"
    assert ds.ratings.tolist() == [[1, 2, 4], [3, 1, 1], [2, 1, 5]]
    assert ds.user_gender == {1: 0, 2: 1, 3: 0}
    assert [movielens.AGE_BUCKETS[ds.user_age[u]] for u in (1, 2, 3)] == [18, 50, 1]
    assert ds.user_job == {1: 2, 2: 0, 3: 1} and ds.n_jobs == 3
    assert ds.movie_genres == {1: [3, 5], 2: [8]}
    assert ds.movie_title[2] == "Gr\u00e9goire Moulin (2001)"
    assert [ds.words[i] for i in ds.movie_words[2]] == ["gr\u00e9goire", "moulin"]


def test_missing_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither ml-1m .* nor ml-100k"):
        movielens.load(str(tmp_path))


def test_offline_download_says_to_pass_data(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(movielens.urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match="pass --data DIR"):
        movielens.data_dir_from(None, environ={}, cache=str(tmp_path))
    assert movielens.data_dir_from(None, environ={"MOVIELENS_DIR": "/x"}) == "/x"
    assert movielens.data_dir_from("/y", environ={"MOVIELENS_DIR": "/x"}) == "/y"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ml-1m.")]  # no temp dir left behind


def test_split_is_deterministic_disjoint_and_sized():
    train, test = movielens.split(1000, 0.1, seed=0)
    again_train, again_test = movielens.split(1000, 0.1, seed=0)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert len(test) == 100 and len(train) == 900
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(1000))
    other_train, other_test = movielens.split(1000, 0.1, seed=1)
    assert not np.array_equal(test, other_test)


# -- end to end ------------------------------------------------------------------------------------------




def ml100k_slice(d: Path, n: int) -> Path:
    d.mkdir(parents=True)
    for name in ("u.user", "u.item", "u.genre", "u.occupation"):
        (d / name).write_bytes((ML100K / name).read_bytes())
    with open(ML100K / "u.data", "rb") as f:
        (d / "u.data").write_bytes(b"".join(f.readline() for _ in range(n)))
    return d


def run_job(tmp_path: Path, name: str, data: Path, *trainer_args: str) -> subprocess.CompletedProcess:
    conf = local_conf(tmp_path, f"conf_{name}.py", PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2)
    env = checkout_env(HOME=str(tmp_path))
    env.pop("PADDLE_CLUSTER_CONF", None)
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run",
                           "--job_dispatch_package", str(EXAMPLE), "--job_name", name, "--",
                           "--data", str(data), *trainer_args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)


def global_mean_rmse(data: Path) -> float:
    ds = movielens.load(str(data))
    train, test = movielens.split(len(ds.ratings), 0.1, 0)
    mean = ds.ratings[train, 2].mean()
    return float(np.sqrt(np.mean((ds.ratings[test, 2] - mean) ** 2)))


@needs_ml100k
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_2x2_through_launcher_then_infer(tmp_path, mode):
    data = ml100k_slice(tmp_path / "ml-100k-slice", 5000)
    res = run_job(tmp_path, f"rec_{mode}", data, "--mode", mode, "--passes", "2", "--batch_size", "64")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    found = re.findall(r"^\[trainer\.0@node0\] final test_rmse=(\S+)$", res.stdout, re.M)
    assert len(found) == 1, out[-4000:]
    value = float(found[0])
    baseline = global_mean_rmse(data)  # about 1.15 on this slice
    assert math.isfinite(value) and value < min(1.10, baseline - 0.05), (value, baseline)

    job = tmp_path / "root" / f"rec_{mode}"
    assert json.loads((job / "output" / "metrics.json").read_text())["test_rmse"] == pytest.approx(value, abs=0)
    for p in ("pass-00000", "pass-00001"):
        assert {"params.npz", "embeddings.npz", "config.json"} <= {f.name for f in (job / "output" / p).iterdir()}
    for t in (0, 1):
        recs = [json.loads(line) for line in (job / "log" / f"metrics.trainer{t}.jsonl").read_text().splitlines()]
        assert len([r for r in recs if "test_rmse" not in r]) >= 2 * 35  # per-step records, both passes

    inf = subprocess.run([sys.executable, "infer.py", "--data", str(data), "--pair", "196:242"], cwd=job,
                         env=checkout_env(), capture_output=True, text=True, timeout=60)
    assert inf.returncode == 0, inf.stdout + inf.stderr
    assert re.search(r"^user 196 movie 242 \(Kolya \(1996\)\): predicted rating [1-5]\.\d{3}$", inf.stdout, re.M)
    m = re.search(r"model output/pass-00001: test_rmse=(\S+) on 500 test ratings", inf.stdout)
    assert m, inf.stdout
    assert float(m.group(1)) == pytest.approx(value, rel=1e-9)
