"""Unpacking a workspace on a node (node.unpack.safe_extract) and packing one on the launcher (dispatch)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_cluster.launch.dispatch import pack_library, pack_workspace
from paddle_cluster.node.unpack import UnsafeArchive, safe_extract


# -- building archives --------------------------------------------------------------------------------
def member(name: str, kind: str = "file", data: bytes = b"x", link: str = "", size=None) -> tuple:
    return (name, kind, data, link, size)


def make_tar(path: Path, members) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, kind, data, link, size in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            if kind == "file":
                info.size = len(data) if size is None else size
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                             "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
                info.mode = 0o755 if kind == "dir" else 0o644
                info.linkname = link
                tar.addfile(info)
    return path


def snapshot(root: Path) -> set:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, n), root))
    return out


@pytest.fixture
def box(tmp_path):
    """tmp/sandbox/job is the destination; tmp/outside must stay untouched."""
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.txt").write_text("original")
    return tmp_path


def assert_refused(box: Path, members, match=None, **kw) -> None:
    archive = make_tar(box / "a.tar", members)
    before = snapshot(box / "outside")
    dest = box / "sandbox" / "job"
    with pytest.raises(UnsafeArchive, match=match):
        safe_extract(str(archive), str(dest), **kw)
    assert not dest.exists(), "a refused archive must leave no destination"
    assert os.listdir(box / "sandbox") == [], "nor a half-unpacked temporary directory"
    assert snapshot(box / "outside") == before
    assert (box / "outside" / "victim.txt").read_text() == "original"
    assert not (box / "evil").exists() and not (box / "sandbox" / "evil").exists()


# -- refusals ---------------------------------------------------------------------------------------
def test_absolute_path(box):
    assert_refused(box, [member("ok.txt"), member(str(box / "outside" / "abs.txt"))], "absolute")


def test_dotdot(box):
    assert_refused(box, [member("ok.txt"), member("../evil")], r"\.\.")
    assert_refused(box, [member("a/b/../../../evil")], r"\.\.")
    assert_refused(box, [member("../../outside/victim.txt", data=b"pwned")], r"\.\.")


def test_symlink_absolute_outside(box):
    assert_refused(box, [member("link", "sym", link=str(box / "outside"))], "outside")


def test_symlink_relative_outside(box):
    assert_refused(box, [member("d", "dir"), member("d/link", "sym", link="../../outside")], "outside")


def test_hardlink_outside(box):
    assert_refused(box, [member("h", "hard", link=str(box / "outside" / "victim.txt"))], "outside")
    assert_refused(box, [member("h", "hard", link="../outside/victim.txt")], "outside")


def test_symlink_then_file_through_it(box):
    """The classic: 'link -> outside' passes a naive name check, then 'link/evil' writes through it."""
    assert_refused(box, [member("link", "sym", link=str(box / "outside")), member("link/evil", data=b"pwned")])
    assert_refused(box, [member("link", "sym", link="../../outside"), member("link/evil", data=b"pwned")])


@pytest.mark.parametrize("kind", ["chr", "blk", "fifo"])
def test_special_files(box, kind):
    assert_refused(box, [member("ok.txt"), member("dev", kind)], "device, fifo")


def test_member_over_size_cap(box):
    assert_refused(box, [member("big.bin", data=b"x" * 100)], "limit", max_bytes=50)


def test_total_over_size_cap(box):
    assert_refused(box, [member("a", data=b"x" * 40), member("b", data=b"x" * 40)], "more than 50", max_bytes=50)


def test_non_empty_destination_refused(box):
    archive = make_tar(box / "a.tar", [member("f.txt", data=b"new")])
    dest = box / "sandbox" / "job"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(UnsafeArchive, match="not empty"):
        safe_extract(str(archive), str(dest))
    assert snapshot(dest) == {"keep.txt"} and (dest / "keep.txt").read_text() == "mine"


def test_corrupt_archive(box):
    (box / "a.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(tarfile.TarError):
        safe_extract(str(box / "a.tar"), str(box / "sandbox" / "job"))
    assert os.listdir(box / "sandbox") == []


def test_hardlink_to_missing_member(box):
    assert_refused(box, [member("h", "hard", link="not-there")])


def test_symlink_with_empty_target(box):
    assert_refused(box, [member("a", "dir"), member("a/l/.", "sym", link="")])  # its own dir: a loop


def test_agent_unpack_command_reports_refusal_as_json(box):
    """``python -m paddle_cluster.node unpack`` answers a refusal with one JSON line (the reason), exit status 1."""
    import json
    import subprocess
    import sys

    archive = make_tar(box / "a.tar", [member("../evil")])
    dest = box / "sandbox" / "job"
    res = subprocess.run([sys.executable, "-m", "paddle_cluster.node", "unpack", "--archive", str(archive),
                          "--dest", str(dest)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["ok"] is False and "'..'" in doc["error"]
    assert not dest.exists() and "Traceback" not in res.stderr


# -- acceptance ---------------------------------------------------------------------------------------
def test_normal_archive(box):
    archive = make_tar(box / "a.tar", [
        member("a", "dir"), member("a/b", "dir"), member("a/b/c.txt", data=b"deep"),
        member("top.py", data=b"print(1)\n"), member("a/link", "sym", link="b/c.txt"),
        member("a/b/same", "sym", link="c.txt"),  # relative, stays inside
        member("x/y/z.txt", data=b"implicit parents"), member("hard", "hard", link="top.py"),
    ])
    dest = box / "sandbox" / "job"
    n = safe_extract(str(archive), str(dest))
    assert n == 8
    assert (dest / "a" / "b" / "c.txt").read_bytes() == b"deep"
    assert (dest / "a" / "link").is_symlink() and os.readlink(dest / "a" / "link") == "b/c.txt"
    assert (dest / "a" / "link").read_bytes() == b"deep"
    assert (dest / "x" / "y" / "z.txt").read_bytes() == b"implicit parents"
    assert (dest / "hard").read_bytes() == b"print(1)\n"
    assert os.listdir(box / "sandbox") == ["job"]


def test_empty_existing_destination_is_used(box):
    archive = make_tar(box / "a.tar", [member("f.txt", data=b"hi")])
    dest = box / "sandbox" / "job"
    dest.mkdir()
    safe_extract(str(archive), str(dest))
    assert (dest / "f.txt").read_bytes() == b"hi"


def test_directory_stays_traversable(box):
    with tarfile.open(box / "a.tar", "w") as tar:
        d = tarfile.TarInfo("d")
        d.type, d.mode = tarfile.DIRTYPE, 0o644
        tar.addfile(d)
    dest = box / "sandbox" / "job"
    safe_extract(str(box / "a.tar"), str(dest))
    assert (dest / "d").stat().st_mode & 0o700 == 0o700


def test_setuid_bits_are_dropped(box):
    with tarfile.open(box / "a.tar", "w") as tar:
        info = tarfile.TarInfo("suid")
        info.mode = 0o4755
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    dest = box / "sandbox" / "job"
    safe_extract(str(box / "a.tar"), str(dest))
    assert not (dest / "suid").stat().st_mode & 0o7000



def test_world_writable_bits_are_normalised(box):
    """Modes are normalised: nobody else may write, executables stay executable (was: 0o777 kept)."""
    with tarfile.open(box / "a.tar", "w") as tar:
        for name, typ, mode in (("d", tarfile.DIRTYPE, 0o777), ("d/run.sh", tarfile.REGTYPE, 0o777),
                                ("d/data", tarfile.REGTYPE, 0o666), ("own", tarfile.REGTYPE, 0o600)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = typ, mode
            tar.addfile(info, io.BytesIO(b"") if typ == tarfile.REGTYPE else None)
    dest = box / "sandbox" / "job"
    safe_extract(str(box / "a.tar"), str(dest))
    modes = {n: (dest / n).stat().st_mode & 0o7777 for n in ("d", "d/run.sh", "d/data", "own")}
    assert modes == {"d": 0o755, "d/run.sh": 0o755, "d/data": 0o644, "own": 0o644}, \
        {k: oct(v) for k, v in modes.items()}


def test_dot_member_leaves_the_destination_owner_only(box):
    """A '.' member with mode 0777 made the job directory world-writable until the launcher's chmod."""
    with tarfile.open(box / "a.tar", "w") as tar:
        for name in (".", "./"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o777
            tar.addfile(info)
        info = tarfile.TarInfo("f.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    dest = box / "sandbox" / "job"
    assert safe_extract(str(box / "a.tar"), str(dest)) == 3
    assert dest.stat().st_mode & 0o777 == 0o700
    assert (dest / "f.txt").read_bytes() == b"hi"


def test_member_count_is_capped(box):
    members = [member(f"f{i}") for i in range(11)]
    assert_refused(box, members, "more than 10 members", max_members=10)
    archive = make_tar(box / "b.tar", members[:10])
    assert safe_extract(str(archive), str(box / "sandbox" / "job"), max_members=10) == 10


def _patch_header(f, offset: int = 0, typeflag: bytes = b"", size: int = -1) -> None:
    """Rewrite the type flag and/or size of the tar header block at ``offset`` of open file ``f``, with its checksum."""
    f.seek(offset)
    block = bytearray(f.read(512))
    if typeflag:
        block[156:157] = typeflag
    if size >= 0:
        block[124:136] = b"%011o\0" % size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    f.seek(offset)
    f.write(block)


def assert_refused_archive(box: Path, archive: Path, match: str) -> None:
    dest = box / "sandbox" / "job"
    with pytest.raises(UnsafeArchive, match=match):
        safe_extract(str(archive), str(dest))
    assert os.listdir(box / "sandbox") == []


def test_default_size_cap_is_the_archive_size(box):
    """Without max_bytes the cap is the archive's own size (was 64 GiB): a member claiming more is refused
    before anything is written."""
    archive = make_tar(box / "a.tar", [member("claims.bin", data=b"x" * 10)])
    with open(archive, "r+b") as f:
        _patch_header(f, size=1 << 30)
    assert_refused_archive(box, archive, f"over the {os.path.getsize(archive)}-byte limit")


def test_sparse_member_is_refused(box):
    archive = make_tar(box / "a.tar", [member("s.bin", data=b"x" * 10)])
    with open(archive, "r+b") as f:
        _patch_header(f, typeflag=tarfile.GNUTYPE_SPARSE)
    assert_refused_archive(box, archive, "sparse")


def test_huge_pax_header_is_refused_without_reading_it(box):
    """A 300 MB pax header cost 330 MB of RSS (tarfile reads it whole); it is now refused from its size alone.

    The archive is a sparse file (its 300 MB are a hole); the unpacker runs as the agent's sub-command in a
    child process whose peak RSS is measured."""
    import json
    import subprocess
    import sys

    size = 300 << 20
    archive = make_tar(box / "a.tar", [member("f", data=b"")])
    with open(archive, "r+b") as f:
        _patch_header(f, typeflag=tarfile.XHDTYPE, size=size)
        f.seek(512 + size)
        f.write(bytes(1024))
    dest = box / "sandbox" / "job"
    # Linux carries a parent's peak RSS into a forked child's ru_maxrss, so the unpack runs under a fresh,
    # small interpreter that reports its child's peak: this test process's size does not count.
    measure = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "paddle_cluster.node", "unpack",
                           "--archive", str(archive), "--dest", str(dest)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "extended header" in doc["error"] and str(size) in doc["error"], doc
    peak_kib = int(proc.stderr.strip().splitlines()[-1])  # ru_maxrss is in KiB on Linux
    assert peak_kib < 100 * 1024, f"peak RSS {peak_kib} KiB"
    assert os.listdir(box / "sandbox") == []

# -- property: whatever the names, nothing lands outside the destination ---------------------------------
SEGMENTS = ["..", "", ".", "a", "b", "link", "evil", "..."]


@st.composite
def archives(draw):
    members = []
    for _ in range(draw(st.integers(1, 5))):
        segs = draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4))
        prefix = draw(st.sampled_from(["", "", "/", "//", "./", "ABS/", "../"]))
        kind = draw(st.sampled_from(["file", "file", "dir", "sym", "hard"]))
        link = ""
        if kind in ("sym", "hard"):
            lsegs = draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3))
            link = draw(st.sampled_from(["", "/", "ABS/", "../"])) + "/".join(lsegs)
        members.append((prefix + "/".join(segs), kind, link))
    return members


def _resolve_abs(text: str, outside: str) -> str:
    # Absolute names point into a directory of ours, never at the real filesystem root.
    text = text.replace("ABS/", outside + "/")
    if text.startswith("/") and not text.startswith(outside):
        text = outside + text
    return text


@settings(max_examples=150, deadline=None)
@given(spec=archives())
def test_property_nothing_escapes(spec):
    with tempfile.TemporaryDirectory() as top:
        top = os.path.realpath(top)
        sandbox, outside = os.path.join(top, "sandbox"), os.path.join(top, "outside")
        os.makedirs(sandbox)
        os.makedirs(outside)
        members = [member(_resolve_abs(name, outside), kind, b"payload", _resolve_abs(link, outside))
                   for name, kind, link in spec]
        archive = make_tar(Path(top) / "a.tar", members)
        dest = os.path.join(sandbox, "job")
        try:
            safe_extract(str(archive), dest)
            ok = True
        except (UnsafeArchive, tarfile.TarError, OSError):
            ok = False
        assert os.listdir(outside) == []
        assert sorted(os.listdir(top)) == ["a.tar", "outside", "sandbox"]
        if not ok:
            assert os.listdir(sandbox) == []
            return
        assert os.listdir(sandbox) == ["job"]
        real_dest = os.path.realpath(dest)

        def inside(path: str) -> bool:
            return path == real_dest or path.startswith(real_dest + os.sep)

        for dirpath, dirnames, filenames in os.walk(dest):
            assert inside(os.path.realpath(dirpath)), dirpath
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                if os.path.islink(p):
                    try:  # a link may dangle or loop (it then reaches nothing), else it must stay inside
                        target = os.path.realpath(p, strict=True)
                    except OSError:
                        continue
                    assert inside(target), (p, os.readlink(p))


# -- packing --------------------------------------------------------------------------------------------
def workspace(root: Path) -> Path:
    files = {
        "train.py": "print('train')\n", "data/train.list": "a\nb\n", "data/sub/x.txt": "x",
        "sub/log/keep.txt": "nested log/ is kept", "sub/output/keep.txt": "nested output/ too",
        ".git/config": "[core]", "__pycache__/m.cpython-311.pyc": "", "data/__pycache__/y.pyc": "",
        "mod.pyc": "", "log/old.log": "old", "output/pass-00000/w": "weights",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    os.symlink("data/train.list", root / "train.list")
    return root


def names(path: str) -> list:
    with tarfile.open(path) as t:
        return t.getnames()


def sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_pack_workspace_is_deterministic_and_skips(tmp_path):
    ws = workspace(tmp_path / "ws")
    (tmp_path / "o1").mkdir()
    (tmp_path / "o2").mkdir()
    p1 = pack_workspace(str(ws), str(tmp_path / "o1"))
    p2 = pack_workspace(str(ws), str(tmp_path / "o2"))
    assert p1.sha256 == p2.sha256 == sha(p1.path) == sha(p2.path)
    assert p1.size == os.path.getsize(p1.path)
    got = names(p1.path)
    assert sorted(got) == sorted(["train.py", "train.list", "data/train.list", "data/sub/x.txt",
                                  "sub/log/keep.txt", "sub/output/keep.txt"])
    assert p1.files == len(got)
    # ...and the agent unpacks it, internal symlink included
    dest = tmp_path / "job"
    safe_extract(p1.path, str(dest))
    assert (dest / "train.list").read_text() == "a\nb\n"
    assert (dest / "sub" / "log" / "keep.txt").exists()


def test_pack_workspace_hash_tracks_content(tmp_path):
    ws = workspace(tmp_path / "ws")
    before = pack_workspace(str(ws), str(tmp_path)).sha256
    (ws / "train.py").write_text("print('changed')\n")
    assert pack_workspace(str(ws), str(tmp_path)).sha256 != before
    # a change only in skipped places does not change it
    again = pack_workspace(str(ws), str(tmp_path)).sha256
    (ws / "log" / "new.log").write_text("noise")
    (ws / ".git" / "HEAD").write_text("ref")
    assert pack_workspace(str(ws), str(tmp_path)).sha256 == again


def test_pack_library_is_the_node_side_only(tmp_path):
    lib = pack_library(str(tmp_path))
    got = names(lib.path)
    for needed in ("paddle_cluster/__init__.py", "paddle_cluster/node/__main__.py", "paddle_cluster/contract.py"):
        assert needed in got
    for room in ("ps", "train", "compat"):
        assert any(n.startswith(f"paddle_cluster/{room}/") and n.endswith(".py") for n in got), room
    assert not any(n.startswith("paddle_cluster/launch") for n in got)
    assert "paddle_cluster/cli.py" not in got
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in got)
    assert pack_library(str(tmp_path)).sha256 == lib.sha256
    # it installs with the agent's own safe extraction
    safe_extract(lib.path, str(tmp_path / "lib"))
    assert (tmp_path / "lib" / "paddle_cluster" / "node" / "__main__.py").is_file()


def test_pack_workspace_reuses_the_cached_archive(tmp_path):
    """An unchanged tree is not re-read: the cached archive is returned as is; a change builds a new one."""
    ws = workspace(tmp_path / "ws")
    cache = tmp_path / "cache"
    first = pack_workspace(str(ws), str(cache))
    inode = os.stat(first.path).st_ino
    again = pack_workspace(str(ws), str(cache))
    assert again == first and os.stat(again.path).st_ino == inode
    (ws / "train.py").write_text("print('v2')\n")
    changed = pack_workspace(str(ws), str(cache))
    assert changed.sha256 != first.sha256 and changed.sha256 == sha(changed.path)
    # Only the most recently used archives are kept.
    for i in range(3):
        (ws / "train.py").write_text(f"print({i})\n")
        pack_workspace(str(ws), str(cache), keep=2)
    assert len(list(cache.glob("*.tar"))) == 2 and len(list(cache.glob("*.json"))) == 2
