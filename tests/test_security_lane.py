"""What a trainer that knows its key can make a pserver map or keep alive through same-host lanes (issue 46, point
1), on a real pserver process with a 64 MiB budget, the trainer speaking raw frames and raw desk exchanges: sealed
sparse memfds from 64 TiB down to 8 KiB, empty layouts, and memfds filled with ``posix_fallocate`` then closed by
the trainer. Every lane is exactly its blocks, charged before it is mapped (an offer when the desk keeps its
descriptor), and a block is in one lane of a trainer: the pserver's VmSize and the shared memory it keeps alive
stay within the budget, and each refusal names what was refused."""

from __future__ import annotations

import os
import socket

import pytest
import rt_helpers as H
from helpers import wait_for
from test_security_budget import MEMORY, Raw, _dense

from paddle_cluster.ps.errors import PSError
from paddle_cluster.ps.wire import lane as L
from paddle_cluster.ps.wire import protocol as P

MiB = 1 << 20
BUDGET = 64 * MiB
N = 1 << 18  # the block's elements: 1 MiB of float32, its lane 2 MiB
EXACT = 2 * L.aligned(4 * N)


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _kept_alive(pid: int) -> int:
    """Bytes of the memfds process ``pid`` keeps alive: those it holds a descriptor of or maps, each once (a
    sparse one counts its whole size: what a trainer could fill)."""
    seen = {}
    for d in (f"/proc/{pid}/fd", f"/proc/{pid}/map_files"):
        for name in os.listdir(d):
            path = os.path.join(d, name)
            try:
                if "memfd:" in os.readlink(path):
                    st = os.stat(path)
                    seen[st.st_ino] = st.st_size
            except OSError:  # closed or unmapped meanwhile
                pass
    return sum(seen.values())


def _memfd(size: int, fill: bool = False) -> int:
    fd = os.memfd_create("paddle-cluster-lane", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if fill:
        os.posix_fallocate(fd, 0, size)
    L.fcntl.fcntl(fd, L.fcntl.F_ADD_SEALS, L.SEALS)
    return fd


def _offer(env, token: str, fd: int, size: int) -> tuple:
    """Trainer 0's exchange at pserver 0's desk (its ``token``) with its own key, as ``lane.offer`` makes it: (the
    desk's answer, "" when it kept the offer; the nonce to claim it with)."""
    port, key = env.all_ports(0)[0], bytes.fromhex(env.key_of(0))
    mine = os.urandom(L.NONCE_SIZE)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(L.socket_name(env.job_id, 0, port, token))
        s.send(L._HELLO.pack(0, mine))
        _, desk, _proof = L._PROOF.unpack(s.recv(512))
        socket.send_fds(s, [L._OFFER.pack(size, L._mac(key, b"lane", env.job_id, 0, 0, port, mine, desk, size))],
                        [fd])
        return s.recv(512).decode().strip("\0"), mine


def _claim(raw: Raw, nonce: bytes, layout=((0, 0),)) -> dict:
    pairs = b"".join(int(k).to_bytes(8, "little", signed=True) + int(o).to_bytes(8, "little", signed=True)
                     for k, o in layout)
    raw.send(P.Op.LANE, nonce + pairs)
    got = raw.reply()[1]
    assert not isinstance(got, PSError), got
    return got


def _defined(env, raw: Raw) -> str:
    """Trainer 0's job declared and its one block defined on ``raw``: the desk's token."""
    got = raw.call_json(P.Op.DECLARE, {"mode": "async", "optimizer": {"name": "sgd", "lr": 0.1},
                                       "trainers": env.trainers, "n_pservers": 1, "staleness": None})
    assert not isinstance(got, PSError), got
    defined = raw.call_json(P.Op.DEF_DENSE, _dense("w", N), key=0)
    assert not isinstance(defined, PSError), defined
    return got["lane"]


@pytest.mark.timeout(120)
def test_huge_sparse_memfds_are_refused_or_charged_and_vmsize_stays_within_the_budget(tmp_path):
    """Sealed sparse memfds of 64 TiB down to 8 KiB, claimed on two connections with the block's layout: past
    the budget refused at the desk naming it, any other size but the layout's refused, the exact one mapped
    once per trainer (a second connection's claim of the same block refused); VmSize grows by one lane."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, MEMORY)
        raws = [Raw(env, 0), Raw(env, 0)]
        try:
            token = _defined(env, raws[0])
            base = _vm_size(server.pid)
            sizes = [1 << s for s in range(46, 12, -1) if 1 << s != EXACT] + [EXACT, EXACT]
            answers = {}
            for i, size in enumerate(sizes):  # the two exact ones (last, one after the other) on either connection
                fd = _memfd(size)
                try:
                    why, nonce = _offer(env, token, fd, size)
                finally:
                    os.close(fd)  # the trainer keeps nothing: what stays alive is the pserver's
                if not why:
                    why = _claim(raws[i % 2], nonce).get("reason") or "mapped"
                answers[size] = answers.get(size, []) + [why]
                assert _vm_size(server.pid) - base <= BUDGET, (size, why)
                assert _kept_alive(server.pid) <= BUDGET, (size, why)
            for size in (s for s in sizes if s > BUDGET // 2):  # 64 TiB .. 64 MiB: not even kept
                assert "memory budget (PADDLE_PSERVER_MEMORY)" in answers[size][0], (size, answers[size])
                assert "trainer 0's same-host lane offered" in answers[size][0]
            for size in (s for s in sizes if s <= BUDGET // 2 and s != EXACT):  # 32 MiB .. 8 KiB: kept, refused
                assert f"the lane offered is {size} bytes, its layout needs {EXACT}" in answers[size][0]
            assert answers[EXACT][0] == "mapped"
            assert "block 0 is in another of its lanes here already" in answers[EXACT][1], answers[EXACT]
            assert _vm_size(server.pid) - base <= L.mapped_bytes(EXACT) + 4 * MiB
            assert _kept_alive(server.pid) == EXACT
        finally:
            for r in raws:
                r.close()
        wait_for(lambda: _kept_alive(server.pid) == 0, 10, "the pserver to unmap the lane with the connection")
        assert "Traceback" not in pr.log(server)


@pytest.mark.timeout(120)
def test_empty_layouts_and_spread_layouts_map_nothing(tmp_path):
    """A lane claimed with no block, or with its block placed so the memfd is bigger than it, is refused naming
    why; the pserver maps nothing and keeps nothing alive, and its budget is whole again (the exact lane fits)."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, MEMORY)
        raw = Raw(env, 0)
        try:
            token = _defined(env, raw)
            for layout, why in (((), "an empty lane layout"), (((0, L.ALIGN),), "spread over")):
                for _ in range(30):  # 30 x 32 MiB offered and refused: each charge given back
                    fd = _memfd(32 * MiB)
                    try:
                        got, nonce = _offer(env, token, fd, 32 * MiB)
                    finally:
                        os.close(fd)
                    assert got == "", got
                    assert why in _claim(raw, nonce, layout)["reason"]
                    assert _kept_alive(server.pid) == 0
            fd = _memfd(EXACT)
            try:
                got, nonce = _offer(env, token, fd, EXACT)
            finally:
                os.close(fd)
            assert got == "" and _claim(raw, nonce)["lane"] is True
        finally:
            raw.close()


@pytest.mark.timeout(120)
def test_fallocated_memfds_closed_by_the_trainer_are_charged_while_kept(tmp_path):
    """Four 32 MiB memfds filled with posix_fallocate, offered and closed by the trainer: the desk keeps only
    what its budget holds (the refusal names it), the shared memory it keeps alive never passes the budget,
    and claimed with empty layouts they are all let go."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, MEMORY)
        raw = Raw(env, 0)
        try:
            token = _defined(env, raw)
            kept, refused = [], []
            for _ in range(4):
                fd = _memfd(32 * MiB, fill=True)
                try:
                    why, nonce = _offer(env, token, fd, 32 * MiB)
                finally:
                    os.close(fd)
                (refused if why else kept).append(why or nonce)
                assert _kept_alive(server.pid) <= BUDGET
            assert len(kept) == 1 and len(refused) == 3, refused  # 32 MiB + the 8 MiB block's charge: no room for 2
            assert "needs 32 MiB but" in refused[0] and "64 MiB memory budget (PADDLE_PSERVER_MEMORY)" in refused[0]
            assert _kept_alive(server.pid) == 32 * MiB
            assert "an empty lane layout" in _claim(raw, kept[0], ())["reason"]
            assert _kept_alive(server.pid) == 0
        finally:
            raw.close()


@pytest.mark.timeout(60)
def test_one_trainers_unclaimed_offers_are_capped(tmp_path):
    """A trainer that offers and never claims gets 16 offers kept (each charged), the 17th refused naming the
    cap: it cannot fill the desk's 64 for the others."""
    env = H.make_env(1, 1, tmp_path)
    with H.procs(tmp_path) as pr:
        pr.pserver(env, 0, MEMORY)
        raw = Raw(env, 0)
        try:
            token = _defined(env, raw)
            answers = []
            for _ in range(L.MAX_PENDING_PER_TRAINER + 1):
                fd = _memfd(EXACT)
                try:
                    answers.append(_offer(env, token, fd, EXACT)[0])
                finally:
                    os.close(fd)
            assert answers[:-1] == [""] * L.MAX_PENDING_PER_TRAINER
            assert f"trainer 0: {L.MAX_PENDING_PER_TRAINER} of its offers are waiting to be claimed" == answers[-1]
        finally:
            raw.close()
