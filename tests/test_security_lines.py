"""No value becomes a line of its own in what a backend is given: every config key and every option of ``render``
(the command ``run --dry-run`` shares) fed a newline, a carriage return or a NUL byte is refused in one line
naming it, on every backend, and nothing is rendered (a newline in ROOT_DIR once split the Slurm batch script's
``#SBATCH --output`` line, and the second half ran as a command)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from paddle_cluster.cli import main
from paddle_cluster.launch.backends import run_options
from paddle_cluster.launch.config import KEYS
from paddle_cluster.launch.registry import REGISTRY

BACKENDS = list(REGISTRY)
BASE = {"HOSTS": '["root@10.0.0.1", "root@10.0.0.2"]', "ROOT_DIR": '"/home/paddle"', "K8S_IMAGE": '"python:3.11"'}
INJECTED = "x\ntouch {marker}\n"  # what an attacker-shaped value would run if it became a line of a script


def _cli(tmp: Path, conf: dict, *args: str):
    (tmp / "conf.py").write_text("".join(f"{k} = {v}\n" for k, v in conf.items()))
    old = os.getcwd()
    os.chdir(tmp)
    try:
        return CliRunner(env={k: None for k in os.environ if k.startswith("PADDLE_")}).invoke(main, list(args))
    finally:
        os.chdir(old)


def _refused(res, name: str, marker: Path) -> None:
    """Exit 2, nothing rendered, one line of error naming ``name``, and nothing ran."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and res.stdout == "", (name, res.exit_code, res.stdout)
    assert len(lines) == 1 and name in lines[0] or \
        (len(lines) == 3 and lines[0].startswith("Usage:") and name in lines[2]), (name, res.stderr)  # click's form
    assert not marker.exists()


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text("print(1)\n")
    return tmp_path / "ws"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_config_key_with_a_line_break_is_refused_naming_it(backend, tmp_path, ws):
    marker = tmp_path / "ran"
    res = _cli(tmp_path, BASE, "render", backend, "--job_dispatch_package", str(ws))
    assert res.exit_code == 0 and "#" in res.stdout, res.stderr  # the same config renders without the break
    for key in KEYS:  # every key: a string one gets the break, HOSTS and ENV in their entries, others a type error
        for brk in ("\n", "\r", "\0"):
            value = repr("/" + INJECTED.format(marker=marker).replace("\n", brk))
            conf = {**BASE, key: {"HOSTS": f"[{value}]", "ENV": f"{{'X': {value}}}"}.get(key, value)}
            _refused(_cli(tmp_path, conf, "render", backend, "--job_dispatch_package", str(ws)), key, marker)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_with_a_line_break_is_refused_naming_it(backend, tmp_path, ws):
    marker = tmp_path / "ran"
    bad = INJECTED.format(marker=marker)
    flags = ["--job_name", "--job_dispatch_package", "--job_workspace", "--entry"] + \
        [o.flag for o in run_options(backend) if o.kind is str]
    for flag in flags:
        where = [] if flag in ("--job_dispatch_package", "--job_workspace") else ["--job_dispatch_package", str(ws)]
        value = "--x=" + bad if flag == "--sbatch-arg" else "/" + bad
        _refused(_cli(tmp_path, BASE, "render", backend, *where, flag, value), flag, marker)
    res = _cli(tmp_path, BASE, "render", backend, "--job_dispatch_package", str(ws), "--", "--data", bad)
    _refused(res, "entry script's arguments", marker)
    res = _cli(tmp_path, BASE, "run", "--backend", backend, "--dry-run", "--resume_from", "/" + bad,
               "--job_dispatch_package", str(ws))
    _refused(res, "--resume_from", marker)
