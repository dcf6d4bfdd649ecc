"""Issue 44's everyday PyTorch patterns on the pservers against plain torch on the whole batch (DDP's rule where
it differs): 2 trainers (real processes, real TCP, 2 pservers) and alone; a frozen backbone, parameters without a
gradient, the schedulers that write momentum and betas into the param groups, every other torch scheduler, and
whole-batch gradient clipping through ``synchronize()``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import rt_helpers as H  # noqa: E402
import torch_patterns as J  # noqa: E402
from helpers import OMIT, assert_nothing_left, cli, no_traceback, run_alone, write_conf  # noqa: E402

from paddle_cluster.contract import TRAINER  # noqa: E402

JOB = Path(J.__file__)
STEPS = 6


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _trainers(tmp: Path, case: str, n: int = 2, steps: int = STEPS):
    """2 pservers and ``n`` trainers running torch_patterns ``case``: the exit codes, logs and outputs."""
    env = H.make_env(2, n, tmp, ports_num=1, sparse_ports=1)
    outs = [str(tmp / f"{case}-{i}.pt") for i in range(n)]
    with H.procs(tmp) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        trainers = [pr.start([sys.executable, str(JOB), case, outs[i], str(steps)], H.proc_env(env, TRAINER, i),
                             f"trainer{i}") for i in range(n)]
        codes = H.wait_all(pr, trainers, 60)
        logs = [pr.log(t) for t in trainers]
        if codes == [0] * n:
            assert H.wait_all(pr, servers, 15) == [0, 0], [pr.log(s) for s in servers]
    return codes, logs, [torch.load(o) if os.path.exists(o) else None for o in outs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", J.CASES)
def test_two_trainers_equal_plain_torch_on_the_whole_batch(tmp_path, case):
    codes, logs, (r0, r1) = _trainers(tmp_path, case)
    assert codes == [0, 0], logs
    _close(r0["final"], r1["final"])
    ref = J.reference(case, r0["start"], STEPS)
    _close(r0["final"], ref)
    if case in ("frozen", "combined"):  # never sent: exactly as it was, where the decay would have moved it
        for k in ("fc1.weight", "fc1.bias"):
            assert torch.equal(r0["final"][k], r0["start"][k]) and torch.equal(r1["final"][k], r1["start"][k])
    if case.startswith("unused"):  # the head was skipped at the steps no trainer used it, as torch skips it
        assert not torch.equal(r0["final"]["head.weight"], r0["start"]["head.weight"])


def _sweep() -> dict:
    """Every torch.optim.lr_scheduler, each a factory over an optimizer (SGD with momentum unless it cycles
    Adam's betas)."""
    S = torch.optim.lr_scheduler
    return {
        "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9 ** e),
        "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
        "StepLR": lambda o: S.StepLR(o, 2, 0.5),
        "MultiStepLR": lambda o: S.MultiStepLR(o, [1, 3], 0.5),
        "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=2),
        "LinearLR": lambda o: S.LinearLR(o, start_factor=0.3, total_iters=3),
        "ExponentialLR": lambda o: S.ExponentialLR(o, 0.8),
        "SequentialLR": lambda o: S.SequentialLR(o, [S.ConstantLR(o, 0.5, 2), S.ExponentialLR(o, 0.8)], [2]),
        "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=3),
        "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 2), S.ExponentialLR(o, 0.8)]),
        "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=4, power=2.0),
        "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2),
        "CyclicLR-triangular2": lambda o: S.CyclicLR(o, 0.01, 0.2, step_size_up=1, mode="triangular2"),
        "CyclicLR-Adam-betas": lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=2),
        "OneCycleLR-three-phase": lambda o: S.OneCycleLR(o, 0.3, total_steps=STEPS + 1, three_phase=True,
                                                          anneal_strategy="linear"),
        "OneCycleLR-Adam-betas": lambda o: S.OneCycleLR(o, 0.05, total_steps=STEPS + 1),
        "ReduceLROnPlateau-max": lambda o: S.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0),
        "OneCycleLR-made-before-wrapping": lambda o: S.OneCycleLR(o, 0.3, total_steps=STEPS + 1),
    }


def _sweep_run(name: str, make_sched, start: dict, wrap) -> dict:
    net = J.Net()
    net.load_state_dict(start)
    params = dict(params=net.parameters(), lr=0.05)
    inner = torch.optim.Adam(**params) if "Adam" in name else \
        torch.optim.SGD(**params, momentum=0.9, nesterov=True)
    before = name.endswith("before-wrapping")  # on the wrapped optimizer, its keys in the groups when wrapped
    sched = make_sched(inner) if before else None
    opt = wrap(inner, net)
    sched = sched or make_sched(opt)
    for step in range(STEPS):
        x, flag, y = J.batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x, flag), y).backward()
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step([1.0, 0.5, 2.0, 2.0, 0.1, 3.0][step])
        else:
            sched.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(120)
def test_every_torch_scheduler_alone_equals_plain_torch(alone):
    """Alone (an in-process pserver), each torch.optim.lr_scheduler on the wrapper: whatever it writes into the
    param groups (lr, momentum, betas, and its own bookkeeping keys) gives plain torch's result."""
    pct = alone
    torch.manual_seed(0)
    start = J.Net().state_dict()
    for name, make_sched in _sweep().items():
        ref = _sweep_run(name, make_sched, start, lambda o, net: o)
        got = _sweep_run(name, make_sched, start,
                         lambda o, net: pct.DistributedOptimizer(o, named_parameters=net.named_parameters()))
        pct.shutdown()
        _close(got, ref)


@pytest.fixture
def alone(monkeypatch, tmp_path):
    """This process as a trainer with no launcher: an in-process pserver."""
    yield from run_alone(monkeypatch, tmp_path, "torch")


def test_refusals_are_one_line(alone):
    """An optimizer option that cannot be honoured, still refused at wrap time (a scheduler's own keys are not);
    a gradient for a parameter frozen when wrapped; skip_synchronize() without synchronize(); synchronize() in
    async mode."""
    pct = alone
    net = J.Net()
    groups = [{"params": net.fc1.parameters(), "max_lr": 0.3, "base_momentum": 0.8, "note": "mine"},
              {"params": list(net.fc2.parameters()) + list(net.head.parameters()), "maximize": True}]
    with pytest.raises(ValueError) as e:
        pct.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    assert str(e.value).startswith("DistributedOptimizer: torch.optim.SGD(maximize=True) is not supported;")
    net.fc1.requires_grad_(False)
    opt = pct.DistributedOptimizer(torch.optim.SGD(groups[:1] + [{"params": groups[1]["params"]}], lr=0.1),
                                   named_parameters=net.named_parameters())
    with pytest.raises(RuntimeError) as e:
        with opt.skip_synchronize():
            opt.step()
    assert str(e.value).startswith("DistributedOptimizer.skip_synchronize(): call opt.synchronize() after ")
    net.fc1.requires_grad_(True)
    x, flag, y = J.batch(0)
    torch.nn.functional.mse_loss(net(x, flag), y).backward()
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert str(e.value) == ("DistributedOptimizer: fc1.weight, fc1.bias had requires_grad=False when the optimizer "
                            "was wrapped, so they are not on the pservers; set requires_grad before wrapping")
    pct.shutdown()
    opt = pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), mode="async")
    with pytest.raises(RuntimeError) as e:
        opt.synchronize()
    assert str(e.value) == "synchronize(): async mode has no step average to wait for; use mode='sync'"


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_patterns_together_on_the_ssh_hosts(cluster, tmp_path):
    """Three SSH hosts, a pserver and a trainer on each (the README's conf.py keys; the built-in pserver command),
    each trainer on a third of the batch: a frozen backbone, a head some trainers (or none) use, a OneCycleLR,
    whole-batch gradient clipping, all in one script: plain torch's result on the whole batch."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "torchpatterns", "--", "combined",
              "res-{rank}.pt", str(STEPS), timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    no_traceback(res)
    found = {i: list((cluster.root_dir(i) / "torchpatterns").rglob(f"res-{i}.pt")) for i in range(3)}
    assert all(len(f) == 1 for f in found.values()), found
    r = [torch.load(found[i][0]) for i in range(3)]
    for i in (1, 2):
        _close(r[i]["final"], r[0]["final"])
    _close(r[0]["final"], J.reference("combined", r[0]["start"], STEPS))
    assert_nothing_left(cluster)
