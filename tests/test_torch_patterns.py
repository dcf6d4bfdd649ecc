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
    if case == "frozen":  # never sent: exactly as it was, where AdamW's decay would have moved it
        for k in ("fc1.weight", "fc1.bias"):
            assert torch.equal(r0["final"][k], r0["start"][k]) and torch.equal(r1["final"][k], r1["start"][k])
    if case.startswith("unused"):  # the head was skipped at the steps no trainer used it, as torch skips it
        assert not torch.equal(r0["final"]["head.weight"], r0["start"]["head.weight"])
