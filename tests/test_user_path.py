"""A new user's path with bad input, as README.md and docs/ describe it: each mistake ends in one line naming what
is wrong, where it came from and the fix, exits non-zero (2 for a configuration error) and leaves nothing running.
The conf.py is the README's (HOSTS, ROOT_DIR, PADDLE_NIC) on this machine alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIT_A_LINE, checkout_env, cli, start_cli, wait_for, write_settings

WS = str(FIT_A_LINE)


def _conf(tmp: Path, **over) -> Path:
    # PYTHON is pinned to this interpreter (it has numpy) unless a test is about PYTHON itself.
    return write_settings(tmp / "conf.py", {"HOSTS": ["localhost"], "ROOT_DIR": str(tmp / "root"),
                                            "PADDLE_NIC": "lo", "PYTHON": sys.executable, **over})


def _one_error(res, *parts: str, code: int = 2) -> None:
    """``res`` failed with ``code`` (2: a configuration error), one message line holding every part, and no
    traceback."""
    out = res.stdout + res.stderr
    assert res.returncode == code, out
    assert "Traceback" not in out and 'File "' not in out, out
    assert any(all(p in line for p in parts) for line in out.splitlines()), out


def test_root_dir_that_cannot_be_made_is_named(tmp_path):
    """ROOT_DIR under /proc (nothing can be created there, not even by root): once a bare Python traceback."""
    conf = _conf(tmp_path, ROOT_DIR="/proc/paddle-nope")
    res = cli(conf, "run", "--job_dispatch_package", WS)
    _one_error(res, "node0 (localhost): ROOT_DIR = '/proc/paddle-nope' in", str(conf), "cannot create",
               "set ROOT_DIR to")
    check = cli(conf, "check")
    assert check.returncode == 1 and "ROOT_DIR = '/proc/paddle-nope'" in check.stdout + check.stderr


def test_python_that_does_not_exist_is_named(tmp_path):
    conf = _conf(tmp_path, PYTHON="/usr/bin/paddle-nope")
    res = cli(conf, "run", "--job_dispatch_package", WS)
    _one_error(res, "node0 (localhost): PYTHON = '/usr/bin/paddle-nope' in", str(conf), "set PYTHON to")


def test_python_that_is_not_a_python_is_named(tmp_path):
    """An interpreter that starts but runs no session (here /bin/true): once 'the session ended without an
    answer', naming nothing."""
    conf = _conf(tmp_path, PYTHON="/bin/true")
    res = cli(conf, "run", "--job_dispatch_package", WS)
    _one_error(res, "PYTHON = '/bin/true' in", "did not run the node session there", "set PYTHON to")


def test_kill_of_a_job_no_node_knows_is_an_error(tmp_path):
    """A mistyped --job_name: once 'nothing was running ... nothing stopped' and exit 0, as if all were well."""
    conf = _conf(tmp_path)
    res = cli(conf, "kill", "--job_name", "JOB-typo")
    _one_error(res, "job JOB-typo: no node has a record of it", str(tmp_path / "root" / "JOB-typo"),
               "check the job name", code=1)


def test_logs_f_of_a_job_no_node_knows_is_an_error(tmp_path):
    """`logs node0 -f --job_name JOB-typo`: once 'no log directory ...' on stdout and exit 0."""
    res = cli(_conf(tmp_path), "logs", "node0", "-f", "--job_name", "JOB-typo")
    _one_error(res, "node0 (localhost): no log directory", "(job JOB-typo); check the job name", code=1)


def test_a_conf_py_that_is_not_python_is_named_by_its_path(tmp_path):
    """The README's conf.py with its list left open, read from the current directory: once
    'conf.py = 'conf.py' in conf.py: syntax error ...', a key that is no key."""
    (tmp_path / "conf.py").write_text('HOSTS = ["localhost"\nROOT_DIR = "/tmp"\n')
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "check"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env=checkout_env(), stdin=subprocess.DEVNULL)
    _one_error(res, f"error: {tmp_path / 'conf.py'}: syntax error at line 1: ", "the file is Python")
    assert "conf.py = " not in res.stderr, res.stderr


def test_ctrl_c_while_the_nodes_are_prepared_is_an_interrupt(tmp_path):
    """Ctrl+C while run waits for the nodes' probes: once recorded as node0's failure ('unexpected error:
    KeyboardInterrupt', exit 1). PYTHON is a wrapper that holds the first node session until the test has sent
    SIGINT (two FIFOs: no sleep, no timing); every later start runs the interpreter at once."""
    probing, go, once = tmp_path / "probing", tmp_path / "go", tmp_path / "once"
    os.mkfifo(probing)
    os.mkfifo(go)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nif mkdir {once} 2>/dev/null; then echo > {probing}; read _ < {go}; fi\n"
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc = start_cli(_conf(tmp_path, PYTHON=str(wrapper)), "run", "--job_dispatch_package", WS)
    try:
        with open(probing) as f:  # the node session has started and waits
            f.read()
        proc.send_signal(signal.SIGINT)
        with open(go, "w") as f:
            f.write("\n")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "unexpected error" not in err and "Traceback" not in err, err
    wait_for(lambda: not _running_under(tmp_path), 10, f"no process left under {tmp_path}")


def _running_under(path: Path) -> list:
    """Processes whose command line names ``path`` (the node session's names ROOT_DIR, a job's its job dir)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(path) in (d / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(d.name))
        except OSError:
            pass
    return found



def test_ctrl_c_while_the_cli_starts_is_an_interrupt():
    """Ctrl+C in the first tenths of a second, while the CLI's modules load: once a traceback of the import. The
    SIGINT is sent when click is imported (a real signal to the process, at a moment that does not depend on
    load)."""
    trigger = ("import builtins, os, signal\n"
               "real = builtins.__import__\n"
               "def hook(name, *a, **k):\n"
               "    if name == 'click':\n"
               "        builtins.__import__ = real\n"
               "        os.kill(os.getpid(), signal.SIGINT)\n"
               "    return real(name, *a, **k)\n"
               "builtins.__import__ = hook\n"
               "from paddle_cluster.__main__ import entry\n"
               "entry()\n")
    res = subprocess.run([sys.executable, "-c", trigger, "status"], capture_output=True, text=True, timeout=60,
                         env=checkout_env(), stdin=subprocess.DEVNULL)
    assert res.returncode == 130 and res.stderr == "paddle-cluster: interrupted\n", res.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH (scripts/test installs it)")
def test_run_on_k8s_with_a_context_that_does_not_answer_says_the_fix(tmp_path):
    """`run --backend k8s` whose kubeconfig names a server that is not there: once kubectl's refusal alone (check
    said the fix, run did not). The kubeconfig is the user's: one cluster, one context."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]"
                          "\ncontexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n"
                          "users: [{name: u, user: {token: t}}]\n")
    res = cli(_conf(tmp_path), "run", "--backend", "k8s", "--image", "registry.example/ml/fit:1",
              "--job_dispatch_package", WS, env={"KUBECONFIG": str(kubeconfig)})
    _one_error(res, "--backend k8s: kubectl's current context did not answer", "point kubectl at your cluster",
               code=1)


def test_plot_of_a_job_no_node_knows_says_to_check_the_name(tmp_path):
    """`plot --job_name JOB-typo`: once only 'trainers write them with MetricsWriter', as if the job had run."""
    res = cli(_conf(tmp_path), "plot", "--job_name", "JOB-typo")
    _one_error(res, "job JOB-typo has no metrics records", "check the job name", code=1)


def test_slurm_commands_on_a_job_name_that_is_not_there_say_to_check_it(tmp_path):
    """BACKEND = 'slurm' (docs/backends.md's conf.py) and a mistyped --job_name: once 'no Slurm job recorded ... is
    ROOT_DIR the shared filesystem?' (status, kill), 'unknown node node0 ... none yet' (logs), 'no metrics records
    ... MetricsWriter' (plot). Nothing here reaches Slurm."""
    conf = write_settings(tmp_path / "conf.py", {"BACKEND": "slurm", "ROOT_DIR": str(tmp_path / "root"),
                                                 "PADDLE_NIC": "eth0"})
    for args in (["status"], ["kill"], ["logs", "node0"], ["plot"]):
        res = cli(conf, *args, "--job_name", "JOB-typo")
        _one_error(res, f"job JOB-typo: no {tmp_path / 'root' / 'JOB-typo'}; check the job name", code=1)


def test_a_relative_job_workspace_is_refused_before_anything_starts(tmp_path):
    """Each node would resolve a relative --job_workspace from its own working directory: once reported only
    as 'no such directory there' by whichever node looked first."""
    conf = _conf(tmp_path)
    res = cli(conf, "run", "--job_workspace", "ws")
    _one_error(res, "--job_workspace ws:", "absolute", "--job_dispatch_package")
    assert not (tmp_path / "root").exists()  # refused on this machine: no node was reached
