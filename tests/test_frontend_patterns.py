"""Everyday script patterns on both front-ends (paddle_cluster.torch, paddle_cluster.paddle), each against the
framework itself on the whole batch (DDP's rule where it differs): uneven shards, a trainer that ends early, an
empty shard, ``report`` and ``average`` (docs/pytorch.md, "Patterns: shards, buffers, metrics, saving")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import patterns_job as J
import pytest
import rt_helpers as H
from helpers import cli, local_conf

from paddle_cluster.contract import TRAINER
from paddle_cluster.train.metrics import read_metrics

JOB = Path(J.__file__)
FRAMEWORKS = [pytest.param(fw, marks=pytest.mark.skipif(importlib.util.find_spec(fw) is None, reason=f"no {fw}"))
              for fw in ("torch", "paddle")]


def _two_trainers(tmp: Path, fw: str, scenario: str):
    """A pserver and 2 trainers running patterns_job; (exit codes, logs, each trainer's JSON or None)."""
    env = H.make_env(1, 2, tmp, ports_num=1, sparse_ports=1)
    outs = [tmp / f"{fw}-{scenario}-{i}.json" for i in range(2)]
    with H.procs(tmp) as pr:
        server = pr.pserver(env, 0)
        trainers = [pr.start([sys.executable, str(JOB), fw, scenario, str(outs[i])], H.proc_env(env, TRAINER, i),
                             f"trainer{i}") for i in range(2)]
        codes = H.wait_all(pr, trainers, 90)
        logs = [pr.log(t) for t in trainers]
        if codes == [0, 0]:
            assert H.wait_all(pr, [server], 15) == [0], pr.log(server)
    return codes, logs, [json.loads(o.read_text()) if o.exists() else None for o in outs]


def _reference(fw: str, scenario: str, start: dict) -> dict:
    return (J.reference_torch if fw == "torch" else J.reference_paddle)(scenario, start)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_report_and_average_on_uneven_shards(tmp_path, fw):
    """Trainer 0 on 3 samples, trainer 1 on 1: the step is the mean of their means (DDP's rule), ``average``
    gives both trainers the mean of their losses (a ReduceLROnPlateau on it follows the framework's on the whole
    batch), and ``report`` writes each trainer's metrics records at the optimizer's step."""
    codes, logs, (r0, r1) = _two_trainers(tmp_path, fw, "report")
    assert codes == [0, 0], logs
    ref = _reference(fw, "report", r0["start"])
    _close(r0["final"], ref["final"])
    assert r0["avgs"] == r1["avgs"]  # the same bits on every trainer
    np.testing.assert_allclose(r0["avgs"], [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])], rtol=1e-6)
    np.testing.assert_allclose(r0["avgs"], ref["avgs"], rtol=1e-5)
    recs = read_metrics(str(tmp_path / "log"))
    for i, r in ((0, r0), (1, r1)):
        mine = [x for x in recs if x["trainer"] == i]
        assert [x["step"] for x in mine] == [1, 2, 3, 4]
        np.testing.assert_allclose([x["loss"] for x in mine], r["losses"], rtol=1e-6)
    lrs = [x["lr"] for x in recs if x["trainer"] == 0]
    assert lrs[-1] < lrs[0]  # the plateau rule cut the rate


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_trainer_that_ends_early_leaves_the_average(tmp_path, fw):
    """Trainer 1 ends after 2 of 4 steps (DDP's ``Join`` case): from then on trainer 0's mean is the step."""
    codes, logs, (r0, r1) = _two_trainers(tmp_path, fw, "leave")
    assert codes == [0, 0], logs
    assert len(r1["losses"]) == 2
    _close(r0["final"], _reference(fw, "leave", r0["start"])["final"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_empty_shard_is_refused_in_one_line(tmp_path, fw):
    """Trainer 1's batch is empty at step 1: it fails in one line, never pushing a zero gradient that would silently
    halve the step (DDP would). torch computes zero gradients on it and ``step()`` refuses them naming the fix;
    Paddle's own backward already refuses an empty matmul, and that stays its error."""
    codes, logs, (r0, _) = _two_trainers(tmp_path, fw, "empty")
    assert codes[1] != 0, logs
    last = logs[1].strip().splitlines()[-1]
    if fw == "torch":
        assert last.startswith("ValueError: DistributedOptimizer.step(): this trainer's batch is empty") and \
            "shutdown()" in last, last
    else:
        assert "ValueError: (InvalidArgument) Required tensor shall not be nullptr" in logs[1], logs[1]


@pytest.mark.timeout(180)
def test_top_and_plot_show_a_torch_script_s_reports(tmp_path):
    """``paddle-cluster run`` of the torch script (2 trainers, the built-in pserver): ``status`` shows each
    trainer's last reported loss, ``plot`` draws the job from the records ``pct.report`` wrote."""
    pytest.importorskip("torch")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, TRAINERS_PER_NODE=2)
    env = {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    run = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "fw", "--", "torch", "report",
              str(tmp_path / "out-{rank}.json"), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [json.loads((tmp_path / f"out-{i}.json").read_text())["losses"] for i in range(2)]
    st = cli(conf, "status", "--json", env=env)
    progress = {r["name"]: r["progress"] for r in json.loads(st.stdout)["processes"]}
    for i in range(2):
        assert progress[f"trainer.{i}"] == f"step 4 loss {losses[i][-1]:.4g}", progress
    res = cli(conf, "plot", "--out", str(tmp_path / "fw.png"), env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fw.png").read_bytes().startswith(b"\x89PNG")
    assert any("trainer1" in ln and "loss" in ln and "(4 points, steps 1-4)" in ln for ln in res.stdout.splitlines())
