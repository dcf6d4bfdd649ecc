"""``PSClient.push_pull`` over real TCP with real pserver processes: replies larger than the socket buffers
read while the gradients are still being sent, 2-trainer sync and async results equal to push-then-pull's,
and a pserver error or death in the middle of the exchange raised, never waited on forever."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import rt_helpers as H
from helpers import wait_for
from rt_helpers import trainer_env

from paddle_cluster.ps import BarrierTimeout, ConnectionLost, OptimizerSpec, connect
from paddle_cluster.ps.channel import INLINE_REPLY_BYTES, exchange, expect_ok
from paddle_cluster.ps.errors import ProtocolError
from paddle_cluster.ps.wire import protocol as P
from paddle_cluster.ps.wire.stream import SEGMENT

BIG = 40 << 20  # per block: more than a pserver's send buffer and a trainer's receive buffer hold together


def _buffers_max() -> int:
    """What the kernel may buffer of one reply: the pserver's send buffer plus the trainer's receive buffer."""
    def most(name: str) -> int:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    return most("tcp_wmem") + most("tcp_rmem")


@pytest.mark.timeout(120)
def test_blocks_larger_than_socket_buffers_flow_both_ways(tmp_path):
    assert BIG > _buffers_max() and BIG > INLINE_REPLY_BYTES
    env = H.make_env(1, 1, tmp_path, ports_num=1, sparse_ports=0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0),
                     max_block_bytes=BIG)
        try:
            n = BIG // 4
            ps.register_dense({"a": np.zeros(n, np.float32), "b": np.zeros(n, np.float32)})
            assert len({(b.pserver, b.conn) for bl in ps._dense.blocks.values() for b in bl}) == 1  # one channel
            g = {"a": np.ones(n, np.float32), "b": np.full(n, 2.0, np.float32)}
            for step in range(1, 3):
                out = ps.push_pull(g)
                assert ps.step == step
                assert np.all(out["a"] == -0.5 * step) and np.all(out["b"] == -1.0 * step)
            assert [s["blocks"]["0"]["step"] for s in ps.status()] == [2]
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 15) == [0]


@pytest.mark.timeout(120)
def test_two_trainers_sync_push_pull_equals_push_then_pull(tmp_path):
    runs = {}
    for pushpull in ("0", "1"):
        env = H.make_env(2, 2, tmp_path / pushpull, ports_num=2, sparse_ports=1)
        os.makedirs(tmp_path / pushpull)
        runs[pushpull] = [np.load(o) for o in H.run_job(env, tmp_path / pushpull, "dense", steps=6, lr=0.5,
                                                         pushpull=pushpull)]
    ref = H.reference_dense(6, 2, 0.5)
    for old, new in zip(runs["0"], runs["1"]):
        for k in ("w", "b", "losses", "step"):
            np.testing.assert_array_equal(new[k], old[k])  # bit for bit
        np.testing.assert_allclose(new["w"], ref["w"], atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_two_trainers_async_push_pull_with_large_blocks(tmp_path):
    env = H.make_env(2, 2, tmp_path, ports_num=1, sparse_ports=0)
    n, steps = 3 << 20, 4  # two 12 MB parameters in 6 MB blocks: 2 blocks per pserver, on one channel each
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        clients = [connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, i),
                           max_block_bytes=6 << 20) for i in range(2)]
        seen = {}

        def train(c) -> None:
            c.register_dense({"w0": np.zeros(n, np.float32), "w1": np.zeros(n, np.float32)})
            ones = {"w0": np.ones(n, np.float32), "w1": np.ones(n, np.float32)}
            seen[c.trainer_id] = []
            for s in range(1, steps + 1):
                out = c.push_pull(ones)
                # its own pushes are in what it pulls, the other trainer's in part
                seen[c.trainer_id].append(all(float(v.max()) <= -0.5 * s and float(v.min()) >= -0.5 * (s + steps)
                                              for v in out.values()))

        try:
            threads = [threading.Thread(target=train, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert seen == {0: [True] * steps, 1: [True] * steps}, seen
            final = clients[0].pull()
            for k in ("w0", "w1"):  # every gradient of both trainers applied exactly once
                assert np.all(final[k] == np.float32(-0.5 * steps * 2)), (k, final[k].min(), final[k].max())
        finally:
            for c in clients:
                c.close()
        assert H.wait_all(pr, servers, 15) == [0, 0]


@contextlib.contextmanager
def _stuck_exchange(tmp_path, barrier_timeout: float, n: int, ports_num: int = 2, names: str = "ab"):
    """Trainer 0 in a push_pull of one parameter of ``n`` floats per letter of ``names`` over ``ports_num``
    connections that waits for trainer 1 (connected, never pushing): yields (server, clients, the thread, what
    it raised). However the test or this set-up ends, the clients are closed and the pserver stopped."""
    env = H.make_env(1, 2, tmp_path, ports_num=ports_num, sparse_ports=0, barrier_timeout=barrier_timeout)
    with H.procs(str(tmp_path)) as pr:
        server = pr.pserver(env, 0)
        opt = OptimizerSpec("sgd", lr=0.5)
        clients = []
        try:
            for i in range(2):
                clients.append(connect(mode="sync", optimizer=opt, env=trainer_env(env, i), max_block_bytes=8 << 20))
            for c in clients:
                c.register_dense({k: np.zeros(n, np.float32) for k in names})
            raised = []

            def step() -> None:
                try:
                    clients[0].push_pull({k: np.ones(n, np.float32) for k in names})
                except BaseException as e:  # noqa: B036 - the test asserts on it
                    raised.append(e)

            t = threading.Thread(target=step, daemon=True)
            t.start()
            wait_for(lambda: clients[0].step == 1, 10, "push_pull to start")
            yield server, clients, t, raised
        finally:
            for c in clients:
                with contextlib.suppress(Exception):  # a client of a killed pserver: the pserver goes regardless
                    c.close()


@pytest.mark.timeout(60)
def test_push_pull_raises_barrier_timeout_naming_the_missing_trainer(tmp_path):
    n = 64 << 10  # 256 KB each: trainer 0's gradients are all taken in, its pulls wait
    with _stuck_exchange(tmp_path, barrier_timeout=2.0, n=n) as (server, clients, t, raised):
        t.join(30)
        assert not t.is_alive(), "push_pull still waiting after the barrier timeout"
        assert len(raised) == 1 and isinstance(raised[0], BarrierTimeout), raised
        assert raised[0].missing_trainers == [1] and "waiting for trainer 1" in str(raised[0])
        # the connections stay usable: trainer 1 catches up and the step completes for both
        out = clients[1].push_pull({"a": np.ones(n, np.float32), "b": np.ones(n, np.float32)})
        assert np.all(out["a"] == np.float32(-0.5))
        assert np.all(clients[0].pull()["b"] == np.float32(-0.5))


@pytest.mark.timeout(60)
def test_barrier_timeout_with_several_blocks_per_connection_is_said_once_not_per_block(tmp_path):
    """PADDLE_PORTS_NUM=1 and 8 blocks, more than the pserver's pool lets trainer 0 run ahead by: the blocks
    behind the first one on the connection fail at once for the trainer already waited for, so trainer 0
    hears within about one barrier timeout (not 8), and trainer 1, coming late, is still connected and hears
    a barrier timeout too (the pushes it would have summed with were refused), never a broken pipe."""
    n, names = 64 << 10, "abcdefgh"
    with _stuck_exchange(tmp_path, barrier_timeout=2.0, n=n, ports_num=1, names=names) as (
            server, clients, t, raised):
        t.join(5.0)  # a deadline between 1 barrier timeout and the 8 it took when each block waited its own
        assert not t.is_alive(), "push_pull still waiting: each block on the connection waits a barrier timeout"
        assert len(raised) == 1 and isinstance(raised[0], BarrierTimeout), raised
        e = raised[0]
        assert e.missing_trainers == [1] and e.step == 1, e
        assert str(e).startswith("barrier timeout at step 1 on pserver 0 (pull block a[0:65536] segment 0): "
                                 "waiting for trainer 1 (last seen"), e
        with pytest.raises(BarrierTimeout) as late:
            clients[1].push_pull({k: np.ones(n, np.float32) for k in names})
        assert late.value.missing_trainers == [0] and "\n" not in str(late.value), late.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status,length,says", [
    (P.EMPTY_FLAG, 0, "EMPTY_FLAG goes with NOGRAD_FLAG only"),  # an empty push is no gradient
    (P.EMPTY_FLAG | P.NOGRAD_FLAG | P.REDUCE_FLAG, 0, "EMPTY_FLAG goes with NOGRAD_FLAG only"),
    (P.EMPTY_FLAG | P.NOGRAD_FLAG, 4 << 10, "EMPTY_FLAG with a payload of 4096 bytes"),
])
def test_a_misflagged_empty_push_is_refused_naming_it_while_the_next_block_is_sent(tmp_path, status, length, says):
    """A push flagged as carrying no payload (``EMPTY_FLAG``) where that is not allowed, followed on the same
    connection by another block's 40 MB push: the trainer gets the pserver's one-line refusal naming the flag
    or the length (the pserver drops the connection after saying it), not the broken pipe its send meets."""
    env = H.make_env(1, 1, tmp_path, ports_num=1, sparse_ports=0)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0), max_block_bytes=BIG)
        try:
            n = BIG // 4
            ps.register_dense({"a": np.zeros(1024, np.float32), "b": np.zeros(n, np.float32)})
            (a,), (b,) = ps._dense.blocks["a"], ps._dense.blocks["b"]
            ch = ps._dense_ch[0][0]
            frames = [(P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), status, key=a.key, step=0,
                                     length=length), (np.zeros(length, np.uint8),) if length else ()),
                      (P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=b.key, step=0, length=4 * n),
                       (np.ones(n, np.float32),))]
            with pytest.raises(ProtocolError) as e:
                ch._guard(exchange, frames, [expect_ok, expect_ok], 0)
            assert says in str(e.value) and "block a[0:1024]" in str(e.value) and "\n" not in str(e.value), e.value
        finally:
            with contextlib.suppress(Exception):  # the connection was dropped: close says so in a warning
                ps.close()


@pytest.mark.timeout(60)
def test_a_trainer_dropped_as_idle_hears_why_at_its_next_push(tmp_path):
    """A trainer silent on every connection for 3 x BARRIER_TIMEOUT (hung, its peers' barriers long failed) is
    dropped; its next push_pull raises the pserver's one line saying so, not the broken pipe its send meets."""
    env = H.make_env(1, 1, tmp_path, ports_num=1, sparse_ports=0, barrier_timeout=1.0)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.zeros(1 << 18, np.float32)})
            wait_for(lambda: "nothing from this trainer on any connection" in pr.log(server), 15, "the idle drop")
            with pytest.raises(ConnectionLost) as e:
                ps.push_pull({"w": np.ones(1 << 18, np.float32)})
            assert str(e.value).startswith("pserver 0 closed trainer 0's connection: nothing from this trainer on "
                                           "any connection for 3 s (3 x BARRIER_TIMEOUT)"), e.value
        finally:
            with contextlib.suppress(Exception):  # dropped: close warns that the pserver did not answer
                ps.close()


@pytest.mark.timeout(60)
def test_pserver_killed_mid_push_pull_raises_connection_lost(tmp_path):
    # 16 MB each in 8 MB blocks over both channels: killed while gradients and pulls are in flight
    with _stuck_exchange(tmp_path, barrier_timeout=60.0, n=4 << 20) as (server, clients, t, raised):
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        t.join(20)  # far below the barrier and reply timeouts: the lost connection ends the exchange
        assert not t.is_alive(), "push_pull still waiting after its pserver was killed"
        assert len(raised) == 1 and isinstance(raised[0], ConnectionLost), raised
        assert "pserver 0 at 127.0.0.1:" in str(raised[0]), raised[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("integrity", [True, False])
def test_a_pull_streams_each_segment_once_every_trainer_sent_it(tmp_path, integrity):
    """One 2-segment block, 2 sync trainers: trainer 1 holds back the second segment of its push, and
    trainer 0 already receives (and verifies) the first segment of its pull reply, with the step's value;
    the rest follows once trainer 1 sends the rest, the whole frame bit-identical to push then pull."""
    env = dataclasses.replace(H.make_env(1, 2, tmp_path, ports_num=1, sparse_ports=0), integrity=integrity)
    n = SEGMENT // 2  # float32: 2 segments (a pserver lets one trainer run 2 segments ahead of another)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        clients = [connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, i))
                   for i in range(2)]
        try:
            for c in clients:
                c.register_dense({"w": np.zeros(n, np.float32)})
            (block,) = clients[0]._dense.blocks["w"]
            ch0, ch1 = (c._dense_ch[0][0] for c in clients)
            g = {0: np.ones(n, np.float32), 1: np.full(n, 3.0, np.float32)}
            hold = threading.Event()
            gated = []

            def gate(end: int) -> None:
                if end > SEGMENT:
                    gated.append(end)
                    assert hold.wait(60)

            push = {t: P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=block.key, step=0,
                                     length=4 * n) for t in (0, 1)}
            with ThreadPoolExecutor(2) as pool:
                held = pool.submit(ch1.stream.send, push[1], g[1], ready=gate)
                ch0.send(push[0], g[0])
                ch0.send(P.pack_header(P.Op.PULL_DENSE, P.dtype_code(np.float32), key=block.key, step=1))
                assert ch0.reply().op == P.Op.OK  # the push taken in
                h = ch0.reply()
                assert (h.op, h.key, h.step, h.length) == (P.Op.DATA, block.key, 1, 4 * n)
                pieces = ch0.stream.chunks()
                off, first = pool.submit(next, pieces).result(30)
                assert off == 0 and len(first) == SEGMENT and not hold.is_set() and gated == [2 * SEGMENT]
                assert np.all(np.frombuffer(first, np.float32) == np.float32(-0.5 * 2.0))  # mean 2, lr 0.5
                hold.set()
                held.result(30)
                rest = [np.frombuffer(v, np.float32).copy() for _, v in pieces]
                assert sum(len(r) for r in rest) == n - SEGMENT // 4
                assert all(np.all(r == np.float32(-1.0)) for r in rest)
                assert ch1.reply().op == P.Op.OK
            clients[1].step = clients[0].step = 1
            # both trainers' next step goes through the client as usual: the streams are still in step
            outs = list(ThreadPoolExecutor(2).map(lambda c: c.push_pull({"w": g[c.trainer_id]}), clients))
            for out in outs:
                np.testing.assert_array_equal(out["w"], np.full(n, -2.0, np.float32))
        finally:
            for c in clients:
                c.close()
        assert H.wait_all(pr, [server], 15) == [0]


@pytest.mark.timeout(90)
def test_a_barrier_timeout_in_the_middle_of_a_streamed_reply_ends_that_connection_only(tmp_path):
    """Trainer 1 stops after the first segment of its push: trainer 0 gets that segment of its pull reply,
    then, at the barrier timeout, its connection breaks (the reply's header is out: an error frame now would
    be read as payload). The pserver serves on: trainer 1's push completes the step."""
    env = H.make_env(1, 2, tmp_path, ports_num=1, sparse_ports=0, barrier_timeout=2.0)
    n = SEGMENT // 2
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        clients = [connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, i))
                   for i in range(2)]
        hold = threading.Event()
        try:
            for c in clients:
                c.register_dense({"w": np.zeros(n, np.float32)})
            (block,) = clients[0]._dense.blocks["w"]
            ch0, ch1 = (c._dense_ch[0][0] for c in clients)
            push = P.pack_header(P.Op.PUSH_DENSE, P.dtype_code(np.float32), key=block.key, step=0, length=4 * n)
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(ch1.stream.send, push, np.ones(n, np.float32),
                                   ready=lambda end: end <= SEGMENT or hold.wait(60))
                ch0.send(push, np.ones(n, np.float32))
                ch0.send(P.pack_header(P.Op.PULL_DENSE, P.dtype_code(np.float32), key=block.key, step=1))
                assert ch0.reply().op == P.Op.OK
                assert ch0.reply().op == P.Op.DATA
                pieces = ch0.stream.chunks()
                assert next(pieces)[0] == 0
                with pytest.raises(ConnectionLost, match="middle of a frame"):
                    next(pieces)
                assert server.poll() is None
                hold.set()
                held.result(30)
                assert ch1.reply().op == P.Op.OK
            assert clients[1].status()[0]["blocks"][str(block.key)]["step"] == 1
        finally:
            hold.set()
            for c in clients:
                c.close()


@pytest.mark.timeout(60)
def test_read_sparse_returns_every_existing_row_page_by_page(tmp_path):
    """A table of 50 million declared rows on 2 pservers holds only the rows touched; ``read_sparse`` returns
    exactly those (ids sorted, values as a pull sees them), whatever the page size."""
    env = H.make_env(2, 1, tmp_path, ports_num=1, sparse_ports=1)
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        ps = connect(mode="sync", optimizer=OptimizerSpec("adagrad", lr=0.1), env=trainer_env(env, 0))
        try:
            ps.register_sparse("emb", 4, vocab_size=50_000_000, init_scale=0.1)
            ids = np.array([49_999_999, 7, 3, 10, 7, 0])
            ps.pull_sparse("emb", ids)
            ps.push_sparse("emb", [3, 10], np.ones((2, 4), np.float32))
            ps.push({})
            want = np.unique(ids)
            rows = ps.pull_sparse("emb", want)
            assert sum(s["tables"]["0"]["rows"] for s in ps.status()) == len(want)
            got_ids, got_rows = ps.read_sparse("emb")
            np.testing.assert_array_equal(got_ids, want)
            np.testing.assert_array_equal(got_rows, rows)
            paged = ps._sparse.rows("emb", ps.step, page_rows=1)
            np.testing.assert_array_equal(paged[0], want)
            np.testing.assert_array_equal(paged[1], rows)
        finally:
            ps.close()
        assert H.wait_all(pr, servers, 15) == [0, 0]
