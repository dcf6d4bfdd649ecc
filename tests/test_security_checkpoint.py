"""A checkpoint is input to the pserver that resumes from it (issue 34, point 3): a shard whose manifest's
checksum was updated to match a crafted ``shard.npz`` is still checked member by member -- from the ``.npy``
headers, before anything is allocated or decompressed -- and every stored id against the table's id space.
Each bad member ends the pserver with exit 3 naming the file and the member."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import zipfile

import numpy as np
import pytest
import rt_helpers as H

from paddle_cluster.contract import PSERVER
from paddle_cluster.ps import ConfigMismatch, OptimizerSpec, connect
from paddle_cluster.ps.checkpoint import MANIFEST, SHARD

MiB = 1 << 20


def _checkpoint(tmp_path, env, optimizer=OptimizerSpec("sgd", lr=0.5)) -> str:
    """A real pserver's shard of step 0: a dense block and a table of 3 rows (ids 1, 2, 3) of vocab_size=100."""
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0)
        ps = connect(mode="async", optimizer=optimizer, env=H.trainer_env(env, 0))
        try:
            ps.register_dense({"w": np.arange(8, dtype=np.float32)})
            ps.register_sparse("emb", 2, vocab_size=100, init_scale=0.1)
            ps.pull_sparse("emb", [1, 2, 3])
            ps.save_checkpoint()
        finally:
            ps.close()
        assert H.wait_all(pr, [server], 10) == [0]
    d = os.path.join(str(tmp_path), "checkpoints", "step-00000000", "pserver-0")
    assert os.path.exists(os.path.join(d, MANIFEST)), d
    return d


def _npy_header(shape, dtype="<f4") -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
    return f.getvalue()


def _rewrite(d: str, members, manifest=None) -> None:
    """Rewrite ``shard.npz`` in ``d`` with ``members`` ({name: bytes or a callable writing into a member}) and
    update the manifest's checksum (and ``manifest(m)``'s changes) to match: what a forger would do."""
    path = os.path.join(d, SHARD)
    with zipfile.ZipFile(path) as z:
        old = {n: z.read(n) for n in z.namelist()}
    old.update(members)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in old.items():
            if callable(data):
                with z.open(name, "w", force_zip64=True) as f:
                    data(f)
            else:
                z.writestr(name, data)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    mpath = os.path.join(d, MANIFEST)
    with open(mpath) as f:
        m = json.load(f)
    m["files"][SHARD] = {"sha256": sha, "bytes": os.path.getsize(path)}
    if manifest is not None:
        manifest(m)
    with open(mpath, "w") as f:
        json.dump(m, f)


# The pserver is started from a small parent that reports its peak RSS: a process forked from this (large) test
# process would carry the test's own high-water mark through exec (Linux keeps it in the rusage).
_PEAK = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "paddle_cluster.ps"])
_, status, usage = os.wait4(pid, 0)
print("PEAK", usage.ru_maxrss * 1024, flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _resume_fails(tmp_path, env):
    """Start a pserver resuming step 0 with a 64 MiB budget; (exit code, its log, its peak RSS in bytes)."""
    with H.procs(tmp_path) as pr:
        p = pr.start([sys.executable, "-c", _PEAK], H.proc_env(env, PSERVER, 0, {
            "PADDLE_RESUME": "0", "PADDLE_PSERVER_MEMORY": "64M"}), "pserver0-resume")
        out = p.stdout.read().decode()
        assert p.wait(30) is not None
        return p.returncode, pr.log(p), int(out.split("PEAK")[1])


@pytest.mark.timeout(120)
def test_a_forged_shard_is_refused_member_by_member_before_anything_is_allocated(tmp_path):
    env = H.make_env(1, 1, tmp_path)
    d = _checkpoint(tmp_path, env)
    with zipfile.ZipFile(os.path.join(d, SHARD)) as z:
        pristine = {n: z.read(n) for n in z.namelist()}
    with open(os.path.join(d, MANIFEST)) as f:
        manifest = f.read()

    def restore():
        with zipfile.ZipFile(os.path.join(d, SHARD), "w") as z:
            for n, data in pristine.items():
                z.writestr(n, data)
        with open(os.path.join(d, MANIFEST), "w") as f:
            f.write(manifest)

    # A 1 GiB member of zeros (1 MB on disk), not in the manifest: refused from its name, never inflated.
    def zeros(f):
        f.write(_npy_header((1 << 28,)))
        chunk = bytes(16 * MiB)
        for _ in range(64):
            f.write(chunk)

    _rewrite(d, {"junk.npy": zeros})
    assert os.path.getsize(os.path.join(d, SHARD)) < 4 * MiB
    rc, log, peak = _resume_fails(tmp_path, env)
    assert rc == 3, log
    assert "pserver-0/shard.npz: member junk.npy: not in the manifest; refusing it" in log, log
    assert peak < 100 * MiB, f"peak RSS {peak / MiB:.0f} MiB"  # ~40 MiB: nothing inflated

    # A header of shape (2**40,) for the block's value, the manifest saying the same: refused from the header.
    restore()
    key = json.loads(manifest)["blocks"][0]["key"]
    param = f"d{key}.param"
    _rewrite(d, {f"{param}.npy": _npy_header((1 << 40,)) + bytes(32)},
             lambda m: m["blocks"][0]["param"].__setitem__("shape", [1 << 40]))
    rc, log, peak = _resume_fails(tmp_path, env)
    assert rc == 3, log
    assert f"member {param}.npy: holds" in log and "its header says 4398046511104 bytes of data" in log, log
    assert "Traceback" not in log and peak < 100 * MiB

    # A member whose size matches its header but whose arrays exceed the budget: refused before reading.
    restore()
    n = 20 * MiB  # 80 MiB of float32 zeros, against a 64 MiB budget
    _rewrite(d, {f"{param}.npy": lambda f: (f.write(_npy_header((n,))), [f.write(bytes(4 * MiB)) for _ in range(20)])},
             lambda m: m["blocks"][0]["param"].__setitem__("shape", [n]))
    rc, log, peak = _resume_fails(tmp_path, env)
    assert rc == 3, log
    assert "its arrays hold 80 MiB, more than this pserver's memory budget of 64 MiB" in log, log
    assert peak < 90 * MiB, f"peak RSS {peak / MiB:.0f} MiB"  # ~40 MiB; 80 MiB read would make it 115

    # Stored ids out of order, one far outside vocab_size=100: refused naming the member.
    restore()
    t = json.loads(manifest)["tables"][0]
    ids = f"s{t['key']}.ids"
    buf = io.BytesIO()
    np.save(buf, np.array([2, 10**12, 1], dtype=np.int64))
    _rewrite(d, {f"{ids}.npy": buf.getvalue()})
    rc, log, _ = _resume_fails(tmp_path, env)
    assert rc == 3, log
    assert f"shard.npz member {ids}.npy (table 'emb'): ids are not sorted and unique" in log, log

    # Sorted, but 10**12 is outside the id space trainer 0 declares: its definition is refused.
    restore()
    buf = io.BytesIO()
    np.save(buf, np.array([1, 2, 10**12], dtype=np.int64))
    _rewrite(d, {f"{ids}.npy": buf.getvalue()})
    with H.procs(tmp_path) as pr:
        server = pr.pserver(env, 0, {"PADDLE_RESUME": "0"})
        ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.5), env=H.trainer_env(env, 0))
        try:
            with pytest.raises(ConfigMismatch, match=r"table 'emb': the checkpoint holds 3 rows with ids "
                                                     r"1\.\.1000000000000 on pserver 0, more than vocab_size=100"):
                ps.register_sparse("emb", 2, vocab_size=100, init_scale=0.1)
        finally:
            ps.close()
        server.kill()


def _keeper(d: str):
    """A function that puts the shard directory ``d`` back as it is now."""
    with open(os.path.join(d, SHARD), "rb") as f:
        shard = f.read()
    with open(os.path.join(d, MANIFEST), "rb") as f:
        manifest = f.read()

    def restore():
        for name, data in ((SHARD, shard), (MANIFEST, manifest)):
            path = os.path.join(d, name)
            if os.path.lexists(path):
                os.unlink(path)
            with open(path, "wb") as f:
                f.write(data)
    return restore


def _edit_manifest(d: str, change) -> None:
    with open(os.path.join(d, MANIFEST)) as f:
        m = json.load(f)
    change(m)
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump(m, f)


def _refused(tmp_path, env, *expected, peak_below=100 * MiB):
    rc, log, peak = _resume_fails(tmp_path, env)
    assert rc == 3, log
    assert "Traceback" not in log, log
    for text in expected:
        assert text in log, log
    assert peak < peak_below, f"peak RSS {peak / MiB:.0f} MiB"
    return log


@pytest.mark.timeout(240)
def test_resume_reads_only_regular_files_of_the_shard_directory_and_checks_every_field(tmp_path):
    """Issue 46, point 5: each attack row on a manifest, each refused with exit 3 naming the file and the member,
    within seconds (nothing read from a device, nothing waited on)."""
    env = H.make_env(1, 1, tmp_path)
    d = _checkpoint(tmp_path, env, OptimizerSpec("adam", lr=0.1))
    restore = _keeper(d)
    m0 = json.loads(open(os.path.join(d, MANIFEST)).read())
    block, table = m0["blocks"][0], m0["tables"][0]
    assert set(block["opt"]) == {"m", "v", "t"} and set(table["slots"]) == {"m", "v", "t"}

    # A files entry naming /dev/zero, or ../../../../etc/shadow with its true hash: never opened.
    _edit_manifest(d, lambda m: m["files"].__setitem__("/dev/zero", {"sha256": "0" * 64, "bytes": 0}))
    _refused(tmp_path, env, f"{d}/manifest.json: manifest's files are ['/dev/zero', 'shard.npz'], a save writes "
                            "exactly shard.npz; refusing it")
    restore()
    with open("/etc/shadow", "rb") as f:
        shadow = {"sha256": hashlib.sha256(f.read()).hexdigest(), "bytes": os.path.getsize("/etc/shadow")}
    _edit_manifest(d, lambda m: m.__setitem__("files", {"../../../../etc/shadow": shadow}))
    _refused(tmp_path, env, "manifest's files are ['../../../../etc/shadow'], a save writes exactly shard.npz")

    # shard.npz itself a symbolic link (to /dev/zero), a character device, a FIFO; manifest.json a FIFO.
    restore()
    os.unlink(os.path.join(d, SHARD))
    os.symlink("/dev/zero", os.path.join(d, SHARD))
    _refused(tmp_path, env, f"{d}/shard.npz: is a symbolic link, not a regular file; refusing it")
    os.unlink(os.path.join(d, SHARD))
    os.mknod(os.path.join(d, SHARD), 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    _refused(tmp_path, env, f"{d}/shard.npz: is a character device, not a regular file; refusing it")
    os.unlink(os.path.join(d, SHARD))
    os.mkfifo(os.path.join(d, SHARD))
    _refused(tmp_path, env, f"{d}/shard.npz: is a FIFO, not a regular file; refusing it")
    restore()
    os.unlink(os.path.join(d, MANIFEST))
    os.mkfifo(os.path.join(d, MANIFEST))
    _refused(tmp_path, env, f"{d}/manifest.json: is a FIFO, not a regular file; refusing it")

    # A 200 MB block name: refused from the manifest's size (at most the budget over 24, what parsing it holds);
    # a 2000-character one, from MAX_NAME.
    restore()
    with open(os.path.join(d, MANIFEST), "w") as f:
        f.write(json.dumps({**m0, "blocks": [{**block, "name": "@@NAME@@"}]}).replace("@@NAME@@", "x" * (200 << 20)))
    _refused(tmp_path, env, f"{d}/manifest.json: 209717", "bytes, more than the 2796202 it may hold; refusing it")
    restore()
    _edit_manifest(d, lambda m: m["blocks"][0].__setitem__("name", "w" * 2000))
    _refused(tmp_path, env, "manifest.json: block 0's name is 2000 characters: a name is a string of 1 to 1024 "
                            "characters; refusing it")

    # An optimizer slot of the wrong shape (manifest and member agreeing with each other), an unknown spec key.
    restore()
    buf = io.BytesIO()
    np.save(buf, np.zeros(3, np.float32))
    _rewrite(d, {f"d{block['key']}.opt.m.npy": buf.getvalue()},
             lambda m: m["blocks"][0]["opt"]["m"].__setitem__("shape", [3]))
    _refused(tmp_path, env, "manifest.json: block 0 ('w'): slot m is <f4(3,), adam keeps <f4(8,); refusing it")
    restore()
    _edit_manifest(d, lambda m: m["tables"][0]["spec"]["current"].__setitem__("bogus", 1))
    _refused(tmp_path, env, "manifest.json: table 0 ('emb') optimizer: unknown optimizer keys ['bogus']")

    # NaN in a value, Inf in an optimizer state: refused naming the member and its parameter.
    for member, owner in ((f"d{block['key']}.param", "block w[0:8]"), (f"s{table['key']}.slot.v", "table 'emb'")):
        restore()
        with zipfile.ZipFile(os.path.join(d, SHARD)) as z:
            a = np.load(io.BytesIO(z.read(member + ".npy")))
        a.reshape(-1)[1] = np.nan if member.endswith("param") else np.inf
        buf = io.BytesIO()
        np.save(buf, a)
        _rewrite(d, {member + ".npy": buf.getvalue()})
        _refused(tmp_path, env, f"{d}: shard.npz member {member}.npy ({owner}) holds NaN or Inf; refusing it")
