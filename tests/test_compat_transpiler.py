"""fluid.DistributeTranspiler: endpoint parsing, the job from its arguments and the launcher's contract, the pserver
program, and sync training of 2 trainers x 2 pservers equal to 1 x 1 (real TCP to in-process pservers)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from helpers import free_port_range

import paddle_cluster.compat.paddle.fluid as fluid
from paddle_cluster.compat.paddle.fluid.transpiler import parse_endpoints
from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv, derive_trainer_key
from paddle_cluster.ps import load_dense
from paddle_cluster.ps.server.pserver import PServer

SECRET = "53c7e1f8a3b9e2d5c7b4f1a6d0c8e3b9f4"  # as a job secret must be: not guessable (jobsecret.estimate)


@pytest.fixture(autouse=True)
def no_contract(monkeypatch):
    """No launcher contract unless a test sets one."""
    for name in list(os.environ):
        if name.startswith("PADDLE_"):
            monkeypatch.delenv(name)


def regression(n=64, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32) + 0.7).astype(np.float32)
    return x, y


def program(lr=0.05) -> fluid.Program:
    """``fc`` on 4 inputs, mean squared error, SGD; built into a Program of its own."""
    prog = fluid.Program()
    with fluid.program_guard(prog, fluid.Program()):
        x = fluid.layers.data(name="x", shape=[4], dtype="float32")
        y = fluid.layers.data(name="y", shape=[1], dtype="float32")
        pred = fluid.layers.fc(input=x, size=1, param_attr="fc.w", bias_attr="fc.b")
        fluid.optimizer.SGD(learning_rate=lr).minimize(fluid.layers.mean(fluid.layers.square_error_cost(pred, y)))
    return prog


# -- endpoints and the job -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,item", [
    ("127.0.0.1", "127.0.0.1"),
    ("10.0.0.1:7164,10.0.0.2", "10.0.0.2"),
    ("h:abc", "h:abc"),
    ("h:0", "h:0"),
    ("h:70000", "h:70000"),
    ("a:1,,b:2", ""),
    (":7164", ":7164"),
])
def test_bad_endpoint_is_named(bad, item):
    with pytest.raises(ValueError) as e:
        fluid.DistributeTranspiler().transpile(0, program=program(), pservers=bad, trainers=1)
    assert repr(bad) in str(e.value) and f"bad endpoint {item!r}" in str(e.value)


def test_empty_and_duplicate_endpoints():
    with pytest.raises(ValueError, match="pservers=''"):
        parse_endpoints("")
    with pytest.raises(ValueError, match="'h:1' is listed twice"):
        parse_endpoints("h:1,h:2,h:1")
    assert parse_endpoints(" a:1, b:2 ") == (Endpoint("a", 1), Endpoint("b", 2))


def test_transpile_argument_errors():
    t = fluid.DistributeTranspiler()
    with pytest.raises(ValueError, match="no pservers given"):
        t.transpile(0, program=program())
    with pytest.raises(ValueError, match=r"trainer_id=2: expected an integer in \[0, 2\)"):
        t.transpile(2, program=program(), pservers="h:1", trainers=2)
    with pytest.raises(ValueError, match="trainers=0"):
        t.transpile(0, program=program(), pservers="h:1", trainers=0)
    with pytest.raises(TypeError, match="expected a fluid.Program, got str"):
        t.transpile(0, program="main", pservers="h:1", trainers=1)
    with pytest.raises(ValueError, match="call transpile"):
        fluid.DistributeTranspiler().get_trainer_program()


def test_pserver_program_endpoint_errors():
    t = fluid.DistributeTranspiler()
    t.transpile(0, program=program(), pservers="10.0.0.1:7164,10.0.0.1:7166", trainers=2)
    assert t.get_pserver_program("10.0.0.1:7166").pserver_id == 1
    assert fluid.Executor().run(t.get_startup_program("10.0.0.1:7166")) == []
    with pytest.raises(ValueError, match=r"'10.0.0.1:7165' is not one of the pservers "
                                         r"10.0.0.1:7164,10.0.0.1:7166"):
        t.get_pserver_program("10.0.0.1:7165")
    with pytest.raises(ValueError, match="'nonsense'"):
        t.get_pserver_program("nonsense")


def test_transpile_takes_the_launcher_contract(monkeypatch):
    job = JobEnv("j1", (Endpoint("127.0.0.1", 7164), Endpoint("127.0.0.1", 7166)), trainers=3, ports_num=1,
                 ports_num_for_sparse=1, secret=SECRET)
    for k, v in job.for_process(TRAINER, 2, "127.0.0.1").to_environ().items():
        monkeypatch.setenv(k, v)
    t = fluid.DistributeTranspiler()
    t.transpile(program=program(), sync_mode=False)
    assert t.env.pservers == job.pservers and t.env.trainers == 3 and t.env.trainer_id == 2
    # A trainer holds its own key, never the job secret.
    assert t.env.trainer_key == derive_trainer_key(SECRET, "j1", 2) and not t.env.secret and t.mode == "async"
    # The seed's own construction (one port for every IP) names one pserver twice: said plainly.
    with pytest.raises(ValueError, match="listed twice"):
        t.transpile(2, program=program(), pservers="127.0.0.1:7164,127.0.0.1:7164", trainers=3)


def test_pserver_endpoint_must_match_the_launchers_pserver_id(monkeypatch):
    job = JobEnv("j1", (Endpoint("127.0.0.1", 7164), Endpoint("127.0.0.1", 7166)), trainers=2)
    for k, v in job.for_process(PSERVER, 1, "127.0.0.1").to_environ().items():
        monkeypatch.setenv(k, v)
    t = fluid.DistributeTranspiler()
    t.transpile(0, program=program())
    assert t.get_pserver_program().pserver_id == 1
    with pytest.raises(ValueError, match="launcher started this process as pserver 1"):
        t.get_pserver_program("127.0.0.1:7164")


# -- training against the job's pservers -----------------------------------------------------------------


def _train_distributed(eps, trainers, batch, x, y, steps, out):
    """``trainers`` threads, each a transpiled Program on its own shard; returns trainer 0's final params."""
    errors = []
    progs = [program(lr=0.05) for _ in range(trainers)]  # built here: program_guard is process-wide, as in Fluid

    def trainer(tid):
        try:
            t = fluid.DistributeTranspiler()
            t.transpile(tid, program=progs[tid], pservers=eps, trainers=trainers)
            tp = t.get_trainer_program()
            exe = fluid.Executor()
            for s in range(steps):
                rows = slice(s * batch * trainers, (s + 1) * batch * trainers)
                exe.run(tp, feed={"x": x[rows][tid::trainers], "y": y[rows][tid::trainers]})
            if tid == 0:
                fluid.io.save_params(exe, out, tp)
            exe.close()
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(trainers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads), "a trainer has not finished its steps"
    return load_dense(os.path.join(out, "params.npz"))


def test_two_trainers_two_pservers_sync_match_one_trainer(tmp_path, monkeypatch):
    """Sync with B per trainer on 2 trainers == 1 trainer with 2B: the same global batch every step."""
    x, y = regression(n=96)
    results = []
    secret = "f1d7e5c3a9b2d4e6f8a0c1b3d5e7f9a2c4"
    monkeypatch.setenv("PADDLE_JOB_SECRET", secret)  # a hand-started job: every process gets the secret
    for trainers, n_ps, batch in ((1, 1, 16), (2, 2, 8)):
        base = free_port_range(n_ps)
        env = JobEnv("fluid", tuple(Endpoint("127.0.0.1", base + k) for k in range(n_ps)), trainers=trainers,
                     ports_num=1, ports_num_for_sparse=0, job_dir=str(tmp_path), secret=secret)
        servers = [PServer(env, k).start() for k in range(n_ps)]
        try:
            eps = ",".join(str(e) for e in env.pservers)
            results.append(_train_distributed(eps, trainers, batch, x, y, 6, str(tmp_path / f"out{trainers}")))
            for s in servers:
                assert s.wait(10), "pserver still waiting for trainers after every exe.close()"
        finally:
            for s in servers:
                s.stop()
    one, two = results
    assert sorted(one) == ["fc.b", "fc.w"]
    first = program().var("fc.w").value
    assert not np.allclose(one["fc.w"], first)  # it trained
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-6)
