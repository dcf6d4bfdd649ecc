"""Issue 44's everyday Paddle patterns on the pservers against plain Paddle on the whole batch (DDP's rule where
it differs): 2 trainers (real processes, real TCP, 2 pservers) and alone; a frozen backbone, parameters without a
gradient, ``grad_clip`` on the whole batch's gradient, and every paddle.optimizer.lr scheduler."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("paddle")

import paddle  # noqa: E402
import paddle_patterns as J  # noqa: E402  (imports paddle, without its ccache warning)
import rt_helpers as H  # noqa: E402
from helpers import OMIT, assert_nothing_left, cli, no_traceback, run_alone, write_conf  # noqa: E402

from paddle_cluster.contract import TRAINER  # noqa: E402

JOB = Path(J.__file__)
STEPS = 6


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def _trainers(tmp: Path, case: str, n: int = 2, steps: int = STEPS):
    """2 pservers and ``n`` trainers running paddle_patterns ``case``: the exit codes, logs and outputs."""
    env = H.make_env(2, n, tmp, ports_num=1, sparse_ports=1)
    outs = [tmp / f"{case}-{i}.pkl" for i in range(n)]
    with H.procs(tmp) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        trainers = [pr.start([sys.executable, str(JOB), case, str(outs[i]), str(steps)], H.proc_env(env, TRAINER, i),
                             f"trainer{i}") for i in range(n)]
        codes = H.wait_all(pr, trainers, 90)
        logs = [pr.log(t) for t in trainers]
        if codes == [0] * n:
            assert H.wait_all(pr, servers, 15) == [0, 0], [pr.log(s) for s in servers]
    return codes, logs, [pickle.loads(o.read_bytes()) if o.exists() else None for o in outs]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", J.CASES)
def test_two_trainers_equal_plain_paddle_on_the_whole_batch(tmp_path, case):
    codes, logs, (r0, r1) = _trainers(tmp_path, case)
    assert codes == [0, 0], logs
    _close(r0["final"], r1["final"])
    _close(r0["final"], J.reference(case, r0["start"], STEPS))
    if case in ("frozen", "combined"):  # never sent: exactly as it was, where the decay would have moved it
        for k in ("fc1.weight", "fc1.bias"):
            assert np.array_equal(r0["final"][k], r0["start"][k]) and np.array_equal(r1["final"][k], r1["start"][k])


@pytest.fixture
def alone(monkeypatch, tmp_path):
    """This process as a trainer with no launcher: an in-process pserver."""
    yield from run_alone(monkeypatch, tmp_path, "paddle")


def _schedulers() -> dict:
    L = paddle.optimizer.lr
    return {
        "NoamDecay": lambda: L.NoamDecay(16, 2, learning_rate=0.5),
        "PiecewiseDecay": lambda: L.PiecewiseDecay([2, 4], [0.1, 0.05, 0.01]),
        "NaturalExpDecay": lambda: L.NaturalExpDecay(0.1, 0.5),
        "InverseTimeDecay": lambda: L.InverseTimeDecay(0.1, 0.5),
        "PolynomialDecay": lambda: L.PolynomialDecay(0.1, 2, 0.001, 2.0, cycle=True),
        "LinearWarmup": lambda: L.LinearWarmup(L.StepDecay(0.1, 2, 0.5), 3, 0.0, 0.1),
        "ExponentialDecay": lambda: L.ExponentialDecay(0.1, 0.8),
        "MultiStepDecay": lambda: L.MultiStepDecay(0.1, [1, 3], 0.5),
        "StepDecay": lambda: L.StepDecay(0.1, 2, 0.5),
        "LambdaDecay": lambda: L.LambdaDecay(0.1, lambda e: 0.9 ** e),
        "ReduceOnPlateau": lambda: L.ReduceOnPlateau(0.1, mode="max", factor=0.5, patience=0),
        "CosineAnnealingDecay": lambda: L.CosineAnnealingDecay(0.1, 3),
        "MultiplicativeDecay": lambda: L.MultiplicativeDecay(0.1, lambda e: 0.95),
        "OneCycleLR": lambda: L.OneCycleLR(0.3, STEPS + 1, three_phase=True),
        "CyclicLR": lambda: L.CyclicLR(0.01, 0.2, 2, mode="triangular2"),
        "LinearLR": lambda: L.LinearLR(0.1, 3, start_factor=0.3),
        "CosineAnnealingWarmRestarts": lambda: L.CosineAnnealingWarmRestarts(0.1, 2),
    }


def _sweep_run(make_sched, start: dict, wrap) -> dict:
    net = J.Net()
    net.set_state_dict({k: paddle.to_tensor(v) for k, v in start.items()})
    sched = make_sched()
    opt = wrap(paddle.optimizer.Momentum(sched, momentum=0.9, use_nesterov=True, parameters=net.parameters()), net)
    for step in range(STEPS):
        x, flagged, y = J.batch(step)
        paddle.nn.functional.mse_loss(net(x, flagged), y).backward()
        opt.step()
        opt.clear_grad()
        if isinstance(sched, paddle.optimizer.lr.ReduceOnPlateau):
            sched.step([1.0, 0.5, 2.0, 2.0, 0.1, 3.0][step])
        else:
            sched.step()
    return J.numpy(net.state_dict())


@pytest.mark.timeout(120)
def test_every_paddle_scheduler_alone_equals_plain_paddle(alone):
    """Alone (an in-process pserver), each paddle.optimizer.lr scheduler: plain Paddle's result."""
    ppc = alone
    paddle.seed(0)
    start = J.numpy(J.Net().state_dict())
    for name, make_sched in _schedulers().items():
        ref = _sweep_run(make_sched, start, lambda o, net: o)
        got = _sweep_run(make_sched, start,
                         lambda o, net: ppc.DistributedOptimizer(o, named_parameters=net.named_parameters()))
        ppc.shutdown()
        try:
            _close(got, ref)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_refusals_are_one_line(alone):
    """A grad_clip of another kind, or in async mode; synchronize() next to a grad_clip; a gradient for a
    parameter frozen when wrapped."""
    ppc = alone

    class Mine(paddle.nn.ClipGradByValue):
        pass

    net = J.Net()
    with pytest.raises(ValueError) as e:
        ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters(), grad_clip=Mine(1.0)))
    assert str(e.value).startswith("DistributedOptimizer: grad_clip=") and "Mine is not supported" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters(),
                                                      grad_clip=paddle.nn.ClipGradByNorm(1.0)), mode="async")
    assert str(e.value).startswith("DistributedOptimizer: grad_clip with mode='async' is not supported (clipping "
                                   "needs the step's averaged gradient: mode='sync')")
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters(),
                                                        grad_clip=paddle.nn.ClipGradByNorm(1.0)))
    with pytest.raises(RuntimeError) as e:
        opt.synchronize()
    assert str(e.value).startswith("DistributedOptimizer.synchronize(): the optimizer has a grad_clip, which step() ")
    ppc.shutdown()
    for p in net.fc1.parameters():
        p.stop_gradient = True
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters()),
                                   named_parameters=net.named_parameters())
    for p in net.fc1.parameters():
        p.stop_gradient = False
    x, flagged, y = J.batch(0)
    paddle.nn.functional.mse_loss(net(x, flagged), y).backward()
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert str(e.value).startswith("DistributedOptimizer: ") and "had stop_gradient=True when the optimizer was " \
        "wrapped, so they are not on the pservers; set stop_gradient before wrapping" in str(e.value)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_patterns_together_on_the_ssh_hosts(cluster, tmp_path):
    """Three SSH hosts, a pserver and a trainer on each (the README's conf.py keys; the built-in pserver command),
    each trainer on a third of the batch: a frozen backbone, a head some trainers (or none) use, a OneCycleLR,
    whole-batch gradient clipping, all in one script: plain Paddle's result on the whole batch."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "paddlepatterns", "--", "combined",
              "res-{rank}.pkl", str(STEPS), timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    no_traceback(res)
    found = {i: list((cluster.root_dir(i) / "paddlepatterns").rglob(f"res-{i}.pkl")) for i in range(3)}
    assert all(len(f) == 1 for f in found.values()), found
    r = [pickle.loads(found[i][0].read_bytes()) for i in range(3)]
    for i in (1, 2):
        _close(r[i]["final"], r[0]["final"])
    _close(r[0]["final"], J.reference("combined", r[0]["start"], STEPS))
    assert_nothing_left(cluster)
