"""examples/word2vec: vocabulary / N-gram construction, prepare.py's split, and a real 2x2 job through the CLI."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import checkout_env, dataset_dir, local_conf

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "word2vec"
PTB = dataset_dir("ptb", var="PTB_DIR")
need_ptb = pytest.mark.skipif(not (PTB / "ptb.train.txt").is_file(),
                              reason=f"PTB dataset not found at {PTB} (set PTB_DIR to a directory with ptb.*.txt)")

sys.path.insert(0, str(EXAMPLE))
import imikolov  # noqa: E402
import prepare  # noqa: E402

TEXT = [" the cat sat ", " the dog sat on the mat ", " a cat ", " the end ", " zebra ", " on a mat the cat "]


def _env(home: Path) -> dict:
    return checkout_env({k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "XDG_"))},
                        HOME=str(home), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


# -- vocabulary and N-grams -----------------------------------------------------------------------------


def test_build_dict_orders_by_count_and_keeps_unk():
    d = imikolov.build_dict(TEXT, min_freq=1)
    c = imikolov.count_words(TEXT)
    assert c["<s>"] == c["<e>"] == len(TEXT) and c["the"] == 5
    words = sorted(d, key=d.get)
    assert words[:3] == ["<e>", "<s>", "the"]  # <s>, <e>: 6 (ties by word), the: 5
    assert [c[w] for w in words[:-1]] == sorted((c[w] for w in words[:-1]), reverse=True)
    assert words[-1] == "<unk>" and sorted(d.values()) == list(range(len(d)))
    small = imikolov.build_dict(TEXT, min_freq=3)
    assert set(small) == {"<s>", "<e>", "the", "cat", "<unk>"}


def test_build_dict_keeps_ptb_unk_id():
    d = imikolov.build_dict(["<unk> <unk> x", "<unk>"], min_freq=1)
    assert d["<unk>"] == 0 and sorted(d.values()) == list(range(len(d)))  # no hole, no duplicate


def test_ngrams_predict_every_word_and_sentence_end():
    d = imikolov.build_dict(TEXT)
    s = imikolov.ngrams([" the cat sat ", " zebra "], d, n=5)
    bos, eos = d["<s>"], d["<e>"]
    assert s.shape == (4 + 2, 5) and s.dtype == np.int32
    assert imikolov.n_samples([" the cat sat ", " zebra "]) == 6
    assert s[0].tolist() == [bos] * 4 + [d["the"]]
    assert s[2].tolist() == [bos, bos, d["the"], d["cat"], d["sat"]]
    assert s[3].tolist() == [bos, d["the"], d["cat"], d["sat"], eos]
    assert s[4].tolist() == [bos] * 4 + [d["zebra"]] and s[5].tolist() == [bos] * 3 + [d["zebra"], eos]
    assert imikolov.ngrams(["unseen word"], d, n=3)[:2, -1].tolist() == [d["<unk>"]] * 2


def test_dict_file_round_trip(tmp_path):
    d = imikolov.build_dict(TEXT)
    imikolov.save_dict(d, str(tmp_path / "w.txt"), imikolov.count_words(TEXT))
    assert imikolov.load_dict(str(tmp_path / "w.txt")) == d
    assert (tmp_path / "w.txt").read_text().splitlines()[2] == "the\t5"


@need_ptb
def test_ptb_vocabulary_and_samples():
    lines = imikolov.read_lines(str(PTB / "ptb.train.txt"))
    d = imikolov.build_dict(lines)
    assert len(d) == 10001 and d["the"] == 0  # PTB's 9,999 words (incl. <unk>) + <s> + <e>
    assert imikolov.n_samples(lines) == 887521 + 42068  # one per token and one per sentence end


# -- sharding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards,trainers", [(2, 2), (4, 2), (3, 2), (1, 3), (2, 5), (3, 3)])
def test_trainer_part_covers_every_line_once(shards, trainers):
    lines_per_shard = 7
    seen = Counter()
    for t in range(trainers):
        ids, r, g = imikolov.trainer_part(shards, t, trainers)
        for k in ids:
            seen.update((k, i) for i in range(lines_per_shard)[r::g])
        if shards == trainers:
            assert (ids, r, g) == ([t], 0, 1)  # trainer i <-> shard i
    assert seen == Counter((k, i) for k in range(shards) for i in range(lines_per_shard))


def test_prepare_split(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    text = [f" w{i % 7} x{i % 3} " for i in range(23)]
    (src / "ptb.train.txt").write_text("\n".join(text) + "\n")
    (src / "ptb.valid.txt").write_text(" w1 x1 \n")
    out = tmp_path / "out"
    assert prepare.main(["--data", str(src), "--out", str(out), "--split-count", "3"]) == 0
    parts = imikolov.shard_paths(str(out))
    assert [Path(p).name for p in parts] == ["train.txt-00000", "train.txt-00001", "train.txt-00002"]
    for i, p in enumerate(parts):
        assert imikolov.read_lines(p) == text[i::3]
        assert imikolov.train_lines(str(out), i, 3)[0] == text[i::3]  # trainer i reads shard i
        # with no shards, trainer i of 3 takes the same lines from ptb.train.txt
        assert imikolov.train_lines(str(src), i, 3)[0] == text[i::3]
    assert sorted(sum((imikolov.train_lines(str(out), t, 2)[0] for t in range(2)), [])) == sorted(text)
    meta = json.loads((out / "shards.json").read_text())
    assert [s["lines"] for s in meta["shards"]] == [8, 8, 7] and meta["split_count"] == 3
    assert imikolov.total_train_samples(str(out)) == imikolov.n_samples(text)
    assert imikolov.load_vocab(str(out))[0] == imikolov.build_dict(text)
    assert (out / "ptb.valid.txt").read_text() == " w1 x1 \n" and not (out / "ptb.test.txt").exists()
    # a later split into fewer parts leaves no stale shard behind
    assert prepare.main(["--data", str(src), "--out", str(out), "--split-count", "2"]) == 0
    assert len(imikolov.shard_paths(str(out))) == 2


def test_prepare_split_count_from_env(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ptb.train.txt").write_text("".join(f" a{i} \n" for i in range(10)))
    monkeypatch.setenv("SPLIT_COUNT", "4")
    assert prepare.main(["--data", str(src), "--out", str(tmp_path / "o")]) == 0
    assert len(imikolov.shard_paths(str(tmp_path / "o"))) == 4


# -- a real job -----------------------------------------------------------------------------------------


def unigram_ppl(train: list, valid: list, vocab: dict) -> float:
    """Add-one unigram perplexity over the same events train.py scores (words and sentence ends)."""
    targets = imikolov.ngrams(train, vocab)[:, -1]
    counts = np.bincount(targets, minlength=len(vocab)) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[imikolov.ngrams(valid, vocab)[:, -1]].mean()))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A copy of the example with a 2,000-sentence slice of PTB prepared into 2 shards under data/."""
    tmp = tmp_path_factory.mktemp("w2v")
    ws = tmp / "ws"
    ws.mkdir()
    for f in ("train.py", "model.py", "imikolov.py", "infer.py", "prepare.py"):
        shutil.copy(EXAMPLE / f, ws / f)
    src = tmp / "slice"
    src.mkdir()
    sizes = {"ptb.train.txt": 2000, "ptb.valid.txt": 200, "ptb.test.txt": 200}
    for name, n in sizes.items():
        (src / name).write_text("".join(line + "\n" for line in imikolov.read_lines(str(PTB / name))[:n]))
    assert prepare.main(["--data", str(src), "--out", str(ws / "data"), "--split-count", "2"]) == 0
    return ws, src


def run_job(tmp: Path, ws: Path, job: str, *args: str):
    """2 pservers + 2 trainers on localhost through the CLI; returns (result, job dir, final valid ppl)."""
    conf = local_conf(tmp, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, ENV={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", "--job_dispatch_package", str(ws),
           "--job_name", job, "--", "--data", "data", "--batch-size", "128", "--emb-size", "16",
           "--hidden-size", "32", "--log-every", "1000", *args]
    res = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.search(r"^\[trainer\.0@node0\] final valid_ppl=(\S+)$", res.stdout, re.M)
    assert m, res.stdout[-3000:]
    return res, tmp / "root" / job, float(m.group(1))


def slice_baseline(src: Path):
    train = imikolov.read_lines(str(src / "ptb.train.txt"))
    vocab = imikolov.build_dict(train)
    return train, vocab, unigram_ppl(train, imikolov.read_lines(str(src / "ptb.valid.txt")), vocab)


@need_ptb
def test_two_by_two_sync_job(tmp_path, workspace):
    """Sync, 2 passes: perplexity well below the slice's unigram, outputs per pass, infer.py agrees."""
    ws, src = workspace
    res, job, ppl = run_job(tmp_path, ws, "w2v", "--passes", "2")
    assert re.search(r"^\[trainer\.0@node0\] final test_ppl=\S+$", res.stdout, re.M)
    train, vocab, uni = slice_baseline(src)
    print(f"valid_ppl={ppl} unigram_ppl={uni:.1f} vocabulary={len(vocab)}")
    assert math.isfinite(ppl) and ppl < 0.75 * uni and ppl < len(vocab) / 10, (ppl, uni, len(vocab))
    final = json.loads((job / "output" / "metrics.json").read_text())
    assert final["valid_ppl"] == ppl and math.isfinite(final["test_ppl"])
    for p in ("pass-00000", "pass-00001"):
        assert (job / "output" / p / "params.npz").is_file()
        assert np.load(job / "output" / p / "emb.npy").shape == (len(vocab), 16)
    for tid in (0, 1):
        recs = [json.loads(line) for line in (job / "log" / f"metrics.trainer{tid}.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "valid_ppl" not in r]
        assert len(steps) == 2 * math.ceil(imikolov.n_samples(train) / 256) and recs[-1]["trainer"] == tid
        assert all(math.isfinite(r["loss"]) for r in steps)
    assert "trainer 0/2: train.txt-00000" in res.stdout and "trainer 1/2: train.txt-00001" in res.stdout

    inf = subprocess.run([sys.executable, "infer.py", "--file", "data/ptb.valid.txt", "--context",
                          "the company said it"], cwd=job, env=_env(job), capture_output=True, text=True, timeout=60)
    assert inf.returncode == 0, inf.stderr
    assert float(re.search(r"^ppl=(\S+)$", inf.stdout, re.M).group(1)) == pytest.approx(ppl, rel=1e-6)
    assert re.search(r"^'the company said it' -> \S+ 0\.\d+", inf.stdout, re.M), inf.stdout


@need_ptb
def test_two_by_two_async_job(tmp_path, workspace):
    """Async, 1 pass: trainer 0 waits for the other trainer, then evaluates the final model."""
    ws, src = workspace
    res, job, ppl = run_job(tmp_path, ws, "w2v-async", "--passes", "1", "--mode", "async")
    _, vocab, uni = slice_baseline(src)
    assert math.isfinite(ppl) and ppl < 0.9 * uni, (ppl, uni)
    assert json.loads((job / "output" / "metrics.json").read_text())["valid_ppl"] == ppl
    assert "mode async" in res.stdout and "all 2 trainer(s) exited 0" in res.stderr
