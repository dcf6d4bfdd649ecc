"""An authenticated trainer is still a guest, on real processes through the real protocol: sparse ids outside
a table's declared id space or past its row budget, a flood of new rows against the pserver's memory budget,
definitions from anyone but trainer 0, sizes that wrap, NaN/Inf gradients, connections that stall after the
handshake and guessable secrets are each refused with a clear error naming what and whose."""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import rt_helpers as H
from helpers import checkout_env, cli, local_conf
from rt_helpers import trainer_env

from paddle_cluster.contract import TRAINER, ContractError
from paddle_cluster.ps import ConfigMismatch, LimitExceeded, NonFinite, OptimizerSpec, PSError, PServer, connect
from paddle_cluster.ps.wire import auth as A
from paddle_cluster.ps.wire import protocol as P

MiB = 1 << 20


def _rss(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _both(env, mode="sync", lr=0.5):
    """Trainers 0 and 1 connected at once (each one's DECLARE waits for the other's to start)."""
    out = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, connect(
        mode=mode, optimizer=OptimizerSpec("sgd", lr=lr), env=trainer_env(env, i)))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.timeout(120)
def test_sparse_flood_is_refused_within_the_memory_budget_naming_table_id_and_limit(tmp_path):
    """The issue's flood (width 1024, 20,000 new ids a request) against a 256 MiB budget: refused before the
    pserver allocates past it; its RSS stays within budget; the trainer is told the table, the id and the limit;
    ids outside a vocabulary and rows past a hashed table's budget are refused the same way."""
    env = H.make_env(1, 1, tmp_path)
    budget = 256 * MiB
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_PSERVER_MEMORY": "256M"})
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        try:
            base = _rss(server.pid)
            ps.register_sparse("hashed", 1024, max_rows=1 << 40, init_scale=0.1)  # a budget far beyond memory
            ps.register_sparse("words", 8, vocab_size=1000, init_scale=0.1)
            ps.register_sparse("capped", 4, max_rows=3000, init_scale=0.1)
            rng = np.random.default_rng(0)
            refused = None
            for i in range(30):  # 30 x 20,000 x 4 KiB would be 2.3 GiB
                ids = rng.integers(0, 1 << 62, 20_000)
                try:
                    ps.pull_sparse("hashed", ids)
                except LimitExceeded as e:
                    refused = (i, str(e))
                    break
            assert refused is not None, "the flood was never refused"
            i, msg = refused
            assert i >= 1, refused  # rows were served up to the budget, then refused
            assert "table 'hashed'" in msg and "256 MiB memory budget" in msg and "PADDLE_PSERVER_MEMORY" in msg, msg
            peak = _rss(server.pid, "VmHWM")
            assert peak - base <= budget, f"pserver grew {(peak - base) / MiB:.0f} MiB over a 256 MiB budget"

            # Still serving; the rows it holds are intact, other tables work.
            np.testing.assert_array_equal(ps.pull_sparse("words", [0, 999]).shape, (2, 8))
            # An id outside the vocabulary: the table, the id and the space named.
            with pytest.raises(LimitExceeded, match=r"table 'words': trainer 0 sent id 1000, outside the table's "
                                                    r"id space \[0, 1000\) \(vocab_size=1000"):
                ps.pull_sparse("words", [3, 1000])
            with pytest.raises(LimitExceeded, match=r"id -5, outside"):
                ps.push_sparse("words", [-5, 2], np.ones((2, 8), np.float32))
                ps.wait()
            # A hashed table's row budget: rows past it refused, naming the first new id and the limit.
            ps.pull_sparse("capped", np.arange(0, 2000) * 7919)
            with pytest.raises(LimitExceeded, match=r"table 'capped': 1500 new rows would make 3500 on pserver 0, "
                                                    r"past its row budget of 3000 \(max_rows=3000 over 1 pservers\); "
                                                    r"the first new id is 1000000"):
                ps.pull_sparse("capped", np.arange(1_000_000, 1_001_500))
            # More ids in one request than the table may ever hold: refused from the header, nothing read.
            with pytest.raises(LimitExceeded, match=r"a pull of 3001 ids, more than the 3000 rows"):
                ps.pull_sparse("capped", np.arange(3001))
            assert ps.status()[0]["tables"]["2"]["rows"] == 2000
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(90)
def test_definitions_come_from_trainer_0_and_a_conflicting_one_is_the_other_trainers_error(tmp_path):
    env = H.make_env(1, 2, tmp_path, barrier_timeout=5.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_PSERVER_MEMORY": "256M"})
        t0, t1 = _both(env)
        try:
            # Trainer 1 defines first with lr=1e6: it waits for trainer 0, whose definition wins; then it is
            # trainer 1's error, not trainer 0's. (Trainer 1 gets a head start; whichever definition arrives
            # first, trainer 0's is the block's, as asserted below.)
            w = np.zeros(16, np.float32)
            got = {}
            th = threading.Thread(target=lambda: got.__setitem__("t1", _catch(
                lambda: t1.register_dense({"w": w}, optimizer=OptimizerSpec("sgd", lr=1e6)))))
            th.start()
            time.sleep(1.0)
            t0.register_dense({"w": w + 1})
            th.join(10)
            assert isinstance(got["t1"], ConfigMismatch), got
            assert "trainer 1 uses optimizer" in str(got["t1"]) and "1000000.0" in str(got["t1"])
            assert t0.status()[0]["blocks"]["0"]["lr"] == 0.5
            # A table trainer 0 never defines: trainer 1 waits, then a barrier timeout names trainer 0.
            with pytest.raises(Exception, match=r"waiting for trainer 0 to define it.*trainer 0"):
                t1.register_sparse("only-mine", 4, vocab_size=10)
            # A block too big for the budget, with a size that wraps in int64 (2^32 x 2^32): refused whole.
            with pytest.raises(LimitExceeded, match=r"block of 73786976294838206464 bytes exceeds the 1073741824-byte"):
                _def_dense(t0, "huge", [1 << 32, 1 << 32], key=99)
            with pytest.raises(LimitExceeded, match=r"memory budget"):
                for k in range(100, 100_000):  # a definition flood: each block costs its arrays and more
                    _def_dense(t0, f"b{k}", [64 * 1024], key=k)
        finally:
            for t in (t1, t0):
                t.close()
        assert H.wait_all(pr, [server], 20) == [0]


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - handed to the test's thread
        return e
    return None


def _def_dense(ps, name, shape, key):
    """A DEF_DENSE frame a client would not send (any shape), over trainer's own control channel."""
    body = {"name": name, "lo": 0, "hi": shape[0], "shape": shape, "dtype": "float32"}
    return ps._ctl(0).submit(lambda ch: ch.call_json(P.Op.DEF_DENSE, body, key)).result()


@pytest.mark.timeout(120)
def test_nan_and_inf_gradients_are_refused_naming_parameter_and_trainer(tmp_path):
    """Dense (whole-block and segment-folded paths) and sparse; nothing reaches the parameters; with
    PADDLE_ALLOW_NONFINITE=1 they are accepted."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="async", optimizer=OptimizerSpec("adam", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.ones(1000, np.float32)})
            ps.register_sparse("emb", 4, vocab_size=100)
            before = ps.pull()["w"].copy()
            g = np.ones(1000, np.float32)
            g[500] = np.nan
            with pytest.raises(NonFinite, match=r"trainer 0 pushed a gradient of block w\[0:1000\] holding NaN "
                                                 r"or Inf at step 0; refused.*PADDLE_ALLOW_NONFINITE=1"):
                ps.push({"w": g})
                ps.wait()
            np.testing.assert_array_equal(ps.pull()["w"], before)
            rows = np.ones((2, 4), np.float32)
            rows[1, 3] = -np.inf
            with pytest.raises(NonFinite, match=r"gradient of table 'emb'"):
                ps.push_sparse("emb", [3, 4], rows)
                ps.wait()
            assert np.isfinite(ps.pull_sparse("emb", [3, 4])).all()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]

        # Sync SGD folds a push segment by segment (dense.py): a NaN in a later segment is refused too.
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 0))
        try:
            big = np.zeros(3 * MiB // 4, np.float32)  # three 1 MiB segments
            ps.register_dense({"big": big})
            g = np.zeros_like(big)
            g[-1] = np.inf
            with pytest.raises(NonFinite, match=r"block big\[0:786432\]"):
                ps.push({"big": g})
                ps.wait()
            assert np.isfinite(ps._dense.pull(["big"], 0)["big"]).all()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]

        server = pr.pserver(env, 0, {"PADDLE_ALLOW_NONFINITE": "1"})
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(4, np.float32)})
            ps.push({"w": np.array([np.nan, 1, 1, 1], np.float32)})
            assert np.isnan(ps.pull()["w"][0])
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]
        assert "NaN/Inf gradients accepted (PADDLE_ALLOW_NONFINITE=1)" in pr.log(server)


def _until_refused(push, n=15):
    """Call ``push`` ``n`` times; (the index of the refused call, its NonFinite)."""
    for i in range(n):
        try:
            push()
        except NonFinite as e:
            return i, e
    raise AssertionError(f"none of {n} pushes was refused")


@pytest.mark.timeout(120)
def test_updates_and_definitions_that_would_make_values_non_finite_are_refused(tmp_path):
    """Finite gradients can still overflow: 15 pushes of 3e38 at lr 0.1 would take a float32 parameter past its
    range (-inf at the 12th). That update is refused naming the parameter and the trainer, and -inf is never
    served: a sparse row is left as it was, a dense block (its values lost) is no longer served, on the
    whole-block path and on sync SGD's segment path. Trainer 0's initial value holding NaN and a table's
    init_scale of 1e999 are refused too."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(4, np.float32)})
            ps.register_sparse("emb", 4, vocab_size=100, init_scale=0.1)
            big = np.full(4, 3e38, np.float32)
            before = {}

            def push_row():
                before["row"] = ps.pull_sparse("emb", [5]).copy()
                ps.push_sparse("emb", [5], big[None, :])
                ps.push({"w": np.zeros(4, np.float32)})  # ends the step
                ps.wait()

            i, e = _until_refused(push_row)
            assert i == 11 and "the update of table 'emb' at step" in str(e) and "from trainer 0's" in str(e), (i, e)
            np.testing.assert_array_equal(ps.pull_sparse("emb", [5]), before["row"])  # unchanged, finite
            assert np.isfinite(before["row"]).all()
            i, e = _until_refused(lambda: (ps.push({"w": big}), ps.wait()))
            assert i == 11, i
            assert re.search(r"the update of block w\[0:4\] at step 23 from trainer 0's gradient would make it hold "
                             r"NaN or Inf \(finite values overflowed", str(e)), e
            with pytest.raises(PSError, match=r"block w\[0:4\] at step 23 .* NaN or Inf"):
                ps.pull()
            with pytest.raises(NonFinite, match=r"trainer 0's initial value of block v\[0:4\] holds NaN or Inf"):
                ps.register_dense({"v": np.array([0, np.nan, 0, 0], np.float32)})
            body = (b'{"name":"inf","width":2,"dtype":"float32","init_scale":1e999,"seed":0,"vocab_size":10,'
                    b'"max_rows":null}')
            header = P.pack_header(P.Op.DEF_SPARSE, P.DTYPE_JSON, key=77, length=len(body))
            with pytest.raises(NonFinite, match=r"table 'inf': init_scale=inf would make rows of float32 that are not "
                                                r"finite; refused"):
                ps._ctl(0).submit(lambda ch: (ch.send(header, body), ch.reply_json())).result()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]

        # Sync SGD folds and applies a push segment by segment (dense.py): each segment is checked once applied.
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_dense({"big": np.zeros(3 * MiB // 4, np.float32)})  # three 1 MiB segments
            g = np.zeros(3 * MiB // 4, np.float32)
            g[-1] = 3e38
            i, e = _until_refused(lambda: (ps.push({"big": g}), ps.wait()))
            assert i == 11 and "the update of block big[0:786432] at step 11 from trainer 0's gradient" in str(e)
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]

    # Two sync trainers: the one whose push completes the step is refused, the other's pull, waiting for that
    # step, fails at once with the same message (not a barrier timeout naming nobody's fault).
    env = H.make_env(1, 2, tmp_path, barrier_timeout=30.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        clients = _both(env, lr=0.1)
        errors = {}

        def train(ps):
            try:
                ps.register_dense({"w": np.zeros(4, np.float32)})
                for _ in range(30):  # their sum stays finite; w passes float32's range at the 23rd step
                    ps.push_pull({"w": np.full(4, 1.5e38, np.float32)})
            except PSError as e:
                errors[ps.trainer_id] = e

        threads = [threading.Thread(target=train, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)  # well before the 30 s barrier timeout
        assert not any(t.is_alive() for t in threads), "a trainer still waiting: the other's error did not reach it"
        for c in clients:
            c.close()
        assert sorted(errors) == [0, 1], errors
        assert all("the update of block w[0:4] at step 22 from trainers 0, 1's gradient would make it hold NaN or "
                   "Inf" in str(e) for e in errors.values()), [str(e) for e in errors.values()]
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(120)
def test_updates_that_would_make_optimizer_state_non_finite_are_refused(tmp_path):
    """Issue 46, point 4: one finite push of 3e38 makes Adam's v (Adagrad's accumulator) inf, after which the
    parameter never moves again, silently. Such an update is refused naming the parameter, the state and the
    trainer: a table's rows and state are left as they were (the row still trains), a dense block is no longer
    served (as for values); Adagrad's accumulator on the sync path alike."""
    from paddle_cluster.ps.server.resume import load_shard

    env = H.make_env(1, 1, tmp_path)
    big = np.full((1, 4), 3e38, np.float32)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="async", optimizer=OptimizerSpec("adam", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(4, np.float32)})
            ps.register_sparse("emb", 4, vocab_size=100, init_scale=0.1)
            row = ps.pull_sparse("emb", [5]).copy()
            with pytest.raises(NonFinite, match=r"the update of table 'emb' at step 0 from trainer 0's gradient would "
                                                r"make its adam state 'v' hold NaN or Inf"):
                ps.push_sparse("emb", [5], big)
                ps.push({"w": np.zeros(4, np.float32)})  # ends the step
                ps.wait()
            np.testing.assert_array_equal(ps.pull_sparse("emb", [5]), row)
            ps.push_sparse("emb", [5], np.ones((1, 4), np.float32))
            ps.push({"w": np.zeros(4, np.float32)})
            ps.wait()
            # Adam's first step moves each element by lr: the state was left finite (v at inf would move it by 0).
            np.testing.assert_allclose(ps.pull_sparse("emb", [5]), row - 0.1, rtol=1e-5)
            ps.save_checkpoint()
            root = os.path.join(str(tmp_path), "checkpoints")
            assert load_shard(os.path.join(root, os.listdir(root)[0]), 0, 1).tables  # finite, so it loads
            with pytest.raises(NonFinite, match=r"the update of block w\[0:4\] at step 2 from trainer 0's gradient "
                                                r"would make its adam state 'v' hold NaN or Inf"):
                ps.push({"w": big[0]})
                ps.wait()
            with pytest.raises(PSError, match=r"block w\[0:4\] .*adam state 'v'"):
                ps.pull()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]

        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("adagrad", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_sparse("emb", 4, vocab_size=100, init_scale=0.1)
            ps.pull_sparse("emb", [5])
            with pytest.raises(NonFinite, match=r"table 'emb' at step 0 from trainer 0's gradient would make its "
                                                r"adagrad state 'm' hold NaN or Inf"):
                ps.push_sparse("emb", [5], big)  # the accumulator: g * g = 9e76, the row would not move
                ps.push()
                ps.wait()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(90)
def test_connection_stalled_mid_frame_or_idle_is_closed_after_a_bound_with_one_log_line(tmp_path):
    env = H.make_env(1, 1, tmp_path, barrier_timeout=1.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        host, port = env.pservers[0].host, env.dense_ports(0)[0]
        stalled = socket.create_connection((host, port), timeout=10)
        idle = socket.create_connection((host, port), timeout=10)
        try:
            for s in (stalled, idle):
                A.client_handshake(s, env.key_of(0), env.job_id, 0, 0, True)
            # Half a frame header, then nothing.
            stalled.sendall(P.pack_header(P.Op.DECLARE, P.DTYPE_JSON, length=1000)[:20])
            for s in (stalled, idle):
                s.settimeout(10)  # a deadline well past the bounds (stall: 2 x BARRIER_TIMEOUT; idle: 3 x)
            assert stalled.recv(1) == b""  # closed by the pserver, with the log lines below saying which bound
            said = b""
            while chunk := idle.recv(1 << 16):  # the idle one is told why (an ERROR frame), then closed
                said += chunk
            assert P.unpack_header(said[:P.HEADER_SIZE]).op == P.Op.ERROR, said
        finally:
            stalled.close()
            idle.close()
        log = pr.log(server)
        assert log.count("stalled for 2 s in the middle of a frame") == 1, log
        assert log.count("nothing from this trainer on any connection for") == 1, log
        # A live trainer keeps its connections through the same bound.
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(4, np.float32)})
            for _ in range(8):
                ps.push_pull({"w": np.ones(4, np.float32)})
                time.sleep(0.5)
            np.testing.assert_array_equal(ps.pull()["w"], -8.0)
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(60)
def test_a_frame_trickled_byte_by_byte_is_closed_at_the_stall_bound_whatever_its_pace(tmp_path):
    """A valid STATUS (56 bytes with its tag) sent one byte every 0.5 s: each byte well inside a 2 s per-recv
    timeout, the whole frame would take 28 s. The frame has one clock: it is closed after ~2 s, never
    answered; a frame that arrives at speed on the same kind of connection is served."""
    env = H.make_env(1, 1, tmp_path, barrier_timeout=1.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        s = socket.create_connection((env.pservers[0].host, env.dense_ports(0)[0]), timeout=10)
        try:
            keys = A.client_handshake(s, env.key_of(0), env.job_id, 0, 0, True)
            header = P.pack_header(P.Op.STATUS)
            frame = header + keys.send.start(0, header).tag()
            assert len(frame) == 56
            sent, closed = 0, False
            s.settimeout(0.5)
            for byte in frame:
                try:
                    s.sendall(bytes([byte]))
                    sent += 1
                    if s.recv(1) == b"":  # closed by the pserver (it never answers: the frame is not whole)
                        closed = True
                        break
                except socket.timeout:
                    continue
                except OSError:
                    closed = True
                    break
        finally:
            s.close()
        assert closed and sent < len(frame), (closed, sent)  # before the frame's 28 s: its one clock, not a byte's
        log = pr.log(server)
        assert "stalled for 2 s in the middle of a frame (it did not arrive whole within 2 x BARRIER_TIMEOUT, " \
               "whatever its pace)" in log, log
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=1.0), env=trainer_env(env, 0))
        try:
            assert ps.status()[0]["pserver_id"] == 0
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret,why", [
    ("a" * 32, "is too easy to guess (about 11 bits, made of a repeated piece"),
    ("19701971197219731974197519761977", "is too easy to guess (about 25 bits, made of a sequence of numbers"),
    ("1q2w3e4r5t6y7u8i9o0p1q2w3e4r5t6y7u8i", "is not a generated secret: it has characters other than hex digits"),
    ("correcthorsebatterystaplecorrecthorse", "is not a generated secret")])
def test_low_entropy_secret_is_refused_where_a_process_starts(tmp_path, secret, why):
    env = dataclasses.replace(H.make_env(1, 1, tmp_path), secret=secret)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, wait=False)
        assert H.wait_all(pr, [server], 20) == [2]
        log = pr.log(server)
        assert f"PADDLE_JOB_SECRET {why}" in log and "paddle-cluster secret" in log and "token_hex(32)" in log, log
        assert secret not in log
        tr_env = H.proc_env(env, TRAINER, 0)
        tr_env.pop("PADDLE_TRAINER_KEY", None)
        tr_env["PADDLE_JOB_SECRET"] = secret
        trainer = pr.start([sys.executable, "-c", "from paddle_cluster.ps import connect; connect()"], tr_env, "t")
        assert H.wait_all(pr, [trainer], 20) == [1]
        assert why in pr.log(trainer), pr.log(trainer)
    with pytest.raises(ContractError, match=re.escape(why)):
        PServer(env, 0)


@pytest.mark.parametrize("secret,why", [
    # Issue 46, point 8: the pattern families that passed the estimate, and what refuses each now.
    ("1q2w3e4r5t6y7u8i9o0p1q2w3e4r5t6y7u8i", "other than hex digits"),  # a keyboard walk
    ("a1b2c3d4e5f6g7h8i9j0a1b2c3d4e5f6", "other than hex digits"),
    ("a1b2c3d4e5f6a7b8c9d0a1b2c3d4e5f6", "made of two runs interleaved, a repeated piece"),  # the same in hex
    ("19701971197219731974197519761977", "made of a sequence of numbers"),
    ("correcthorsebatterystaplecorrecthorse", "other than hex digits"),
    ("thequickbrownfoxjumpsoverthelazydog", "other than hex digits"),  # a pangram
    ("deadbeefdeadbeefcafebabecafebabe1234", "made of a common word, a repeated piece"),
    ("0123456789abcdef0123456789abcdef01", "made of a keyboard or alphabet run, a repeated piece"),
    ("password1password2password3password4", "other than hex digits"),
    ("s3cret" * 8, "other than hex digits")])
def test_weak_secret_families_are_refused(secret, why):
    from paddle_cluster.contract import check_secret
    with pytest.raises(ContractError, match=re.escape(why)):
        check_secret(secret)


def test_paddle_cluster_secret_prints_a_secret_every_process_accepts():
    from click.testing import CliRunner

    from paddle_cluster.cli import main
    from paddle_cluster.contract import check_secret
    outs = [CliRunner().invoke(main, ["secret"]) for _ in range(3)]
    assert all(r.exit_code == 0 for r in outs), [r.output for r in outs]
    made = [r.output.strip() for r in outs]
    assert len(set(made)) == 3 and all(len(m) == 64 and int(m, 16) >= 0 for m in made), made
    for m in made:
        check_secret(m)


def test_generated_secrets_pass():
    import secrets

    from paddle_cluster.contract import check_secret
    for _ in range(2000):
        check_secret(secrets.token_hex(32), "PADDLE_JOB_SECRET")
        check_secret(secrets.token_hex(16), "PADDLE_JOB_SECRET")  # the in-process local mode's


FLOOD_PY = """
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1))
ps.register_sparse("emb", 8, vocab_size=1000, init_scale=0.1)
ids = [1, 2, 3] if ps.trainer_id == 0 else [7, 5000]  # trainer 1's vocabulary is not the job's
ps.pull_sparse("emb", ids)
ps.push_sparse("emb", ids, np.zeros((len(ids), 8), np.float32))
ps.push()
ps.pull_sparse("emb", ids)
ps.close()
"""


@pytest.mark.timeout(180)
def test_an_id_outside_the_vocabulary_fails_the_job_fast_naming_table_id_and_limit(tmp_path):
    """Through the launcher (localhost, default budgets): the trainer raises the pserver's LimitExceeded, the
    launcher stops the job well before any barrier timeout and shows the message."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(FLOOD_PY)
    conf = local_conf(tmp_path, PSERVERS_PER_NODE=1, TRAINERS_PER_NODE=2, BARRIER_TIMEOUT=120.0)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "oob", timeout=60)  # fail-fast: not 120 s
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert re.search(r"LimitExceeded: pserver 0: table 'emb': trainer 1 sent id 5000, outside the table's id "
                     r"space \[0, 1000\) \(vocab_size=1000", out), out[-3000:]
    assert "trainer.1" in out


# -- config files ----------------------------------------------------------------------------------------------


def _check(conf, user=None):
    """``paddle-cluster --conf CONF check`` (as ``user``)."""
    pre = None
    if user is not None:
        pw = pwd.getpwnam(user)

        def pre():
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
    env = checkout_env(HOME=str(conf.parent))  # this checkout's paddle_cluster, whatever is installed
    env.pop("PADDLE_CLUSTER_CONF", None)
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "check"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=str(conf.parent), preexec_fn=pre,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(120)
def test_config_file_others_can_write_is_refused_like_openssh(tmp_path):
    """conf.py is executed: one group/other-writable or owned by another user (root excepted) is refused with
    the fix, before it runs; the tests' own files (default umask 022, 0644) pass."""
    conf = local_conf(tmp_path)
    assert stat_mode(conf) == 0o644
    ok = _check(conf)
    assert ok.returncode == 0, ok.stderr
    ran = tmp_path / "ran"
    conf.write_text(conf.read_text() + f"open({str(ran)!r}, 'w').close()\n")
    for mode, who in ((0o666, "group and others"), (0o620, "its group")):
        os.chmod(conf, mode)
        res = _check(conf)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"is writable by {who} (mode {mode:04o})" in res.stderr and f"chmod go-w {conf}" in res.stderr
        assert not ran.exists(), "the refused conf.py was executed"
    os.chmod(conf, 0o644)
    os.chown(conf, pwd.getpwnam("nobody").pw_uid, -1)
    res = _check(conf)
    assert res.returncode == 2 and "is owned by nobody, not by root who runs the launcher" in res.stderr, res.stderr
    assert not ran.exists()
    yaml_conf = tmp_path / "cluster.yaml"
    yaml_conf.write_text("HOSTS: [localhost]\n")
    os.chmod(yaml_conf, 0o664)
    res = _check(yaml_conf)
    assert res.returncode == 2 and f"chmod go-w {yaml_conf}" in res.stderr, res.stderr


@pytest.mark.timeout(60)
def test_root_owned_config_is_accepted_for_another_user(tmp_path):
    """Root excepted: a root-owned, 0644 conf.py is read by an unprivileged user (nobody; a forked child with its
    effective ids, as the venv is not nobody's to run). The parent reads it first, so every module reading it
    needs (some imported only when first asked) is loaded: the child, nobody, may not read root's interpreter
    (pyenv under a 0700 /root), and what it reads must not depend on which tests ran before."""
    from paddle_cluster.launch.config import load_config

    shared = Path(tempfile.mkdtemp(prefix="bounds-conf-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        conf = shared / "cluster.yaml"
        conf.write_text("HOSTS: [localhost]\n")
        os.chmod(conf, 0o644)
        assert load_config(str(conf), environ={}).hosts[0].host == "localhost"
        pw = pwd.getpwnam("nobody")
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setegid(pw.pw_gid)
                os.seteuid(pw.pw_uid)
                code = 0 if load_config(str(conf), environ={}).hosts[0].host == "localhost" else 3
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def stat_mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)
