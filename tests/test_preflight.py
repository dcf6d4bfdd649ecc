"""Finding 4: what a job needs is checked before anything is sent or started (local mode, real agent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import OMIT, assert_nothing_left, cli, no_traceback, write_conf
from rt_helpers import free_port_range

from paddle_cluster.launch.config import load_config
from paddle_cluster.launch.errors import HostError
from paddle_cluster.launch.plan import JobSpec
from paddle_cluster.launch.preflight import check_node, trainer_script

REPO = Path(__file__).resolve().parent.parent


def _conf(tmp: Path, **extra: str) -> Path:
    conf = tmp / "conf.py"
    conf.write_text(textwrap.dedent(f"""
        HOSTS = ["localhost"]
        ROOT_DIR = {str(tmp / "root")!r}
        PADDLE_NIC = "lo"
        PADDLE_PORT = {free_port_range(4)}
        PSERVERS_PER_NODE = 1
        TRAINERS_PER_NODE = 1
        PYTHON = {sys.executable!r}
        """) + "".join(f"{k} = {v!r}\n" for k, v in extra.items()))
    return conf


def _run(tmp: Path, conf: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"), XDG_CACHE_HOME=str(tmp / "cache"),
               PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", *args],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_missing_trainer_script_is_found_before_dispatch(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "trian.py").write_text("print('typo in the name')\n")
    res = _run(tmp_path, _conf(tmp_path), "--job_dispatch_package", str(ws), "--job_name", "nope")
    assert res.returncode == 2  # the entry script (ENTRY, --entry): launch/entry.py's check
    assert f"ENTRY = 'train.py' (the default; {tmp_path}/conf.py does not set ENTRY): no such file in the " \
        f"workspace {ws} (its scripts: trian.py)" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "root" / "nope").exists(), "nothing may be dispatched or started"


def test_missing_script_in_job_workspace_names_the_host(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    res = _run(tmp_path, _conf(tmp_path, TRAINER_COMMAND="{python} bin/train.py"), "--job_workspace", str(ws),
               "--job_name", "nope")
    assert res.returncode == 2  # the config names a file the workspace lacks: a configuration error
    assert f"node0 (localhost): {ws}/bin/train.py (the trainer command's script) does not exist there" in res.stderr
    assert not (tmp_path / "root" / "nope").exists()


def test_workspace_larger_than_the_free_space_is_refused(tmp_path):
    """Against a node's session answer: a workspace to send (``need``) must fit unpacked (it is unpacked as it
    arrives, no archive is kept) in ROOT_DIR's free space; one the node already holds is not sent. (test_faults
    fills a real disk.)"""
    cfg = load_config(str(_conf(tmp_path)))
    spec = JobSpec(cfg, "big", dispatch_dir=str(tmp_path))
    to_send = {"root": {"free_bytes": 900_000}, "workspace": {"need": "/x.fifo"}}
    with pytest.raises(HostError) as e:
        check_node("node0 (localhost)", spec, to_send, size=1_000_000)
    assert (f"node0 (localhost): ROOT_DIR {cfg.root_dir} has 0.9 MB free, the workspace needs 1.0 MB (unpacked); "
            "free space there or set ROOT_DIR to a larger disk") in str(e.value)
    check_node("node0 (localhost)", spec, {**to_send, "root": {"free_bytes": 1_000_000}}, size=1_000_000)
    check_node("node0 (localhost)", spec, {**to_send, "workspace": {"ok": True, "sent": False}}, size=1_000_000)


def test_trainer_script_of_a_command():
    assert trainer_script("python3 train.py") == "train.py"
    assert trainer_script("/usr/bin/python3 -u src/train.py --x 1") == "src/train.py"
    assert trainer_script("./run.sh") == "./run.sh"
    assert trainer_script("python3 -m mypkg.train") is None
    assert trainer_script("/opt/bin/train") is None


def _python_without_torch(tmp_path):
    """A venv without the system site-packages (so without torch and paddle), numpy linked in: an interpreter a
    node could have. Made with this test's interpreter, on the filesystem every test host shares."""
    import numpy

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = next(venv.glob("lib/python3*/site-packages"))
    src = os.path.dirname(numpy.__file__)
    for name in ("numpy", "numpy.libs"):
        if os.path.exists(os.path.join(os.path.dirname(src), name)):
            (site / name).symlink_to(os.path.join(os.path.dirname(src), name))
    return str(venv / "bin" / "python")


@pytest.mark.cluster
def test_a_node_whose_python_lacks_the_script_s_framework_is_named_before_anything_starts(cluster, tmp_path):
    """``run`` of a script importing torch, with PYTHON a venv without torch (pinned: the test's own interpreter
    has torch, and this is about one that lacks it): refused at the preflight, naming the host, the
    interpreter and PYTHON as the fix; nothing is sent or started."""
    python = _python_without_torch(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("import torch\nimport paddle_cluster.torch as pct\nprint(pct.rank())\n")
    conf = write_conf(tmp_path, cluster, PYTHON=python, PSERVER_COMMAND=OMIT)
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "notorch")
    assert res.returncode != 0, res.stdout
    no_traceback(res)
    line = next((ln for ln in res.stderr.splitlines() if "imports torch" in ln), res.stderr)
    assert f"({cluster.hosts[0]})" in line or "node0" in line, line
    says = f"train.py imports torch, which PYTHON there ({python}: {python}) cannot import; install it there " \
        f"({python} -m pip install torch==2.13.0) or set PYTHON in {conf} to an interpreter that has it"
    assert says in line, line
    check = cli(conf, "check", "--json")  # check says what that interpreter has of the frameworks, on every host
    rows = json.loads(check.stdout)
    hosts = [r for r in (rows if isinstance(rows, list) else rows.get("hosts", [])) if "frameworks" in r]
    assert len(hosts) == 3 and {r["frameworks"] for r in hosts} == {"torch -, paddle -"}, check.stdout
    sent = [p for i in range(3) for p in cluster.root_dir(i).rglob("train.py") if "notorch" in str(p)]
    assert not sent, sent  # refused before the workspace went anywhere
    assert_nothing_left(cluster)
