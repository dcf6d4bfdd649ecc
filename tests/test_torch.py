"""paddle_cluster.torch: N trainers (real processes, real TCP, sync mode) each on 1/N of a global batch end where
plain torch.optim ends on the whole batch, for every supported optimizer and an LR scheduler; alone; through
``paddle-cluster run`` on the SSH test hosts; checkpoint and resume; and each bad input in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import rt_helpers as H  # noqa: E402
import torch_job as J  # noqa: E402
from helpers import OMIT, assert_nothing_left, checkout_env, cli, local_conf, no_traceback, write_conf  # noqa: E402

from paddle_cluster.contract import TRAINER  # noqa: E402

JOB = Path(J.__file__)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _trainers(tmp: Path, case: str, n: int = 2, steps: int = 5, **kw: str):
    """2 pservers and ``n`` trainers running torch_job ``case``; every process must exit 0. The trainers' outputs."""
    env = H.make_env(2, n, tmp, ports_num=1, sparse_ports=1)
    outs = [str(tmp / f"{case}-{i}.pt") for i in range(n)]
    with H.procs(tmp) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        extra = [f"{k}={v}" for k, v in kw.items()]
        trainers = [pr.start([sys.executable, str(JOB), case, outs[i], str(steps), *extra],
                             H.proc_env(env, TRAINER, i), f"trainer{i}") for i in range(n)]
        codes = H.wait_all(pr, trainers, 60)
        logs = [pr.log(t) for t in trainers]
        if codes == [0] * n:
            assert H.wait_all(pr, servers, 15) == [0, 0], [pr.log(s) for s in servers]
    return codes, logs, [torch.load(o) if os.path.exists(o) else None for o in outs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(J.CASES))
def test_two_trainers_equal_plain_torch_on_the_whole_batch(tmp_path, case):
    """SGD (plain, momentum with dampening, nesterov, weight decay), Adagrad (lr_decay, initial accumulator),
    Adam (amsgrad, weight decay), AdamW, each group its own options, a StepLR halving the rate every 2 steps;
    sgd and adagrad with an embedding table on the pservers in the same model and step."""
    codes, logs, (r0, r1) = _trainers(tmp_path, case)
    assert codes == [0, 0], logs
    _close(r0["start"], r1["start"])  # trainer 1 seeded otherwise: trainer 0's values won
    _close(r0["final"], r1["final"])
    _close(r0["final"], J.reference(case, r0["start"], 5))
    assert (r0["final"]["fc1.weight"] - r0["start"]["fc1.weight"]).abs().max() > 1e-3  # it trained
    plain = J.Net(torch.nn.Embedding(J.V, J.DIM) if J.CASES[case][2] else None)
    plain.load_state_dict(torch.load(str(tmp_path / f"{case}-0.pt.model"), weights_only=True))  # docs/pytorch.md
    _close(plain.state_dict(), r0["final"])
    assert not (tmp_path / f"{case}-1.pt.model").exists()  # trainer 0 alone writes it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_alone_without_a_launcher(tmp_path, mode):
    """No launcher: rank 0 of 1 against an in-process pserver, the whole batch, equal to plain torch."""
    out = tmp_path / "alone.pt"
    env = checkout_env({k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")})
    res = subprocess.run([sys.executable, str(JOB), "sgd", str(out), "4", f"mode={mode}"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    r = torch.load(out)
    assert (r["rank"], r["size"]) == (0, 1)
    _close(r["final"], J.reference("sgd", r["start"], 4))


@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
def test_checkpoint_and_resume_continue_a_torch_job(tmp_path):
    """``paddle-cluster run`` (2 pservers, 2 trainers): 3 steps of Adam (amsgrad in one group) and a checkpoint;
    a second job ``--resume_from`` it runs steps 3..4 from the pservers' parameters and optimizer state and
    ends where 5 uninterrupted steps of plain torch end."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, KILL_GRACE=2.0)
    env = {"HOME": str(tmp_path)}
    first = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "first", "--", "adam",
                str(tmp_path / "first-{rank}.pt"), "3", "checkpoint", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    second = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "second", "--resume_from", "first",
                 "--", "adam", str(tmp_path / "second-{rank}.pt"), "5", env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    start = torch.load(tmp_path / "first-0.pt")["start"]
    for rank in (0, 1):
        r = torch.load(tmp_path / f"second-{rank}.pt")
        assert r["start_step"] == 3
        _close(r["final"], J.reference("adam", start, 5))


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_paddle_cluster_run_on_the_ssh_hosts_equals_plain_torch(cluster, tmp_path):
    """Three SSH hosts, a pserver and a trainer on each (the README's conf.py keys; the built-in pserver command),
    each trainer on a third of the batch, with an embedding on the pservers: plain torch's result."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(JOB.read_text())
    conf = write_conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "torchjob", "--", "sgd", "res-{rank}.pt",
              "4", timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    no_traceback(res)
    found = {i: list((cluster.root_dir(i) / "torchjob").rglob(f"res-{i}.pt")) for i in range(3)}
    assert all(len(f) == 1 for f in found.values()), found
    r0 = torch.load(found[0][0])
    assert (r0["rank"], r0["size"]) == (0, 3)
    for i in (1, 2):
        _close(torch.load(found[i][0])["final"], r0["final"])
    _close(r0["final"], J.reference("sgd", r0["start"], 4))
    assert_nothing_left(cluster)


def test_trainers_disagreeing_on_a_shape_fail_naming_the_parameter(tmp_path):
    env = H.make_env(1, 2, tmp_path, ports_num=1, sparse_ports=1)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        trainers = [pr.start([sys.executable, str(JOB), "adam", str(tmp_path / f"o{i}.pt"), "2", f"hidden={4 + i}"],
                             H.proc_env(env, TRAINER, i), f"trainer{i}") for i in range(2)]
        H.wait_all(pr, trainers, 60)
        last = pr.log(trainers[1]).strip().splitlines()[-1]
    assert trainers[1].returncode != 0
    assert last.startswith("paddle_cluster.ps.errors.ConfigMismatch:") and "'name': 'fc1.bias'" in last, last


def test_bad_input_fails_in_one_line(tmp_path, monkeypatch):
    """Refused at wrap time (before connecting): an unsupported optimizer or option. Then, alone: forward before
    wrapping, step() before backward(), an id outside the table."""
    import paddle_cluster.torch as pct

    for k in [k for k in os.environ if k.startswith("PADDLE_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    w = torch.nn.Parameter(torch.zeros(2))
    for opt, says in ((torch.optim.RMSprop([w]), "torch.optim.RMSprop is not supported; supported: torch.optim.SGD"),
                      (torch.optim.SGD([w], lr=0.1, maximize=True), "SGD(maximize=True) is not supported"),
                      (torch.optim.ASGD([w]), "ASGD")):
        with pytest.raises(ValueError) as e:
            pct.DistributedOptimizer(opt)
        assert says in str(e.value) and "\n" not in str(e.value)
    net = J.Net(pct.Embedding(J.V, J.DIM))
    with pytest.raises(RuntimeError, match="wrap the optimizer"):
        net(*J.batch(0)[:2])
    opt = pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    try:
        with pytest.raises(RuntimeError) as e:
            opt.step()
        assert str(e.value).startswith("DistributedOptimizer.step() before backward()")
        with pytest.raises(ValueError) as e:
            net.emb(torch.tensor([[1, J.V]]))
        assert str(e.value) == f"embedding 'emb': id {J.V} is outside its id space [0, {J.V}) (num_embeddings={J.V})"
        J.torch.nn.functional.mse_loss(net(*J.batch(0)[:2]), J.batch(0)[2]).backward()
        opt.param_groups[0]["momentum"] = 0.9  # plain SGD when wrapped: the rule would change
        with pytest.raises(ValueError) as e:
            opt.step()
        assert str(e.value) == ("name='momentum': fixed when the model was defined (name='sgd'); only beta1, "
                                "beta2, eps, lr, momentum, weight_decay may change during training")
        with pytest.raises(RuntimeError, match="already has one"):
            pct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    finally:
        pct.shutdown()


def test_a_node_without_torch_says_so_in_one_line(tmp_path):
    """No interpreter here has numpy but not torch: a ``torch`` that fails to import stands in for a missing one."""
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    env = checkout_env(PYTHONPATH=f"{stub.parent}{os.pathsep}{H.REPO}")
    res = subprocess.run([sys.executable, "-c", "import paddle_cluster.torch"], env=env, capture_output=True,
                         text=True, timeout=60)
    import socket

    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1
    assert last.startswith("ImportError: paddle_cluster.torch needs PyTorch, which ") and \
        f"on host {socket.gethostname()} lacks: install it there with `pip install torch==2.13.0`" in last and \
        last.endswith("or set PYTHON in conf.py to an interpreter that has it"), last


def test_an_embedding_used_before_the_optimizer_wraps_it_says_which_and_the_fix():
    import torch

    import paddle_cluster.torch as pct

    for emb, which in ((pct.Embedding(50_000_000, 32), "Embedding(50000000, 32): "),
                       (pct.Embedding(10, 4, name="users"), "Embedding 'users': ")):
        with pytest.raises(RuntimeError) as e:
            emb(torch.tensor([1]))
        assert str(e.value).startswith(which + "forward before its table is on the pservers"), e.value
        assert "opt = pct.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=" in str(e.value)
