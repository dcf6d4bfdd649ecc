"""Metrics JSON lines: round trip, torn lines, tailing, directory reads and the final metric file."""

import json
import math
import os

import numpy as np
import pytest

from paddle_cluster.train import metrics as M


def test_roundtrip_and_default_dir_from_job_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    times = iter([100.0, 101.0, 103.0])
    with M.MetricsWriter(clock=lambda: next(times)) as w:
        assert w.path == str(tmp_path / "job" / "log" / "metrics.trainer2.jsonl")
        r1 = w.log(0, 1, np.float32(0.5), samples=64, acc=np.float64(0.25), lr=0.1)
        r2 = w.log(0, 2, 0.25, samples_per_s=7.5)
    assert r1["samples_per_s"] == 64.0 and r1["time"] == 101.0 and r1["trainer"] == 2
    got = M.read_metrics(w.path)
    assert got == [r1, r2]
    assert got[0] == {"pass": 0, "step": 1, "loss": 0.5, "samples_per_s": 64.0, "time": 101.0,
                      "trainer": 2, "acc": 0.25, "lr": 0.1}
    # Every record is one line, flushed as it is written.
    with open(w.path) as f:
        assert [json.loads(line) for line in f] == [r1, r2]


def test_default_dir_without_job_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("PADDLE_JOB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with M.MetricsWriter(trainer_id=0) as w:
        w.log(0, 0, 1.0)
    assert os.path.isfile(tmp_path / "log" / "metrics.trainer0.jsonl")


def test_torn_last_line_and_restart(tmp_path):
    with M.MetricsWriter(0, str(tmp_path)) as w:
        w.log(0, 1, 1.0)
        w.log(0, 2, float("nan"))
    with open(w.path, "a") as f:
        f.write('{"pass": 0, "step": 3, "lo')  # killed mid-write
    recs = M.read_metrics(w.path)
    assert [r["step"] for r in recs] == [1, 2] and math.isnan(recs[1]["loss"])
    # A restarted trainer appends after the torn fragment without gluing onto it.
    with M.MetricsWriter(0, str(tmp_path)) as w2:
        w2.log(1, 4, 0.5)
    assert [r["step"] for r in M.read_metrics(w.path)] == [1, 2, 4]


def test_read_directory_orders_by_trainer(tmp_path):
    for i in (10, 2, 0):
        with M.MetricsWriter(i, str(tmp_path)) as w:
            w.log(0, 0, float(i))
    (tmp_path / "other.jsonl").write_text('{"x": 1}\n')
    assert [r["trainer"] for r in M.read_metrics(str(tmp_path))] == [0, 2, 10]


def test_reserved_extra_keys_rejected(tmp_path):
    with M.MetricsWriter(0, str(tmp_path)) as w, pytest.raises(ValueError):
        w.log(0, 0, 1.0, time=3)


def test_write_final(tmp_path, capsys):
    out = tmp_path / "output"
    path = M.write_final("accuracy", np.float32(0.75), str(out))
    M.write_final("loss", np.float32(0.1), str(out))
    M.write_final("steps", np.int64(30), str(out))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["final accuracy=0.75", "final loss=0.1", "final steps=30"]
    M.write_final("rmse", 0.9123456789012345, str(tmp_path / "o2"))  # 7 significant digits, printed and stored
    assert capsys.readouterr().out == "final rmse=0.9123457\n"
    assert json.loads((tmp_path / "o2" / "metrics.json").read_text()) == {"rmse": 0.9123457}
    with open(path) as f:
        assert json.load(f) == {"accuracy": 0.75, "loss": 0.1, "steps": 30}
    assert os.listdir(out) == ["metrics.json"]  # no temporary file left behind
    with pytest.raises(ValueError):
        M.write_final("bad name", 1.0, str(out))
    with pytest.raises(ValueError):
        M.write_final("acc", "high", str(out))


def test_running_mean_is_sample_weighted():
    m = M.RunningMean()
    assert m.mean == 0.0 and m.count == 0
    m.add(2.0, 3)
    m.add(6.0)
    assert m.count == 4 and m.total == 12.0 and m.mean == 3.0
