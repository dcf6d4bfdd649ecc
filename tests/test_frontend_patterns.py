"""Everyday script patterns on both front-ends (paddle_cluster.torch, paddle_cluster.paddle), each against the
framework itself on the whole batch (DDP's rule where it differs): uneven shards, a trainer that ends early, an
empty shard, ``report`` and ``average`` (docs/pytorch.md, "Patterns: shards, buffers, metrics, saving")."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import patterns_job as J
import pytest
import rt_helpers as H
from helpers import checkout_env, cli, free_port_range, local_conf, run_alone

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


@pytest.fixture
def alone(tmp_path, monkeypatch):
    """This process as a script run alone: no launcher's variables (its in-process pserver), in ``tmp_path``."""
    yield from run_alone(monkeypatch, tmp_path)


IDS = [[[0, 3], [2, 0]], [[3, 3], [1, 0]], [[0, 0], [2, 1]]]  # each step's ids; 0 is the padding id


def test_torch_embedding_takes_nn_embedding_s_arguments(alone):
    """``pct.Embedding(V, D, 0)`` is ``nn.Embedding(V, D, padding_idx=0)``: the row stays zero, gets no gradient,
    and the model trains as plain torch does (SGD: lazy rows equal dense ones); what cannot be honoured is refused
    in one line; a name is keyword-only; ``add_param_group`` after wrapping is refused naming the fix."""
    torch = pytest.importorskip("torch")
    import paddle_cluster.torch as pct

    for kw, says in (({"max_norm": 1.0}, "Embedding(max_norm=1.0) is not supported: it renormalises"),
                     ({"scale_grad_by_freq": True}, "Embedding(scale_grad_by_freq=True) is not supported"),
                     ({"_weight": torch.zeros(10, 3)}, "Embedding(_weight=<Tensor>) is not supported"),
                     ({"padding_idx": "users"}, "Embedding: padding_idx='users' must be an integer in [-10, 10)"),
                     ({"padding_idx": 10}, "Embedding: padding_idx=10 must be an integer in [-10, 10)")):
        with pytest.raises(ValueError) as e:
            pct.Embedding(10, 3, **kw)
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)
    assert pct.Embedding(10, 3, -1).padding_idx == 9

    def model(emb):
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(3, 1)})

    def loss(m, ids):
        return m["head"](m["emb"](torch.tensor(ids)).sum(1)).square().mean()

    ours = model(pct.Embedding(10, 3, 0, init_scale=0.3, name="users"))
    inner = torch.optim.SGD(ours.parameters(), lr=0.5)
    opt = pct.DistributedOptimizer(inner, named_parameters=ours.named_parameters())
    try:
        with pytest.raises(ValueError, match=r"^add_param_group after DistributedOptimizer wrapped .* lr=0"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        start = pct.state_dict(ours)
        assert start["emb.weight"][0].abs().sum() == 0 and start["emb.weight"][1:].abs().min() > 0
        plain = model(torch.nn.Embedding(10, 3, padding_idx=0))
        plain.load_state_dict(start)
        popt = torch.optim.SGD(plain.parameters(), lr=0.5)
        for ids in IDS:
            opt.zero_grad()
            popt.zero_grad()
            loss(ours, ids).backward()
            loss(plain, ids).backward()
            opt.step()
            popt.step()
        assert (ours["emb"](torch.tensor([0, 0])) == 0).all()
        got = pct.state_dict(ours)
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
        assert (got["emb.weight"][0] == 0).all() and (got["emb.weight"] != start["emb.weight"]).any()
        rows = pct.state_dict(ours, tables="rows")
        assert 0 not in rows["emb.weight.ids"].tolist()  # never created on the pservers
        inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})  # behind the wrapper's back
        loss(ours, IDS[0]).backward()
        with pytest.raises(ValueError, match=r"^add_param_group after DistributedOptimizer wrapped"):
            opt.step()
    finally:
        pct.shutdown()


def test_paddle_embedding_takes_nn_embedding_s_arguments(alone):
    """``ppc.Embedding(V, D, 0)`` is ``paddle.nn.Embedding(V, D, padding_idx=0)``: zeros out, no gradient, the
    same training as plain Paddle; ``weight_attr`` and ``max_norm`` refused in one line."""
    paddle = pytest.importorskip("paddle")
    import paddle_cluster.paddle as ppc

    for kw, says in (({"weight_attr": paddle.ParamAttr()}, "Embedding(weight_attr=<ParamAttr>) is not supported"),
                     ({"max_norm": 1.0}, "Embedding(max_norm=1.0) is not supported"),
                     ({"padding_idx": 10}, "Embedding: padding_idx=10 must be an integer in [-10, 10)")):
        with pytest.raises(ValueError) as e:
            ppc.Embedding(10, 3, **kw)
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)

    class Model(paddle.nn.Layer):
        def __init__(self, emb):
            super().__init__()
            paddle.seed(0)
            self.emb, self.head = emb, paddle.nn.Linear(3, 1)

        def loss(self, ids):
            return self.head(self.emb(paddle.to_tensor(ids)).sum(1)).square().mean()

    ours = Model(ppc.Embedding(10, 3, 0, init_scale=0.3, name="users"))
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(learning_rate=0.5, parameters=ours.parameters()),
                                   named_parameters=ours.named_parameters())
    try:
        start = ppc.state_dict(ours)
        plain = Model(paddle.nn.Embedding(10, 3, padding_idx=0))
        plain.set_state_dict(start)
        popt = paddle.optimizer.SGD(learning_rate=0.5, parameters=plain.parameters())
        for ids in IDS:
            ours.loss(ids).backward()
            plain.loss(ids).backward()
            opt.step()
            popt.step()
            opt.clear_grad()
            popt.clear_grad()
        assert (ours.emb(paddle.to_tensor([0, 0])).numpy() == 0).all()
        got = ppc.state_dict(ours)
        for k, v in plain.state_dict().items():
            np.testing.assert_allclose(got[k].numpy(), v.numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
    finally:
        ppc.shutdown()


@pytest.mark.timeout(120)
def test_batchnorm_buffers_follow_ddp(tmp_path):
    """A BatchNorm model on 2 trainers: before each training forward every trainer takes trainer 0's running
    statistics, so each trainer's parameters and buffers after 3 steps are those of the same rank under torch DDP
    (gloo, ``broadcast_buffers=True``), and ``pct.save``'s trainer-0 buffers are DDP rank 0's."""
    pytest.importorskip("torch")
    codes, logs, ours = _two_trainers(tmp_path, "torch", "broadcast")
    assert codes == [0, 0], logs
    port = str(free_port_range(1))
    out = str(tmp_path / "ddp-{rank}.json")
    with H.procs(tmp_path) as pr:
        ranks = [pr.start([sys.executable, str(JOB), "ddp", out, port, str(r)], checkout_env(dict(os.environ)),
                          f"ddp{r}") for r in range(2)]
        assert H.wait_all(pr, ranks, 60) == [0, 0], [pr.log(r) for r in ranks]
    for r in range(2):
        ddp = json.loads(Path(out.format(rank=r)).read_text())["state"]
        _close(ours[r]["state"], ddp)
    assert ours[0]["state"]["1.running_mean"] != ours[1]["state"]["1.running_mean"]  # each its own last forward


def test_report_and_average_alone_and_their_bad_input(alone, tmp_path):
    """Alone (rank 0 of 1): ``average`` is the value itself, a tensor keeps its shape and dtype; ``report``
    writes ./log's records at the optimizer's step; a metric that is no number, or one named like a record's
    own keys, is refused in one line."""
    torch = pytest.importorskip("torch")
    import paddle_cluster.torch as pct

    w = torch.nn.Parameter(torch.ones(2))
    opt = pct.DistributedOptimizer(torch.optim.SGD([w], lr=0.5))
    try:
        assert pct.average(3.25) == 3.25
        t = pct.average(torch.tensor([[1.5, 2.0]], dtype=torch.float64))
        assert t.dtype == torch.float64 and t.tolist() == [[1.5, 2.0]]
        w.sum().backward()
        opt.step()
        rec = pct.report({"loss": torch.tensor(0.75), "acc": 1})
        assert (rec["step"], rec["loss"], rec["acc"], rec["trainer"]) == (1, 0.75, 1.0, 0)
        assert read_metrics(str(tmp_path / "log"))[-1]["loss"] == 0.75
        for bad, says in (({"loss": "low"}, "report: metric 'loss' is str 'low'; a metric is a number"),
                          ({"step": 3}, "report: metric name(s) 'step' not allowed"),
                          ({"loss": torch.ones(2, 2)}, "report: metric 'loss' is Tensor tensor([[1., 1.],;")):
            with pytest.raises(ValueError) as e:
                pct.report(bad)
            assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)
    finally:
        pct.shutdown()
