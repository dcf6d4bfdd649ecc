"""scripts/venv, the README's first command (issue 37 point 8): where Debian and Ubuntu leave ensurepip out of
their Python (package python3.X-venv) and the user is not root, it says what to install and leaves nothing
behind. The root path (apt-get installs the package, the venv is made, the demo runs) needs a fresh machine and
the package index: it was tried by hand on Debian 12 (see the commit adding this test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import REPO

NOBODY = 65534


def _python_for_a_user() -> str:
    """An interpreter the user the test runs as may execute: ours; as root, the system's (``nobody`` cannot enter
    root's home, where ours may live) with setpriv to drop root."""
    if os.geteuid() != 0:
        return sys.executable
    if not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("as root this needs setpriv and /usr/bin/python3 to run the script as another user")
    return "/usr/bin/python3"


def test_without_ensurepip_a_user_is_told_what_to_install():
    python = _python_for_a_user()
    # The interpreter, as Debian ships it without python3.X-venv: its ensurepip cannot be imported. PYTHONPATH
    # comes before the standard library, so a module of that name that fails stands in for the missing one (in a
    # directory the other user can read: pytest's own are root's alone).
    shadow = Path(tempfile.mkdtemp(prefix="no-ensurepip-"))
    try:
        shadow.chmod(0o755)
        (shadow / "ensurepip.py").write_text("raise ImportError('ensurepip is not in this Python')\n")
        _refused(python, shadow)
    finally:
        shutil.rmtree(shadow)


def _refused(python: str, shadow: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(shadow), "PYTHONPATH": str(shadow), "PYTHON": python}
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    res = subprocess.run([*drop, str(REPO / "scripts" / "venv")], env=env, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == (f"scripts/venv: {python} cannot make a venv: its ensurepip is missing; "
                                  f"install it as root (Debian/Ubuntu: sudo apt-get install python{version}-venv), "
                                  "then run me again"), res.stderr
    assert not (REPO / ".venv").exists() or (REPO / ".venv" / "bin" / "python").exists()  # nothing half-made


def test_the_readme_makes_the_venv_before_anything_is_installed():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = next(line for line in readme.splitlines() if "paddle-cluster run --job_dispatch_package examples" in line)
    assert first.startswith("scripts/venv && . .venv/bin/activate && paddle-cluster run "), first
    assert "pip install" not in first
    assert Path(REPO / "scripts" / "venv").stat().st_mode & 0o111
