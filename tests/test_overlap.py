"""Gradients sent while backward runs (``train/overlap.py``, docs/pytorch.md#gradients-leave-during-backward):
real pservers and trainers over TCP (or the same-host lane, the default), plain torch on the whole batch as the
oracle."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import overlap_job as J  # noqa: E402
import rt_helpers as H  # noqa: E402
from helpers import run_alone  # noqa: E402

from paddle_cluster.contract import TRAINER  # noqa: E402


def _run(tmp: Path, *args: str, n: int = 2, lane: bool = True):
    env = dataclasses.replace(H.make_env(2, n, tmp, ports_num=1, sparse_ports=1), lane=lane)
    out = str(tmp / "res-{rank}.pt")
    with H.procs(tmp) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        trainers = [pr.start([sys.executable, J.__file__, out, *args], H.proc_env(env, TRAINER, i), f"trainer{i}")
                    for i in range(n)]
        codes = H.wait_all(pr, trainers, 90)
        assert codes == [0] * n, [pr.log(t) for t in trainers]
        assert H.wait_all(pr, servers, 15) == [0, 0], [pr.log(s) for s in servers]
    return [torch.load(out.replace("{rank}", str(i))) for i in range(n)]


@pytest.mark.timeout(120)
def test_gradients_sent_during_backward_equal_plain_torch(tmp_path):
    """Two trainers, each step two backward passes (accumulation), a branch unused in one step (no gradient:
    not updated, as torch), one step of a single pass: equal to torch.optim on the whole batch, and the
    gradients did leave during backward (buckets sent before step()). The trainers share the pservers' node:
    by default, as a user's job, dense data goes through same-host lanes (a parameter split over two of them
    read straight from there)."""
    r0, r1 = _run(tmp_path)
    ref = J.reference(r0["start"])
    for r in (r0, r1):
        for k, v in ref.items():
            torch.testing.assert_close(r["final"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # steps 1, 2, 3 and 5 overlap (step 0 learns, step 4 has fewer passes), some in more than one bucket
    assert r0["buckets"] > 4 and r1["buckets"] > 4, (r0["buckets"], r1["buckets"])
    assert r0["lanes"] and r1["lanes"]


@pytest.mark.timeout(120)
def test_fp16_compression_over_tcp_is_plain_torch_within_fp16_rounding(tmp_path):
    """``compression=pct.Compression.fp16`` (Horovod's), the lane off (PADDLE_LANE=0: every byte on TCP, where
    compression halves them): the same patterns end within float16's rounding of plain torch on the whole batch
    (the pservers update in float32), and not exactly on it (the gradients did travel as float16), having sent
    about half the bytes float32 gradients take."""
    r0, r1 = _run(tmp_path, "fp16", lane=False)
    ref = J.reference(r0["start"])
    worst = 0.0
    for r in (r0, r1):
        for k, v in ref.items():
            torch.testing.assert_close(r["final"][k], v, rtol=2e-3, atol=2e-4, msg=lambda m, k=k: f"{k}: {m}")
            worst = max(worst, float((r["final"][k] - v).abs().max()))
    assert worst > 0, "bit-identical to plain torch: the gradients did not travel as float16"
    assert not r0["lanes"] and r0["buckets"] > 4
    # Half the bytes on the wire: trainer 1 (which sends no initial values) sent its 6 steps' gradients as
    # float16, about 6 x half the model, where float32 would be 6 x the model.
    whole = J.STEPS * r1["model_bytes"]
    assert 0.45 * whole < r1["sent"] < 0.6 * whole, (r1["sent"], whole)


@pytest.mark.timeout(120)
def test_clipping_after_synchronize_is_plain_torch_and_trainer_1_sends_its_gradients_once(tmp_path):
    """``synchronize()``, ``clip_grad_norm_``, ``with opt.skip_synchronize(): opt.step()`` over TCP (lane off:
    every byte counted): plain torch clipping the whole batch's gradient, and trainer 1, whose step after
    ``synchronize()`` applies nothing of its own, sends its gradients once per step (the average's push), the
    step's push being headers only, where a payload of zeros made it twice."""
    r0, r1 = _run(tmp_path, "clip", lane=False)
    ref = J.reference(r0["start"], clip=True)
    for r in (r0, r1):
        for k, v in ref.items():
            torch.testing.assert_close(r["final"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    whole = J.STEPS * r1["model_bytes"]
    assert whole < r1["sent"] < 1.1 * whole, (r1["sent"], whole)


@pytest.fixture
def alone(tmp_path, monkeypatch):
    """This process as a script run alone: no launcher's variables (its in-process pserver), in ``tmp_path``."""
    yield from run_alone(monkeypatch, tmp_path, "torch")


@pytest.mark.timeout(60)
def test_a_backward_pass_more_than_any_step_had_fails_in_one_line(alone):
    """Once gradients leave during backward, a backward pass more than any step had (which would add to a gradient
    already sent) fails in one line naming overlap=False."""
    pct = alone
    net = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError) as e:  # bad input first: one line naming the choices
        pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), compression="bf16")
    assert str(e.value) == ("DistributedOptimizer(compression='bf16'): expected None or 'fp16' (Compression.none, "
                            "Compression.fp16)")
    opt = pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    x = torch.ones(3, 4)
    for _ in range(3):  # plain steps: from the second on, the gradients leave during backward
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    assert opt.overlap.buckets == 2
    opt.zero_grad()
    net(x).sum().backward()
    with pytest.raises(RuntimeError) as e:
        net(x).sum().backward()
    assert "overlap=False" in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.timeout(90)
def test_paddle_gradients_leave_during_backward_and_equal_plain_paddle(tmp_path, monkeypatch):
    """Paddle (its ``_register_backward_hook``): two backward passes a step, alone against the in-process pserver
    over TCP; equal to plain paddle.optimizer.Momentum on the same batches, and buckets left during backward."""
    paddle = pytest.importorskip("paddle")
    import numpy as np

    for k in [k for k in os.environ if k.startswith("PADDLE_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    import paddle_cluster.paddle as ppc

    def net_and_batches():
        paddle.seed(3)
        net = paddle.nn.Sequential(paddle.nn.Linear(6, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 2))
        rng = np.random.default_rng(0)
        return net, [(paddle.to_tensor(rng.standard_normal((8, 6)).astype("float32")),
                      paddle.to_tensor(rng.standard_normal((8, 2)).astype("float32"))) for _ in range(4)]

    def train(net, opt, batches):
        for x, y in batches:
            for part in (slice(0, 4), slice(4, 8)):
                (0.5 * paddle.nn.functional.mse_loss(net(x[part]), y[part])).backward()
            opt.step()
            opt.clear_grad()
        return {k: v.numpy() for k, v in net.state_dict().items()}

    net, batches = net_and_batches()
    plain = train(net, paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=net.parameters()), batches)
    net, batches = net_and_batches()
    opt = ppc.DistributedOptimizer(paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=net.parameters()))
    try:
        ours = train(net, opt, batches)
        assert opt.overlap.buckets == 3  # steps 1-3: one bucket each (every gradient final at once: a small model)
    finally:
        ppc.shutdown()
    for k in plain:
        np.testing.assert_allclose(ours[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
