"""The same-host lane (docs/architecture.md, "The same-host lane"), on real pserver processes.

A trainer on the pserver's node trains through lanes, one memfd per registration and connection, mapped by it
and that connection's pserver (a connection holds one per registration, up to ``MAX_LANES``, then TCP), with
results bit for bit those of TCP (sync SGD folded by segment, sync Adam summed whole, async; 2 pservers x 2
dense ports; two registrations); a two-group torch ``DistributedOptimizer`` has every block in a lane; the
arrays pull returns are the lane's value area and change only with a pull; each lane is charged whole and its
budget goes back when its connection ends; a LANE for a block already in one is a protocol error; a trainer
killed with -9 leaves no mapping in the pserver; a pserver killed with -9 in a supervised job comes back with
new lanes and exact results; silent peers at the desk hold no offer up. Refused, with the reason, and the
connection left on TCP: an offer under another key (the trainer holding it takes the desk for an impostor and
hands nothing over; the desk refuses its MAC), an offer claimed after its time, another user at either end, a
squatter of this user without the secret (it cannot know the name, and gets nothing where it holds one), a
pserver with no lane socket on this node (another host or network namespace), a lane past the pserver's budget.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest
import rt_helpers as H
from helpers import wait_for
from rt_helpers import trainer_env

from paddle_cluster.contract import PSERVER, derive_trainer_key
from paddle_cluster.ps import OptimizerSpec, connect
from paddle_cluster.ps.channel import Channel
from paddle_cluster.ps.errors import PSError
from paddle_cluster.ps.server.pserver import PServer
from paddle_cluster.ps.wire import lane as L

NOBODY = 65534
W = np.ones(1000, np.float32)


def _serve(tmp_path, lane: bool, first=None):
    """One pserver process and trainer 0 of a 1-trainer job, on this node (``lane``: the trainer's PADDLE_LANE),
    its first registration ``first`` (``{"w": W}``)."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5),
                     env=dataclasses.replace(trainer_env(env, 0), lane=lane))
        ps.register_dense({"w": W} if first is None else first)
        try:
            yield env, pr, server, ps
        finally:
            ps.close()


@pytest.fixture
def served(tmp_path):
    """Lanes off in the trainer: the tests set one up by hand."""
    yield from _serve(tmp_path, False)


@pytest.fixture
def laned(tmp_path):
    yield from _serve(tmp_path, True)


def _maps_lane(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "memfd:paddle-cluster-lane" in f.read()


def _made() -> contextlib.closing:
    """A trainer's lane of 64 KiB, closed (descriptor and mapping) when the block ends."""
    return contextlib.closing(L.create(1 << 16))


def _still_trains(ps) -> None:
    """The connection still serves dense traffic, with the values SGD makes."""
    step = ps.step
    out = ps.push_pull({"w": np.ones_like(W)})
    assert np.array_equal(out["w"], np.full_like(W, 1 - 0.5 * (step + 1)))


def test_same_host_trainer_trains_through_a_lane_both_processes_map(laned):
    env, pr, server, ps = laned
    assert _maps_lane(os.getpid()) and _maps_lane(server.pid)
    assert ps._dense.lane_at  # every block of the channel is in it
    _still_trains(ps)
    _still_trains(ps)
    ps.close()
    assert not _maps_lane(os.getpid())


def test_lane_set_up_by_hand_binds_to_its_connection(served):
    env, pr, server, ps = served
    ch = ps._ctl(0)
    assert not _maps_lane(server.pid)
    lane = L.create(2 * L.aligned(W.nbytes))  # exactly what the layout needs: w's block at 0
    assert ch.submit(Channel.open_lane, lane, [(ps._dense.blocks["w"][0].key, 0)]).result(timeout=10) is None
    lane.close()
    assert not _maps_lane(os.getpid()) and _maps_lane(server.pid)  # the pserver's mapping: its connection's
    _still_trains(ps)  # the trainer does not know its block is in this lane: over TCP
    ps.close()
    wait_for(lambda: not _maps_lane(server.pid), 10, "the pserver unmaps the lane with the connection")


def _raw_offer(env, token: str, trainer: int, key_hex: str, fd: int, size: int) -> str:
    """One exchange at pserver 0's desk (its ``token``) as a trainer would make it, but with the offer's MAC under
    ``key_hex`` whatever the desk proved: the desk's answer ("" for kept)."""
    import socket

    port = env.all_ports(0)[0]
    mine = os.urandom(L.NONCE_SIZE)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(L.socket_name(env.job_id, 0, port, token))
        s.send(L._HELLO.pack(trainer, mine))
        _, desk, _proof = L._PROOF.unpack(s.recv(512))
        mac = L._mac(bytes.fromhex(key_hex), b"lane", env.job_id, 0, trainer, port, mine, desk, size)
        socket.send_fds(s, [L._OFFER.pack(size, mac)], [fd])
        return s.recv(512).decode().strip("\0")


def test_offer_under_another_key_is_refused_and_tcp_stays(served):
    env, pr, server, ps = served
    port, token = env.all_ports(0)[0], ps._ctl(0).lane_token
    wrong = derive_trainer_key("another job secret of enough length, 32+", env.job_id, 0)
    # A trainer holding another key takes the desk's proof for an impostor's: it hands nothing over.
    with pytest.raises(L.LaneRefused, match="did not prove it knows this trainer's key"), _made() as lane:
        L.offer(lane, env.job_id, wrong, 0, 0, port, token)
    # The desk refuses an offer whose MAC is not under the trainer's key.
    with _made() as lane:
        assert "MAC is wrong" in _raw_offer(env, token, 0, wrong, lane.fd, lane.size)
    assert "refused a lane: trainer 0: the offer's MAC is wrong" in pr.log(server)
    # A LANE frame with a nonce nobody offered binds nothing.
    ch = ps._ctl(0)
    ch._lane_of = (env.job_id, wrong, 0, 0, port)
    with _made() as lane:
        assert "did not prove" in ch.submit(Channel.open_lane, lane, []).result(timeout=10)
    assert not _maps_lane(server.pid)
    _still_trains(ps)


def test_no_lane_socket_on_this_node_means_tcp(served):
    env, pr, server, ps = served
    with pytest.raises(L.LaneRefused, match="no lane socket on this node"), _made() as lane:
        L.offer(lane, env.job_id, env.key_of(0), 1, 0, env.all_ports(0)[0], ps._ctl(0).lane_token)  # pserver 1


def _as_nobody_in_child(fn):
    """Fork a child that runs ``fn`` as user nobody: its pid and a file of the line ``fn`` returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, (fn() + "\n").encode())
        except BaseException as e:  # noqa: BLE001 - told to the parent
            os.write(w, f"error {e!r}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="needs root to become another user")
def test_another_user_cannot_offer_a_lane(served):
    env, pr, server, ps = served
    token = ps._ctl(0).lane_token

    def offer() -> str:
        """What ``L.offer`` sends, without its own check of the listener's user (which would stop it first)."""
        import socket

        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(L.socket_name(env.job_id, 0, env.all_ports(0)[0], token))
            try:
                socket.send_fds(s, [bytes(L._OFFER.size)], [fd])
                return s.recv(512).decode() or "closed"
            except ConnectionError:
                return "closed"

    pid, out = _as_nobody_in_child(offer)
    assert out.readline() == "closed\n"
    os.waitpid(pid, 0)
    assert f"refused a lane from uid {NOBODY}" in pr.log(server)
    _still_trains(ps)


@contextlib.contextmanager
def _squatter(env, token: str, user: int = -1):
    """A process without the job's secret (as ``user`` if given, else this one's) listening on pserver 0's lane
    socket name for ``token`` before the pserver does, answering every hello with a made-up proof; yields a
    function saying how many descriptors it was handed so far."""
    import socket

    name = L.socket_name(env.job_id, 0, env.all_ports(0)[0], token)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if user >= 0:
                os.setgid(user)
                os.setuid(user)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(name)
            s.listen(16)
            os.write(w, b"listening\n")
            while True:
                c, _ = s.accept()
                with c:
                    c.settimeout(5)
                    try:
                        c.recv(512)
                        c.send(L._PROOF.pack(b"\1", os.urandom(32), os.urandom(32)))
                        _, fds, _, _ = socket.recv_fds(c, 512, 4)
                        if fds:
                            os.write(w, b"fd\n")
                    except OSError:
                        pass
        finally:
            os._exit(0)
    os.close(w)
    out = os.fdopen(r)
    try:
        assert out.readline() == "listening\n"
        os.set_blocking(r, False)
        got = []
        yield lambda: len(got.__iadd__([line for line in out.readlines() if line == "fd\n"]))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        out.close()


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="needs root to become another user")
def test_trainer_refuses_a_lane_socket_of_another_user(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    with _squatter(env, "leaked", NOBODY) as handed:
        with pytest.raises(L.LaneRefused, match=f"belongs to uid {NOBODY}, not this user"), _made() as lane:
            L.offer(lane, env.job_id, env.key_of(0), 0, 0, env.all_ports(0)[0], "leaked")
        assert handed() == 0


def test_a_squatter_of_this_user_without_the_secret_gets_no_memory_and_the_job_its_lanes(tmp_path, caplog):
    """A process of the trainer's own user, without the job's secret, binds pserver 0's lane socket name
    before the pserver starts: it cannot know the name (its token is drawn when the pserver starts and told on
    the authenticated connection), so the pserver takes its own and the trainer trains through a lane to it;
    had the name leaked, the squatter cannot prove it knows the trainer's key, so it is handed nothing and the
    trainer says so in its log."""
    env = H.make_env(1, 1, tmp_path)
    with _squatter(env, "") as handed, _squatter(env, "0" * 32) as handed_too, H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
        try:
            ps.register_dense({"w": W})
            assert ps._dense._in_lane == {"w"} and _maps_lane(server.pid)
            _still_trains(ps)
        finally:
            ps.close()
        assert handed() == 0 and handed_too() == 0
    with _squatter(env, "leaked") as handed, caplog.at_level(logging.INFO, "paddle_cluster.ps"):
        with pytest.raises(L.LaneRefused, match="did not prove it knows this trainer's key"), _made() as lane:
            L.offer(lane, env.job_id, env.key_of(0), 0, 0, env.all_ports(0)[0], "leaked")
        assert handed() == 0
    said = [r.getMessage() for r in caplog.records if "did not prove it knows this trainer's key" in r.getMessage()]
    assert said and "no memory handed to it" in said[0] and said[0].startswith("trainer 0: the lane socket of "
                                                                                "pserver 0")


def _train(tmp_path, lane: bool, mode: str, opt: str, trainers: int) -> np.ndarray:
    """Trainers (threads, one client each) on two pserver processes of two dense ports each: 2 steps of push_pull,
    one of push then pull, on a 3 MiB parameter (four blocks of 768 KiB, an equal share on each pserver, one on
    each of the four connections: one memfd offered to each) and a small one beside one of them, then a bias
    registered apart with its own rate (two optimizer groups: a second memfd, on a connection that holds one
    already); the final values."""
    env = H.make_env(2, trainers, tmp_path / f"{lane}", ports_num=2)
    big = np.linspace(-1, 1, 3 << 18, dtype=np.float32)
    out = [None] * trainers

    def trainer(i: int) -> None:
        ps = connect(mode=mode, optimizer=OptimizerSpec(opt, lr=0.1), max_block_bytes=1 << 20,
                     env=dataclasses.replace(trainer_env(env, i), lane=lane))
        try:
            vals = ps.register_dense({"big": big, "w": W})
            vals.update(ps.register_dense({"b": np.arange(100, dtype=np.float32)}, OptimizerSpec(opt, lr=0.05)))
            assert len({(b.pserver, b.conn) for b in ps._dense.blocks["big"]}) == 4
            assert len(ps._dense.lane_at) == (sum(len(bl) for bl in ps._dense.blocks.values()) if lane else 0)
            assert sorted(ps._dense._lanes_on.values()) == ([1, 1, 1, 2] if lane else [])
            # Through lanes, the receive buffers of parameters in one lane are its value area: no copy out of it
            # (big's blocks are in four lanes, one per connection: copied out of them).
            assert ps._dense._in_lane == ({"w", "b"} if lane else set())
            for step in range(3):
                rng = np.random.default_rng(100 * i + step)
                grads = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in vals.items()}
                if step < 2:
                    vals = ps.push_pull(grads)
                else:
                    ps.push(grads)
                    vals = ps.pull()
            out[i] = np.concatenate([vals["big"], vals["w"], vals["b"]])
        finally:
            ps.close()

    (tmp_path / f"{lane}").mkdir()
    with H.procs(tmp_path / f"{lane}") as pr:
        pr.pserver(env, 0)
        pr.pserver(env, 1)
        th = [threading.Thread(target=trainer, args=(i,)) for i in range(trainers)]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
    assert all(o is not None for o in out)
    assert all(np.array_equal(o, out[0]) for o in out) or mode == "async"
    return out[0]


@pytest.mark.parametrize("mode, opt, trainers", [("sync", "sgd", 2), ("sync", "adam", 2), ("async", "sgd", 1)])
def test_lane_results_are_bit_identical_to_tcp(tmp_path, mode, opt, trainers):
    assert np.array_equal(_train(tmp_path, True, mode, opt, trainers), _train(tmp_path, False, mode, opt, trainers))


def test_values_in_the_lane_change_only_with_a_pull(laned):
    """The caller's arrays are the lane's value area: a push (the pserver applies it) leaves them as they were;
    the next pull overwrites them, as it does TCP's receive buffers."""
    env, pr, server, ps = laned
    held = ps.push_pull({"w": np.ones_like(W)})["w"]
    assert "w" in ps._dense._in_lane and np.array_equal(held, np.full_like(W, 0.5))
    ps.wait(ps.push({"w": np.ones_like(W)}))
    assert np.array_equal(held, np.full_like(W, 0.5))  # applied on the pserver, not written to the lane
    assert ps.pull()["w"] is held and np.array_equal(held, np.zeros_like(W))
    kept = held.copy()
    ps.close()
    assert np.array_equal(held, kept)  # still readable after close: its mapping goes with the last view


def test_each_registration_gets_a_lane_up_to_the_cap_then_tcp_said_once(laned, caplog):
    """One connection: each registration's blocks in a lane of their own, the pserver mapping each; past
    ``MAX_LANES`` a registration travels over TCP, said once, and trains the same."""
    env, pr, server, ps = laned
    later = [f"u{i}" for i in range(L.MAX_LANES)]
    with caplog.at_level(logging.DEBUG, "paddle_cluster.ps"):
        for i, name in enumerate(later):
            ps.register_dense({name: (i + 2) * W})
    assert ps._dense._in_lane == {"w", *later[:-1]} and len(_lanes_mapped(server.pid)) == L.MAX_LANES
    said = [r.getMessage() for r in caplog.records if "over TCP, not a same-host lane" in r.getMessage()]
    assert len(said) == 1 and f"holds {L.MAX_LANES} lanes already" in said[0], said
    for step in range(2):
        out = ps.push_pull({n: np.ones_like(W) for n in ("w", *later)})
        for i, name in enumerate(["w", *later]):
            assert np.array_equal(out[name], np.full_like(W, i + 1 - 0.5 * (step + 1))), name


def test_a_lane_for_blocks_already_in_one_is_a_protocol_error(laned):
    """A block has one place: a LANE naming a block of the connection's lanes drops the connection, saying why."""
    env, pr, server, ps = laned
    key = ps._dense.blocks["w"][0].key
    with _made() as lane, pytest.raises(PSError, match="names a block twice or one already in a lane"):
        ps._ctl(0).submit(Channel.open_lane, lane, [(key, 0)]).result(timeout=10)
    assert "trainer 0: LANE names a block twice or one already in a lane" in pr.log(server)


def test_a_two_group_torch_model_has_every_block_in_a_lane(tmp_path, monkeypatch):
    """The usual torch pattern, weights with weight decay and biases without: two optimizer groups, two
    registrations, each in its own lane (the pserver maps both), and the steps plain torch takes."""
    torch = pytest.importorskip("torch")
    import paddle_cluster.torch as pct

    env = H.make_env(1, 1, tmp_path)
    for k in [k for k in os.environ if k.startswith("PADDLE_")]:
        monkeypatch.delenv(k)
    for k, v in trainer_env(env, 0).to_environ().items():  # trainer 0's contract, as a launcher sets it
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    plain = copy.deepcopy(net)

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
                {"params": [p for n, p in m.named_parameters() if n.endswith("bias")]}]

    x, y = torch.randn(8, 6), torch.randn(8, 1)
    ref = torch.optim.SGD(groups(plain), lr=0.1)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        opt = pct.DistributedOptimizer(torch.optim.SGD(groups(net), lr=0.1), named_parameters=net.named_parameters())
        try:
            dense = opt.bridge.ps._dense
            assert set(dense.lane_at) == {b.key for bl in dense.blocks.values() for b in bl}
            assert dense._in_lane == set(dense.blocks) and len(_lanes_mapped(server.pid)) == 2
            for _ in range(3):
                for m, o in ((net, opt), (plain, ref)):
                    o.zero_grad()
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    o.step()
            for (n, a), b in zip(net.state_dict().items(), plain.state_dict().values()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        finally:
            pct.shutdown()


def _budget_used(tmp_path, lane: bool) -> tuple:
    """An in-process pserver's budget in use once one trainer registered two groups (each through its own lane,
    or over TCP), and once that trainer's connections ended."""
    env = H.make_env(1, 1, tmp_path / f"{lane}")
    server = PServer(env.for_process(PSERVER, 0, "127.0.0.1"), 0).start()
    try:
        ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5),
                     env=dataclasses.replace(trainer_env(env, 0), lane=lane))
        try:
            ps.register_dense({"w": W})
            ps.register_dense({"b": W[:100]}, OptimizerSpec("sgd", lr=0.1))
            assert len(ps._dense._lanes) == (2 if lane else 0)
            during = server.state.budget.used
        finally:
            ps.close()
        wait_for(lambda: not server.net._conns, 10, "the pserver ends the trainer's connections")
        return during, server.state.budget.used
    finally:
        server.stop()


def test_the_pserver_budget_of_every_lane_is_released_when_the_connection_ends(tmp_path):
    """Each lane is charged whole (its gradient and value areas, exactly its blocks, in pages) and released with
    the connection."""
    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    laned, tcp = _budget_used(tmp_path, True), _budget_used(tmp_path, False)
    lanes = L.mapped_bytes(2 * L.aligned(W.nbytes)) + L.mapped_bytes(2 * L.aligned(W[:100].nbytes))
    assert laned[0] == tcp[0] + lanes and laned[1] == tcp[1]


def test_a_registration_of_empty_parameters_makes_no_lane(tmp_path):
    """Nothing to share: no memfd of 0 bytes; the next registration, with bytes, gets its lane."""
    with contextlib.contextmanager(_serve)(tmp_path, True, {"e": np.zeros((0, 4), np.float32)}) as (*_, ps):
        assert not ps._dense.lane_at
        ps.register_dense({"w": W})
        assert ps._dense._in_lane == {"w"}
        out = ps.push_pull({"e": np.zeros((0, 4), np.float32), "w": np.ones_like(W)})
        assert out["e"].shape == (0, 4) and np.array_equal(out["w"], np.full_like(W, 0.5))
        assert ps.pull(["w", "w"])["w"] is out["w"]  # a name asked twice: its blocks pulled once


def _lane_fds() -> int:
    """How many descriptors of this process are lanes' memfds."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if "memfd:paddle-cluster-lane" in _readlink(f"/proc/self/fd/{fd}"))


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the directory's own descriptor, gone once listed
        return ""


def test_an_offer_claimed_too_late_is_dropped_and_the_trainer_stays_on_tcp(tmp_path, monkeypatch, caplog):
    """An in-process pserver keeps offers 0.3 s; the trainer claims its lane 0.6 s after offering it: the desk
    has dropped the offer and closed its descriptor, the trainer trains over TCP and says why once."""
    monkeypatch.setattr(L, "OFFER_TIMEOUT", 0.3)
    offer = L.offer

    def late(*a, **kw):
        nonce = offer(*a, **kw)
        time.sleep(0.6)
        return nonce

    monkeypatch.setattr(L, "offer", late)
    env = H.make_env(1, 1, tmp_path)
    fds = _lane_fds()
    server = PServer(env.for_process(PSERVER, 0, "127.0.0.1"), 0).start()
    try:
        with caplog.at_level(logging.DEBUG, "paddle_cluster.ps"):
            ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
            try:
                ps.register_dense({"w": W, "v": W})
                assert not ps._dense.lane_at and _lane_fds() == fds and not _maps_lane(os.getpid())
                _still_trains_both(ps)
            finally:
                ps.close()
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records if "over TCP, not a same-host lane" in r.getMessage()]
    assert len(said) == 1 and "no lane offered under that nonce" in said[0], said


def _still_trains_both(ps) -> None:
    out = ps.push_pull({"w": np.ones_like(W), "v": np.ones_like(W)})
    assert np.array_equal(out["w"], np.full_like(W, 0.5)) and np.array_equal(out["v"], np.full_like(W, 0.5))


def _lanes_mapped(pid: int) -> set:
    """The inodes of the lanes process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[4] for line in f if "memfd:paddle-cluster-lane" in line}


def test_kill_9_of_a_trainer_unmaps_its_lane_and_only_its(tmp_path):
    env = H.make_env(1, 2, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        tr = [pr.trainer(env, i, "die_after_step", str(tmp_path / f"t{i}")) for i in range(2)]
        for p in tr:
            assert p.stdout.readline().decode().strip() == "STEP0-DONE", pr.log(p)
        both = _lanes_mapped(server.pid)
        assert len(both) == 2 and _lanes_mapped(tr[0].pid) <= both and _lanes_mapped(tr[1].pid) <= both
        survivor = _lanes_mapped(tr[1].pid)
        tr[0].kill()
        tr[0].wait(10)
        deadline = time.monotonic() + 10
        while _lanes_mapped(server.pid) != survivor and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _lanes_mapped(server.pid) == survivor and server.poll() is None


def test_a_lane_beyond_the_pserver_memory_budget_leaves_tcp(tmp_path, caplog):
    """A lane is the pserver's memory (it maps it and keeps it alive): charged to its budget, refused past it."""
    env = H.make_env(1, 1, tmp_path)
    big = np.ones(1 << 20, np.float32)  # 4 MB, its block charged 8 MiB: fits 11 MiB, its 8 MiB lane too does not
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0, {"PADDLE_PSERVER_MEMORY": str(11 << 20)})
        with caplog.at_level(logging.DEBUG, "paddle_cluster.ps"):
            ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5), env=trainer_env(env, 0))
            try:
                ps.register_dense({"big": big})
                assert not ps._dense.lane_at
                out = ps.push_pull({"big": np.ones_like(big)})
                assert np.array_equal(out["big"], np.full_like(big, 0.5))
            finally:
                ps.close()
    said = [r.getMessage() for r in caplog.records if "over TCP, not a same-host lane" in r.getMessage()]
    assert len(said) == 1 and "trainer 0's same-host lane offered" in said[0], said
    assert "PADDLE_PSERVER_MEMORY" in said[0], said


@pytest.mark.timeout(120)
def test_a_pserver_killed_and_restarted_gets_new_lanes_and_exact_results(cluster, tmp_path):
    """kill -9 of pserver.1 in a supervised job (its node's trainer.1 trains through a lane to it): the job
    restarts from its checkpoint, the new pserver.1 and trainer.1 share a new lane, the final w is exact."""
    from helpers import TOTAL, Launch, assert_nothing_left, conf, final_w, proc_pid, workspace

    job = "lane_kill_ps"
    run = Launch(conf(tmp_path, cluster), "--job_dispatch_package", str(workspace(tmp_path)), "--job_name", job,
                 "--max_restarts", "1", "--", str(TOTAL), "10", "sync")
    run.wait_line(r"checkpoint step=20")
    old = proc_pid(cluster, 1, job, "pserver.1")
    before = _lanes_mapped(old)
    assert before and before <= _lanes_mapped(proc_pid(cluster, 1, job, "trainer.1")), before
    os.kill(old, signal.SIGKILL)
    _, line = run.wait_line(r"restarting the job from", 30)
    step = int(re.search(r"checkpoint step (\d+)", line).group(1))
    run.wait_line(rf"\[trainer\.1@node1\] start step={step} ", 60)
    new = wait_for(lambda: (lambda p: p if p != old else None)(proc_pid(cluster, 1, job, "pserver.1")), 30,
                   "the restarted pserver.1")
    after = wait_for(lambda: _lanes_mapped(new), 30, "a lane in the restarted pserver.1")
    assert not after & before and after <= _lanes_mapped(proc_pid(cluster, 1, job, "trainer.1"))
    assert run.finish(120) == 0, run.text()[-3000:]
    assert final_w(run) == -0.5 * TOTAL
    assert_nothing_left(cluster)


def test_silent_peers_at_the_desk_hold_no_honest_offer_up(laned):
    """100 connections of this user to the desk that say nothing (one says its hello, then nothing): the desk
    answers the trainer's offers as they arrive, so each of its next registrations gets its lane at once; past
    64 talking the oldest silent ones are closed, and the rest within the offer's 5 s."""
    import socket

    env, pr, server, ps = laned
    name = L.socket_name(env.job_id, 0, env.all_ports(0)[0], ps._ctl(0).lane_token)
    silent = []
    for i in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(name)
        if i == 99:
            s.send(L._HELLO.pack(0, os.urandom(L.NONCE_SIZE)))
        silent.append(s)
    try:
        for i in range(3):  # a desk held up by the silent peers would time the offer out: TCP, not the lane
            ps.register_dense({f"u{i}": W})
            assert f"u{i}" in ps._dense._in_lane
        silent[0].settimeout(L.OFFER_TIMEOUT)
        assert silent[0].recv(512) == b""  # the oldest, dropped for the newer ones
        silent[-1].settimeout(2 * L.OFFER_TIMEOUT)
        assert len(silent[-1].recv(512)) == L._PROOF.size and silent[-1].recv(512) == b""  # its 5 s are up
    finally:
        for s in silent:
            s.close()
    out = ps.push_pull({n: np.ones_like(W) for n in ("w", "u0", "u1", "u2")})
    assert np.array_equal(out["w"], np.full_like(W, 0.5)) and np.array_equal(out["u2"], np.full_like(W, 0.5))
