"""A new workspace packed while it is sent (launch/dispatch.Packing): what a reader gets as the archive grows is
the workspace, its hash is the cached archive's (so the nodes recognise it next time), and a workspace that
changes while it is read is refused -- never an archive holding part of one version and part of another."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest

from paddle_cluster.launch import delta, dispatch
from paddle_cluster.launch.dispatch import Package, Packing, WorkspaceChanged


def _workspace(top: Path) -> Path:
    (top / "data").mkdir(parents=True)
    (top / "data" / "a.bin").write_bytes(os.urandom(3 << 20))
    (top / "data" / "b.bin").write_bytes(os.urandom(3 << 20))
    (top / "train.py").write_text("print('hi')\n")
    (top / "run.sh").write_text("#!/bin/sh\n")
    (top / "run.sh").chmod(0o755)
    os.symlink("train.py", top / "main.py")
    return top


def _read_all(p: Packing) -> bytes:
    r = p.reader()
    return b"".join(iter(lambda: r.read(1 << 16), b""))


def test_a_new_workspace_is_read_as_sent_and_then_cached_under_the_same_hash(tmp_path):
    ws, cache = _workspace(tmp_path / "ws"), str(tmp_path / "cache")
    with contextlib.ExitStack() as hold:
        p = dispatch.workspace_archive(str(ws), cache, hold=hold)
        assert isinstance(p, Packing) and p.files == 5
        data = _read_all(p)
        pkg = p.wait()
        p.close()
    assert len(data) == p.size == pkg.size and hashlib.sha256(data).hexdigest() == pkg.sha256
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        got = {m.name: (t.extractfile(m).read() if m.isfile() else m.linkname) for m in t}
    assert got == {"data/a.bin": (ws / "data/a.bin").read_bytes(), "data/b.bin": (ws / "data/b.bin").read_bytes(),
                   "train.py": b"print('hi')\n", "run.sh": b"#!/bin/sh\n", "main.py": "train.py"}
    with contextlib.ExitStack() as hold:  # unchanged: the cached archive, the same hash, nothing read again
        again = dispatch.workspace_archive(str(ws), cache, hold=hold)
    assert isinstance(again, Package) and again.sha256 == pkg.sha256
    assert Path(again.path).read_bytes() == data
    # packed first, the same workspace is the same archive (a node holding one holds the other)
    entries: dict = {}
    assert dispatch._tar(dispatch._workspace_entries(str(ws)), str(tmp_path), "t", entries).sha256 == pkg.sha256
    # packed as sent, it was hashed once, as a whole: what each file is (for a later delta) is read from the cache
    assert "manifest" not in json.loads(Path(cache, Path(pkg.path).stem + ".json").read_text())
    assert delta.manifest(cache, pkg.sha256) == entries and entries["run.sh"].endswith("x")
    assert entries["main.py"] == "link:train.py"
    assert entries["train.py"] == hashlib.sha256(b"print('hi')\n").hexdigest()


def test_a_small_change_is_packed_first_a_large_one_as_sent(tmp_path):
    ws, cache = _workspace(tmp_path / "ws"), str(tmp_path / "cache")
    with contextlib.ExitStack() as hold:
        first = dispatch.workspace_archive(str(ws), cache, hold=hold)
        first.wait()
        first.close()
        (ws / "train.py").write_text("print('changed')\n")  # a delta may go to the nodes holding the first
        assert isinstance(dispatch.workspace_archive(str(ws), cache, hold=hold), Package)
        (ws / "data" / "a.bin").write_bytes(os.urandom(3 << 20))
        (ws / "data" / "b.bin").write_bytes(os.urandom(3 << 20))
        p = dispatch.workspace_archive(str(ws), cache, hold=hold)
        assert isinstance(p, Packing)
        p.wait()
        p.close()


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


CHANGES = {
    "a file not read yet is rewritten": lambda ws: (ws / "train.py").write_text("print('HI')\n"),
    "a file already read is appended to": lambda ws: _append(ws / "data" / "a.bin", b"more"),
    "a file appears": lambda ws: (ws / "new.txt").write_text("new\n"),
    "a file goes away": lambda ws: (ws / "run.sh").unlink(),
    "the file being read shrinks": lambda ws: os.truncate(ws / "data" / "b.bin", 1 << 20),
}


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_a_workspace_changed_while_it_is_read_is_refused(tmp_path, monkeypatch, what):
    """The change is made from inside the packer, after the first MiB of data/b.bin went out (a.bin is whole in
    the archive, b.bin partly, the rest not yet read): the only way to make it at a known point of the read."""
    ws, cache = _workspace(tmp_path / "ws"), str(tmp_path / "cache")
    emit, done, sent = Packing._emit, threading.Event(), [0]

    def emit_then_change(self, b):
        emit(self, b)
        sent[0] += len(b)
        if sent[0] > (4 << 20) and not done.is_set():
            done.set()
            CHANGES[what](ws)

    monkeypatch.setattr(Packing, "_emit", emit_then_change)
    with contextlib.ExitStack() as hold:
        p = dispatch.workspace_archive(str(ws), cache, hold=hold)
        assert isinstance(p, Packing)
        with pytest.raises(WorkspaceChanged, match="while the workspace was read"):
            _read_all(p)  # a reader sees it too: an upload is cut short, never completed
        with pytest.raises(WorkspaceChanged):
            p.wait()
        p.close()
    assert done.is_set()
    assert not list(Path(cache).glob("*.json")) and not list(Path(cache).glob("*.tar"))  # nothing cached
    assert not list(Path(cache).glob(".*.part"))
