"""The pservers' side of issue 44's "no gradient" rule and of ``synchronize()``, checked against torch.optim on
every dense path: SGD folded segment by segment (a block of several segments, with weight decay), momentum and
Adam summed whole, 1 to 3 trainers (threads, each a real client over TCP to an in-process pserver), arriving
in a different order every step.

* A push flagged ``NOGRAD_FLAG`` counts as zero in the mean (DDP); a step no trainer gave a gradient leaves the
  block untouched (torch: no decay, no momentum, no Adam step count).
* ``PSClient.reduce`` (``synchronize()``) returns the trainers' mean, summed in trainer order, without applying
  it; the step then applies trainer 0's ``AVERAGED_FLAG`` gradient once, the others pushing no gradient.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List

import numpy as np
import pytest
import rt_helpers as H

from paddle_cluster.contract import Endpoint, JobEnv
from paddle_cluster.ps import OptimizerSpec
from paddle_cluster.ps.client import PSClient
from paddle_cluster.ps.server.pserver import PServer
from paddle_cluster.ps.wire import protocol as P
from paddle_cluster.ps.wire.stream import SEGMENT

torch = pytest.importorskip("torch")

STEPS = 4
# Who has a gradient, per step and trainer: trainer 0 only, nobody, everybody, all but trainer 0.
HAS = [lambda i: i == 0, lambda i: False, lambda i: True, lambda i: i != 0]
SPECS = {"sgd": OptimizerSpec("sgd", lr=0.1, weight_decay=0.05),
         "momentum": OptimizerSpec("momentum", lr=0.1, momentum=0.9, weight_decay=0.01),
         "adam": OptimizerSpec("adam", lr=0.05, weight_decay=0.01)}


def _torch_opt(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    s = SPECS[name]
    if name == "adam":
        return torch.optim.Adam([p], lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.SGD([p], lr=s.lr, momentum=s.momentum if name == "momentum" else 0.0,
                           weight_decay=s.weight_decay)


def _run(tmp, trainers: int, name: str, w0: np.ndarray, body: Callable[[PSClient, int, int], None]
         ) -> Dict[int, np.ndarray]:
    env = JobEnv(job_id="nograd", pservers=(Endpoint("127.0.0.1", H.free_port_range(2)),), trainers=trainers,
                 ports_num=2, ports_num_for_sparse=0, secret=H.SECRET, job_dir=str(tmp), barrier_timeout=30)
    server = PServer(env, 0).start()
    out: Dict[int, np.ndarray] = {}
    errors: List[BaseException] = []

    def trainer(i: int) -> None:
        try:
            ps = PSClient(env, mode="sync", optimizer=SPECS[name], trainer_id=i, max_block_bytes=2 * SEGMENT)
            ps.register_dense({"w": w0})
            for s in range(STEPS):
                time.sleep(0.01 * ((i + s) % trainers))  # vary the arrival order
                body(ps, i, s)
            out[i] = ps.pull()["w"].copy()
            ps.close()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(trainers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.stop()
    assert not errors, errors
    assert sorted(out) == list(range(trainers))
    return out


def _mean(grads: np.ndarray, s: int, trainers: int) -> np.ndarray:
    """Step ``s``'s mean: those without a gradient count as zero (None: nobody has one)."""
    have = [grads[s, i] for i in range(trainers) if HAS[s](i)]
    return None if not have else sum(have[1:], have[0].copy()) / np.float32(trainers)


def _reference(name: str, w0: np.ndarray, grads: np.ndarray, trainers: int) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = _torch_opt(name, p)
    for s in range(STEPS):
        g = _mean(grads, s, trainers)
        p.grad = None if g is None else torch.from_numpy(g)
        opt.step()
    return p.detach().numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainers", [1, 2, 3])
@pytest.mark.parametrize("name", list(SPECS))
def test_no_gradient_is_torch_and_ddp_rule(tmp_path, trainers, name):
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((768, 1024) if name == "sgd" else (64, 30)).astype(np.float32)  # sgd: 6 segments
    grads = rng.standard_normal((STEPS, trainers) + w0.shape).astype(np.float32)

    def step(ps: PSClient, i: int, s: int) -> None:
        g = grads[s, i] if HAS[s](i) else np.zeros_like(w0)
        ps.push_pull({"w": g}, {} if HAS[s](i) else {"w": P.NOGRAD_FLAG})

    out = _run(tmp_path, trainers, name, w0, step)
    ref = _reference(name, w0, grads, trainers)
    for i in range(trainers):
        np.testing.assert_allclose(out[i], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainers", [2, 3])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_synchronize_returns_the_mean_and_the_step_applies_it_once(tmp_path, trainers, name):
    """Each trainer gets the mean bit for bit (summed in trainer order); each scales it by 0.5 (a clip) and the
    step applies that: torch.optim given the scaled mean. A step nobody has a gradient for comes back None."""
    rng = np.random.default_rng(9)
    w0 = rng.standard_normal((768, 1024) if name == "sgd" else (64, 30)).astype(np.float32)
    grads = rng.standard_normal((STEPS, trainers) + w0.shape).astype(np.float32)
    seen: Dict[int, list] = {i: [] for i in range(trainers)}

    def step(ps: PSClient, i: int, s: int) -> None:
        has = HAS[s](i)
        avg = ps.reduce({"w": grads[s, i] if has else np.zeros_like(w0)}, {} if has else {"w": P.NOGRAD_FLAG})
        seen[i].append(None if avg["w"] is None else avg["w"].copy())
        final = None if avg["w"] is None else avg["w"] * np.float32(0.5)
        if i == 0 and final is not None:
            ps.push_pull({"w": final}, {"w": P.AVERAGED_FLAG})
        else:
            ps.push_pull({"w": np.zeros_like(w0)}, {"w": P.NOGRAD_FLAG})

    out = _run(tmp_path, trainers, name, w0, step)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = _torch_opt(name, p)
    for s in range(STEPS):
        mean = _mean(grads, s, trainers)
        for i in range(trainers):
            assert (seen[i][s] is None) == (mean is None)
            if mean is not None:
                assert np.array_equal(seen[i][s], mean), (s, i)
        p.grad = None if mean is None else torch.from_numpy(mean * np.float32(0.5))
        opt.step()
    for i in range(trainers):
        np.testing.assert_allclose(out[i], p.detach().numpy(), rtol=1e-5, atol=1e-6)
