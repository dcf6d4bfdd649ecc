"""paddle_cluster.paddle against plain Paddle: 2 trainers (real processes, TCP, sync mode) each on half of a
global batch end where plain paddle.optimizer ends on the whole batch, for every supported optimizer with
parameter groups and a StepDecay learning rate; alone; checkpoint and ``--resume_from``; through ``paddle-cluster
run`` on the SSH test hosts; the saved model loads with ``paddle.load``; and each bad input in one line."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("paddle")

import paddle  # noqa: E402
import paddle_job as J  # noqa: E402  (imports paddle, without its ccache warning)
import rt_helpers as H  # noqa: E402
from helpers import OMIT, assert_nothing_left, checkout_env, cli, local_conf, no_traceback, run_alone, write_conf  # noqa: E402

from paddle_cluster.contract import TRAINER  # noqa: E402

JOB = Path(J.__file__)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def _load(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.fixture
def alone(monkeypatch, tmp_path):
    """This process as a trainer with no launcher: no contract in the environment, an in-process pserver."""
    yield from run_alone(monkeypatch, tmp_path, "paddle")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(J.CASES))
def test_two_trainers_equal_plain_paddle_on_the_whole_batch(tmp_path, case):
    """SGD (a group with L2 decay, one with a learning-rate multiplier), Momentum (nesterov in one group, another
    momentum and decay in the other, L2Decay by default), Adagrad (epsilon, initial accumulator, decay), Adam
    (betas per group, L2Decay), AdamW (decoupled decay on the weights only by apply_decay_param_fun, amsgrad),
    each with a StepDecay halving the rate every 2 steps; sgd and adagrad with an embedding table on the
    pservers in the same model and step. The model trainer 0 saves loads into plain Paddle."""
    env = H.make_env(2, 2, tmp_path, ports_num=1, sparse_ports=1)
    outs = [tmp_path / f"{case}-{i}.pkl" for i in range(2)]
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        trainers = [pr.start([sys.executable, str(JOB), case, str(outs[i]), "5"], H.proc_env(env, TRAINER, i),
                             f"trainer{i}") for i in range(2)]
        assert H.wait_all(pr, trainers, 90) == [0, 0], [pr.log(t) for t in trainers]
        assert H.wait_all(pr, servers, 15) == [0, 0], [pr.log(s) for s in servers]
    r0, r1 = _load(outs[0]), _load(outs[1])
    _close(r0["start"], r1["start"])  # trainer 1 seeded otherwise: trainer 0's values won
    _close(r0["final"], r1["final"])
    _close(r0["final"], J.reference(case, r0["start"], 5))
    assert np.abs(r0["final"]["fc1.weight"] - r0["start"]["fc1.weight"]).max() > 1e-3  # it trained
    plain = J.Net(paddle.nn.Embedding(J.V, J.DIM) if J.CASES[case] else None)
    missing, unexpected = plain.set_state_dict(paddle.load(str(outs[0]) + ".model"))
    assert not missing and not unexpected
    _close(J.numpy(plain.state_dict()), r0["final"])
    assert not Path(str(outs[1]) + ".model").exists()  # trainer 0 alone writes it


@pytest.mark.timeout(60)
def test_alone_without_a_launcher(alone, tmp_path):
    """No launcher: rank 0 of 1 against an in-process pserver, the whole batch, equal to plain Paddle."""
    J.main("momentum", str(tmp_path / "alone.pkl"), 4)
    r = _load(tmp_path / "alone.pkl")
    assert (r["rank"], r["size"]) == (0, 1)
    _close(r["final"], J.reference("momentum", r["start"], 4))


def test_minimize_and_clear_grad_as_in_dygraph_paddle(alone):
    """``minimize(loss)`` after ``backward()`` is one step; ``clear_grad()`` between a forward and its backward
    keeps that lookup's rows (their gradient is still to come), after a backward drops them."""
    ppc = alone
    emb, lin = ppc.Embedding(J.V, 2, name="t"), paddle.nn.Linear(2, 1)
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(0.5, parameters=emb.parameters() + lin.parameters()))
    ids = paddle.to_tensor([[3, 5, 3]])
    out = lin(emb(ids).sum(1)).sum()
    opt.clear_grad()
    before = {n: np.array(p.numpy()) for n, p in lin.named_parameters()}
    rows = emb._bridge.lookup("t", np.array([3, 5])).rows
    out.backward()
    grads = {n: np.array(p.grad.numpy()) for n, p in lin.named_parameters()}
    w = lin.weight.numpy()[:, 0]
    opt.minimize(out)
    for n, p in lin.named_parameters():
        np.testing.assert_allclose(p.numpy(), before[n] - 0.5 * grads[n], rtol=1e-6)
    # id 3 twice: row gradient 2 * w, id 5 once: w
    after = emb._bridge.lookup("t", np.array([3, 5])).rows
    np.testing.assert_allclose(after, rows - 0.5 * np.stack([2 * w, w]), rtol=1e-6)
    opt.clear_grad()
    assert emb.row_grads() == [] and float(lin.weight.grad.abs().sum()) == 0.0


def test_a_plain_sparse_embedding_steps_as_with_paddle(alone):
    """A ``paddle.nn.Embedding(sparse=True)`` in the model (its gradient: rows only) steps as plain Paddle's SGD."""
    ppc = alone
    ours, plain = paddle.nn.Embedding(J.V, 2, sparse=True), paddle.nn.Embedding(J.V, 2, sparse=True)
    start = ours.weight.numpy()
    plain.weight.set_value(start)
    opts = [ppc.DistributedOptimizer(paddle.optimizer.SGD(0.5, parameters=ours.parameters())),
            paddle.optimizer.SGD(0.5, parameters=plain.parameters())]
    ids = paddle.to_tensor([[3, 5, 3], [7, 3, 1]])
    for emb, opt in zip((ours, plain), opts):
        (emb(ids) * paddle.arange(12, dtype="float32").reshape([2, 3, 2])).sum().backward()
        opt.step()
    np.testing.assert_allclose(ours.weight.numpy(), plain.weight.numpy(), rtol=1e-6)
    assert np.abs(ours.weight.numpy()[3] - start[3]).min() > 0.1  # it trained


@pytest.mark.parametrize("cls", ["Momentum", "Adam"])
def test_param_attr_learning_rate_and_regularizer_as_with_paddle(alone, cls):
    """A ``ParamAttr`` learning-rate multiplier and regularizer (which wins over the optimizer's weight_decay)."""
    ppc = alone
    attr = paddle.ParamAttr(learning_rate=0.5, regularizer=paddle.regularizer.L2Decay(0.3))
    ours, plain = paddle.nn.Linear(3, 2, weight_attr=attr), paddle.nn.Linear(3, 2, weight_attr=attr)
    plain.set_state_dict(ours.state_dict())
    start = ours.weight.numpy()
    opts = [getattr(paddle.optimizer, cls)(0.1, parameters=m.parameters(), weight_decay=0.01) for m in (ours, plain)]
    opts[0] = ppc.DistributedOptimizer(opts[0])
    x = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
    for _ in range(3):
        for m, opt in zip((ours, plain), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.clear_grad()
    _close(J.numpy(ours.state_dict()), J.numpy(plain.state_dict()))
    assert np.abs(ours.weight.numpy() - start).max() > 1e-3


@pytest.mark.timeout(120)
def test_checkpoint_and_resume_continue_a_paddle_job(tmp_path):
    """``paddle-cluster run`` (2 pservers, 2 trainers): 3 steps of Adam and a checkpoint; a second job
    ``--resume_from`` it runs steps 3..4 from the pservers' parameters and optimizer state (the schedule
    advanced to its step) and ends where 5 uninterrupted steps of plain Paddle end."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, KILL_GRACE=2.0)
    env = {"HOME": str(tmp_path)}
    first = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "first", "--", "adam",
                str(tmp_path / "first-{rank}.pkl"), "3", "checkpoint", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    second = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "second", "--resume_from", "first",
                 "--", "adam", str(tmp_path / "second-{rank}.pkl"), "5", env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    start = _load(tmp_path / "first-0.pkl")["start"]
    for rank in (0, 1):
        r = _load(tmp_path / f"second-{rank}.pkl")
        assert r["start_step"] == 3
        _close(r["final"], J.reference("adam", start, 5))


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_paddle_cluster_run_on_the_ssh_hosts_equals_plain_paddle(cluster, tmp_path):
    """Three SSH hosts, a pserver and a trainer on each (the README's conf.py keys; the built-in pserver command),
    each trainer on a third of the batch, with an embedding on the pservers: plain Paddle's result."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "paddlejob", "--", "adagrad",
              "res-{rank}.pkl", "4", timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    no_traceback(res)
    found = {i: list((cluster.root_dir(i) / "paddlejob").rglob(f"res-{i}.pkl")) for i in range(3)}
    assert all(len(f) == 1 for f in found.values()), found
    r0 = _load(found[0][0])
    assert (r0["rank"], r0["size"]) == (0, 3)
    for i in (1, 2):
        _close(_load(found[i][0])["final"], r0["final"])
    _close(r0["final"], J.reference("adagrad", r0["start"], 4))
    assert_nothing_left(cluster)


@pytest.mark.timeout(60)
def test_trainers_disagreeing_on_a_shape_fail_naming_the_parameter(tmp_path):
    env = H.make_env(1, 2, tmp_path, ports_num=1, sparse_ports=1)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        trainers = [pr.start([sys.executable, str(JOB), "adam", str(tmp_path / f"o{i}.pkl"), "2", f"hidden={4 + i}"],
                             H.proc_env(env, TRAINER, i), f"trainer{i}") for i in range(2)]
        H.wait_all(pr, trainers, 60)
        last = pr.log(trainers[1]).strip().splitlines()[-1]
    assert trainers[1].returncode != 0
    assert last.startswith("paddle_cluster.ps.errors.ConfigMismatch:") and "'name': 'linear_0.b_0'" in last, last


def test_bad_input_fails_in_one_line(alone):
    """Refused at wrap time (before connecting): an unsupported optimizer or option. Then, alone: forward before
    wrapping, step() before backward(), an id outside the table, a second DistributedOptimizer."""
    ppc = alone
    lin = paddle.nn.Linear(2, 1)
    P = lin.parameters()
    for make, says in (
            (lambda: paddle.optimizer.RMSProp(0.1, parameters=P),
             "paddle.optimizer.RMSProp is not supported; supported: paddle.optimizer.SGD, Momentum"),
            (lambda: paddle.optimizer.Lamb(0.1, parameters=P), "paddle.optimizer.Lamb is not supported"),
            (lambda: paddle.optimizer.Adam(0.1, parameters=P, weight_decay=paddle.regularizer.L1Decay(0.1)),
             "weight decay L1Decay (parameter linear_"),
            (lambda: paddle.optimizer.Momentum(0.1, momentum=1.5, parameters=P), "momentum must be in [0, 1)"),
            (lambda: paddle.optimizer.SGD(0.1, parameters=[paddle.create_parameter([2], "float16")]),
             "paddle.float16 is not supported (float32 and float64 parameters are)")):
        with pytest.raises(ValueError) as e:
            ppc.DistributedOptimizer(make())
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    net = J.Net(ppc.Embedding(J.V, J.DIM, name="emb"))
    with pytest.raises(RuntimeError, match="wrap the optimizer"):
        net(*J.batch(0)[:2])
    opt = ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters()))
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert str(e.value).startswith("DistributedOptimizer.step() before backward()")
    with pytest.raises(ValueError) as e:
        net.emb(paddle.to_tensor([[1, J.V]]))
    assert str(e.value) == f"embedding 'emb': id {J.V} is outside its id space [0, {J.V}) (num_embeddings={J.V})"
    with pytest.raises(RuntimeError, match="already has one"):
        ppc.DistributedOptimizer(paddle.optimizer.SGD(0.1, parameters=net.parameters()))


def test_a_node_without_paddle_says_so_in_one_line(tmp_path):
    """No interpreter here has numpy but not paddle: a ``paddle`` that fails to import stands in for a missing one."""
    stub = tmp_path / "stub" / "paddle"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'paddle'\")\n")
    env = checkout_env(PYTHONPATH=f"{stub.parent}{os.pathsep}{H.REPO}")
    res = subprocess.run([sys.executable, "-c", "import paddle_cluster.paddle"], env=env, capture_output=True,
                         text=True, timeout=60)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1
    assert last.startswith("ImportError: paddle_cluster.paddle needs PaddlePaddle, which ") and \
        f"on host {socket.gethostname()} lacks: install it there with `pip install paddlepaddle==3.3.1`" in last, last
