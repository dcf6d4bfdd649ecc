"""Helpers for the runtime tests: pserver/trainer subprocesses, models with inline gradients.

Also runnable as a trainer: ``python tests/rt_helpers.py SCENARIO OUT.npz [key=value ...]`` with the
trainer's contract in the environment (that is how the multi-process tests start trainers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from helpers import checkout_env, free_port_range, stop_groups  # noqa: E402

from paddle_cluster.contract import PSERVER, TRAINER, Endpoint, JobEnv  # noqa: E402

SECRET = "449f9768f45a2be336f877d3b677c2c83b567a85f79f63669a9075100682e3de"  # as generated: 256 bits


# -- processes ----------------------------------------------------------------------------------


def make_env(n_pservers: int, trainers: int, tmp: str, *, ports_num: int = 1, sparse_ports: int = 1,
             barrier_timeout: float = 20.0, secret: str = SECRET) -> JobEnv:
    per = ports_num + sparse_ports
    base = free_port_range(per * n_pservers)
    eps = tuple(Endpoint("127.0.0.1", base + k * per) for k in range(n_pservers))
    return JobEnv(job_id="rt-test", pservers=eps, trainers=trainers, ports_num=ports_num,
                  ports_num_for_sparse=sparse_ports, secret=secret, job_dir=str(tmp), workspace=str(tmp),
                  barrier_timeout=barrier_timeout)


def proc_env(env: JobEnv, role: str, index: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    out = dict(os.environ)
    for k in list(out):
        if k.startswith("PADDLE_"):
            del out[k]
    out.update(env.for_process(role, index, "127.0.0.1").to_environ())
    return checkout_env(out, **(extra or {}))


def trainer_env(env: JobEnv, i: int) -> JobEnv:
    """Trainer ``i``'s view of ``env`` on 127.0.0.1, for a client this test process connects itself."""
    return env.for_process(TRAINER, i, "127.0.0.1")


class Procs:
    """Every process a test starts; ``kill_all`` in a finally never leaves one running."""

    def __init__(self, tmp: str) -> None:
        self.tmp = str(tmp)
        self.procs: List[subprocess.Popen] = []
        self.logs: Dict[int, str] = {}

    def start(self, argv: Sequence[str], env: Dict[str, str], name: str, preexec_fn=None) -> subprocess.Popen:
        log_path = os.path.join(self.tmp, f"{name}.log")
        with open(log_path, "wb") as log:
            p = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
                                 start_new_session=True, preexec_fn=preexec_fn)
        self.procs.append(p)
        self.logs[p.pid] = log_path
        return p

    def pserver(self, env: JobEnv, k: int, extra: Optional[Dict[str, str]] = None, wait: bool = True,
                preexec_fn=None) -> subprocess.Popen:
        p = self.start([sys.executable, "-m", "paddle_cluster.ps"], proc_env(env, PSERVER, k, extra),
                       f"pserver{k}-{len(self.procs)}", preexec_fn)
        if wait:
            line = p.stdout.readline().decode()
            if not line.startswith("PSERVER_READY"):
                p.wait(10)
                raise RuntimeError(f"pserver {k} did not start (rc={p.returncode}): {self.log(p)}")
        return p

    def trainer(self, env: JobEnv, i: int, scenario: str, out: str, **kw: object) -> subprocess.Popen:
        argv = [sys.executable, os.path.abspath(__file__), scenario, out] + [f"{k}={v}" for k, v in kw.items()]
        return self.start(argv, proc_env(env, TRAINER, i), f"trainer{i}-{len(self.procs)}")

    def log(self, p: subprocess.Popen) -> str:
        with open(self.logs[p.pid], errors="replace") as f:
            return f.read()

    def kill_all(self) -> None:
        stop_groups(self.procs)


@contextmanager
def procs(tmp: str) -> Iterator[Procs]:
    ps = Procs(tmp)
    try:
        yield ps
    finally:
        ps.kill_all()


def run_job(env: JobEnv, tmp: str, scenario: str, timeout: float = 60, **kw: object) -> List[str]:
    """Every pserver of ``env`` and ``env.trainers`` trainers running ``scenario``: all must exit 0, the
    pservers on their own once every trainer closed. Returns the trainers' output files."""
    with procs(tmp) as pr:
        servers = [pr.pserver(env, k) for k in range(len(env.pservers))]
        outs = [os.path.join(tmp, f"t{i}.npz") for i in range(env.trainers)]
        trainers = [pr.trainer(env, i, scenario, outs[i], **kw) for i in range(env.trainers)]
        assert wait_all(pr, trainers, timeout) == [0] * len(trainers), [pr.log(t) for t in trainers]
        assert wait_all(pr, servers, 15) == [0] * len(servers), [pr.log(s) for s in servers]
    return outs


def wait_all(ps: Procs, plist: Sequence[subprocess.Popen], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in plist:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {p.args} still running after {timeout} s; log:\n{ps.log(p)}") from None
    return codes


# -- models with hand-written gradients -------------------------------------------------------------------

D, C = 2048, 8  # W has 16384 elements: with 32 KB blocks it is split in two, spread over the pservers
V, WIDTH, BAG = 500, 16, 5


def softmax_grad(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray):
    """Mean cross-entropy of softmax(xW + b) and its gradients (float32)."""
    z = x @ w + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1
    d /= np.float32(n)
    return loss, (x.T @ d).astype(np.float32), d.sum(axis=0).astype(np.float32), d


def dense_batch(trainer: int, step: int, batch: int = 16):
    rng = np.random.default_rng([trainer, step, 7])
    x = rng.standard_normal((batch, D)).astype(np.float32)
    y = rng.integers(0, C, batch)
    return x, y


def dense_init():
    rng = np.random.default_rng(42)
    return {"w": (rng.standard_normal((D, C)) * 0.01).astype(np.float32), "b": np.zeros(C, np.float32)}


def sparse_batch(trainer: int, step: int, batch: int = 12):
    rng = np.random.default_rng([trainer, step, 11])
    ids = rng.integers(0, V, (batch, BAG)).astype(np.int64)
    y = rng.integers(0, C, batch)
    return ids, y


def sparse_dense_init():
    rng = np.random.default_rng(43)
    return {"w": (rng.standard_normal((WIDTH, C)) * 0.1).astype(np.float32), "b": np.zeros(C, np.float32)}


def sparse_grads(rows: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray):
    """rows: (batch, BAG, WIDTH) embeddings -> mean-pooled -> softmax; gradients for w, b and every row."""
    e = rows.mean(axis=1).astype(np.float32)
    loss, gw, gb, d = softmax_grad(e, y, w, b)
    de = (d @ w.T).astype(np.float32) / np.float32(BAG)
    grows = np.repeat(de[:, None, :], BAG, axis=1)
    return loss, gw, gb, grows


def reference_dense(steps: int, trainers: int, lr: float):
    p = dense_init()
    for t in range(steps):
        xs, ys = zip(*(dense_batch(i, t) for i in range(trainers)))
        _, gw, gb, _ = softmax_grad(np.concatenate(xs), np.concatenate(ys), p["w"], p["b"])
        p["w"] -= np.float32(lr) * gw
        p["b"] -= np.float32(lr) * gb
    return p


def reference_sparse(steps: int, trainers: int, lr: float, seed: int, scale: float):
    from paddle_cluster.ps import init_rows

    p = sparse_dense_init()
    table = init_rows(np.arange(V), WIDTH, scale, seed)
    for t in range(steps):
        ids, ys = zip(*(sparse_batch(i, t) for i in range(trainers)))
        ids, y = np.concatenate(ids), np.concatenate(ys)
        _, gw, gb, grows = sparse_grads(table[ids], y, p["w"], p["b"])
        gt = np.zeros_like(table)
        np.add.at(gt, ids.reshape(-1), grows.reshape(-1, WIDTH))
        p["w"] -= np.float32(lr) * gw
        p["b"] -= np.float32(lr) * gb
        table -= np.float32(lr) * gt
    return p, table


# -- trainer scenarios (run in their own process) ----------------------------------------------------------


def _connect(mode: str, lr: float, **kw: object):
    from paddle_cluster.ps import OptimizerSpec, connect

    return connect(mode=mode, optimizer=OptimizerSpec("sgd", lr=lr), **kw)


def scenario_dense(out: str, steps: str = "5", lr: str = "0.5", mode: str = "sync", pushpull: str = "0") -> None:
    """``pushpull=1``: each step is one ``push_pull`` instead of ``push`` then ``pull``."""
    ps = _connect(mode, float(lr), max_block_bytes=32 * 1024)
    init = dense_init() if ps.trainer_id == 0 else {k: np.full_like(v, 9.0) for k, v in dense_init().items()}
    start = {k: v.copy() for k, v in ps.register_dense(init).items()}
    losses = []
    p = ps.pull()
    for t in range(int(steps)):
        x, y = dense_batch(ps.trainer_id, t if mode == "sync" else t % 4)
        loss, gw, gb, _ = softmax_grad(x, y, p["w"], p["b"])
        losses.append(loss)
        if pushpull == "1":
            p = ps.push_pull({"w": gw, "b": gb})
        else:
            ps.push({"w": gw, "b": gb})
            p = ps.pull()
    final = ps.pull()
    np.savez(out, start_w=start["w"], start_b=start["b"], w=final["w"], b=final["b"], losses=np.array(losses),
             step=ps.step)
    ps.close()


def scenario_sparse(out: str, steps: str = "5", lr: str = "0.5", seed: str = "3", scale: str = "0.1") -> None:
    ps = _connect("sync", float(lr))
    start = ps.register_dense(sparse_dense_init())
    ps.register_sparse("emb", WIDTH, vocab_size=V, init_scale=float(scale), seed=int(seed))
    assert start["w"].shape == (WIDTH, C)
    for t in range(int(steps)):
        p = ps.pull()
        ids, y = sparse_batch(ps.trainer_id, t)
        rows = ps.pull_sparse("emb", ids)
        _, gw, gb, grows = sparse_grads(rows, y, p["w"], p["b"])
        ps.push_sparse("emb", ids, grows.reshape(-1, WIDTH))
        ps.push({"w": gw, "b": gb})
    final = ps.pull()
    table = ps.pull_sparse("emb", np.arange(V))
    np.savez(out, w=final["w"], b=final["b"], table=table)
    ps.close()


def scenario_die_after_step(out: str) -> None:
    """Do step 0, say so, then hang until killed (the test SIGKILLs us mid-step 1)."""
    ps = _connect("sync", 0.1)
    ps.register_dense(dense_init())
    p = ps.pull()
    x, y = dense_batch(ps.trainer_id, 0)
    _, gw, gb, _ = softmax_grad(x, y, p["w"], p["b"])
    ps.push({"w": gw, "b": gb})
    ps.pull()
    print("STEP0-DONE", flush=True)
    time.sleep(600)


def scenario_ones(out: str, steps: str = "3", lr: str = "0.5", mode: str = "sync", n: str = "16384",
                  block: str = "32768", pushpull: str = "0") -> None:
    """Two equal parameters in blocks of ``block`` bytes spread over the pservers, gradient 1 for ``steps``
    steps (``pushpull=1``: by ``push_pull``). A runtime error ends the process with ``TRAINER_FAILED <type>:
    <message>`` and exit code 3."""
    from paddle_cluster.ps import PSError

    try:
        ps = _connect(mode, float(lr), max_block_bytes=int(block))
        zeros = {"w0": np.zeros(int(n), np.float32), "w1": np.zeros(int(n), np.float32)}
        ps.register_dense(zeros)
        ones = {k: np.ones_like(v) for k, v in zeros.items()}
        for _ in range(int(steps)):
            if pushpull == "1":
                ps.push_pull(ones)
            else:
                ps.pull()
                ps.push(ones)
        final = ps.pull()
        np.savez(out, w0=final["w0"], w1=final["w1"], step=ps.step)
        ps.close()
    except PSError as e:
        print(f"TRAINER_FAILED {type(e).__name__}: {e}", flush=True)
        sys.exit(3)


def scenario_wait_in_pull(out: str) -> None:
    """Push step 0, say so, then pull: trainer 0 never pushes, so the pull waits until the test kills us."""
    ps = _connect("sync", 0.1)
    ps.register_dense(dense_init())
    ps.wait(ps.push({k: np.ones_like(v) for k, v in dense_init().items()}))
    print("PULLING", flush=True)
    ps.pull()


SCENARIOS = {"dense": scenario_dense, "sparse": scenario_sparse, "die_after_step": scenario_die_after_step,
             "ones": scenario_ones, "wait_in_pull": scenario_wait_in_pull}

if __name__ == "__main__":
    name, out_path = sys.argv[1], sys.argv[2]
    kwargs = dict(a.split("=", 1) for a in sys.argv[3:])
    SCENARIOS[name](out_path, **kwargs)
