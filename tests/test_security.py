"""Security pass: the job secret stays private, job files are owner-only, pservers bind to PADDLE_NIC only,
``kill`` touches only the job's recorded processes, SSH never prompts; property-based fuzzing of the
wire decoder and handshake, and of config / env-file / contract loading (bounded case counts).

The live-wire checks (no request served before authentication, replayed answers refused) are in
test_security_wire.py; archive unpacking (absolute paths, ``..``, links out, huge members) in test_unpack.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from helpers import EVERY, Launch, assert_nothing_left, cli, conf, final_w, proc_pid, secret_holders, workspace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paddle_cluster import contract
from paddle_cluster.launch.backends import backend_of
from paddle_cluster.launch.config import KEYS, ClusterConfig, load_config
from paddle_cluster.launch.errors import ConfigError
from paddle_cluster.ps.errors import AuthError, ConnectionLost, ProtocolError
from paddle_cluster.ps.wire import auth as A
from paddle_cluster.ps.wire import protocol as P

SECRET = "5d4f9c2e7a1b8d3f60e5a9c7b2d4e8f1a3"  # as a job secret must be: not guessable (jobsecret.estimate)

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- on the cluster ------------------------------------------------------------------------------------


def _environ(pid: int) -> dict:
    """A running process's environment (we are root)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _files(top: Path):
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            yield Path(dirpath) / name


@pytest.mark.timeout(150)
def test_secret_files_binding_and_kill_scope(cluster, tmp_path):
    job = "sec1"
    cfg = conf(tmp_path, cluster, ENV={"STEP_DELAY": "0.05"})
    run = Launch(cfg, "--job_dispatch_package", str(workspace(tmp_path)), "--job_name", job, "--", "100000",
                 str(EVERY), "sync")
    decoy = None
    try:
        run.wait_line(r"checkpoint step=10", 60)
        assert not (cluster.root_dir(0) / job / ".paddle_cluster" / "env").exists()  # no file of the contract
        ps_env = _environ(proc_pid(cluster, 0, job, "pserver.0"))
        secret, job_id = ps_env["PADDLE_JOB_SECRET"], ps_env["PADDLE_JOB_ID"]
        assert len(secret) == 64
        # Each trainer holds only its own key: not the secret, not another trainer's.
        keys = []
        for t in range(3):
            tr_env = _environ(proc_pid(cluster, t, job, f"trainer.{t}"))
            assert "PADDLE_JOB_SECRET" not in tr_env
            assert tr_env["PADDLE_TRAINER_KEY"] == contract.derive_trainer_key(secret, job_id, t)
            keys.append(tr_env["PADDLE_TRAINER_KEY"])

        # ps: no command line carries it; another user cannot read the processes' environment.
        ps_all = subprocess.run(["ps", "-eo", "pid,args", "ww"], capture_output=True, text=True).stdout
        assert "paddle_cluster.ps" in ps_all and all(k not in ps_all for k in [secret, *keys])
        as_nobody = subprocess.run(["runuser", "-u", "nobody", "--", "ps", "auxeww"], capture_output=True,
                                   text=True)
        assert as_nobody.returncode == 0 and "train.py" in as_nobody.stdout
        assert all(k not in as_nobody.stdout for k in [secret, *keys])

        # Files: the job directory is owner-only; no file holds a key.
        for i in range(3):
            jd = cluster.root_dir(i) / job
            assert stat.S_IMODE(jd.stat().st_mode) == 0o700, oct(jd.stat().st_mode)
            assert stat.S_IMODE((jd / ".paddle_cluster").stat().st_mode) == 0o700
            assert stat.S_IMODE((jd / ".paddle_cluster" / "procs.json").stat().st_mode) == 0o600
            for f in _files(cluster.root_dir(i)):
                if f.is_file() and not f.is_symlink():
                    data = f.read_bytes()
                    assert not any(k.encode() in data for k in [secret, *keys]), f
            # Pservers listen on the node's PADDLE_NIC address only, not on every interface.
            listen = cluster.exec(i, ["ss", "-ltnH"]).stdout.split("\n")
            ours = [ln.split()[3] for ln in listen if ln.strip() and ln.split()[3].endswith(":7164")]
            assert ours == [f"{cluster.ips[i]}:7164"], ours

        # kill: only the processes recorded for this job, not one that merely looks like them.
        decoy = cluster.popen(1, [cluster.python, "-c", "import time; time.sleep(120)", "-m",
                                  "paddle_cluster.ps", job],
                              env=dict(os.environ, PADDLE_JOB_ID=job_id), start_new_session=True)
        pid = proc_pid(cluster, 1, job, "trainer.1")
        k = cli(cfg, "kill", "--job_name", job)
        assert k.returncode == 0, k.stderr
        assert run.finish(60) != 0
        assert not Path(f"/proc/{pid}").exists()
        assert decoy.poll() is None, "kill touched a process that is not recorded for the job"
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        if run.proc.poll() is None:
            run.proc.kill()
            run.finish(10)
    # The terminal and the launcher's own state never show the secret.
    assert secret not in run.stdout + run.stderr + k.stdout + k.stderr
    state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "paddle-cluster"
    for f in state.glob("*.json"):
        assert secret not in f.read_text()
    assert_nothing_left(cluster)
    # Nor is it in any file the job left on a node (while it ran, none held it: above).
    assert secret_holders([cluster.root_dir(i) for i in range(3)], [secret, *keys])[0] == []


@pytest.mark.timeout(60)
def test_ssh_never_prompts_for_a_password(cluster, tmp_path):
    key = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cfg = conf(tmp_path, cluster, SSH_IDENTITY_FILE=str(key))
    res = cli(cfg, "check", timeout=40)  # stdin is /dev/null: a prompt would hang or fail differently
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "login as root refused" in out and "passwords are never prompted for" in out, out
    assert "Traceback" not in out


@pytest.mark.timeout(150)
def test_restarted_job_keeps_its_secret_private(cluster, tmp_path):
    """A restart reuses the job's secret; it still never reaches the terminal."""
    job = "sec2"
    run = Launch(conf(tmp_path, cluster), "--job_dispatch_package", str(workspace(tmp_path)), "--job_name", job,
                 "--max_restarts", "1", "--", "40", str(EVERY), "sync")
    run.wait_line(r"checkpoint step=10", 60)
    secret = _environ(proc_pid(cluster, 0, job, "pserver.0"))["PADDLE_JOB_SECRET"]
    os.kill(proc_pid(cluster, 0, job, "trainer.0"), signal.SIGKILL)
    assert run.finish(120) == 0, run.text()[-2000:]
    assert final_w(run) == -20.0
    assert secret not in run.stdout + run.stderr
    for i in range(3):
        for f in (cluster.root_dir(i) / job / "log").iterdir():
            assert secret.encode() not in f.read_bytes(), f
    assert_nothing_left(cluster)


# -- wire decoder and handshake (pure, no pserver) -------------------------------------------------------


@FUZZ
@given(st.binary(min_size=P.HEADER_SIZE, max_size=P.HEADER_SIZE), st.integers(0, 1 << 40))
def test_fuzz_header_decoder(data, max_frame):
    try:
        h = P.unpack_header(data, max_frame)
    except ProtocolError:
        return
    assert h.length <= max_frame


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=12)


def _strict(name):
    raise ValueError(name)


@pytest.mark.parametrize("text", [b'{"lr": NaN}', b'{"lr": Infinity}', b'{"lr": [1, -Infinity]}'])
def test_json_decoder_refuses_nan_and_infinity(text):
    """Python's json reads NaN and Infinity; the protocol never writes them, so a frame carrying one is refused."""
    with pytest.raises(ProtocolError, match="is not JSON"):
        P.decode_json(text)


@FUZZ
@given(st.one_of(st.binary(max_size=2048), _json.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.text(max_size=10), _json, max_size=4).map(P.encode_json)))
def test_fuzz_json_decoder(data):
    """Exactly the UTF-8 JSON objects are accepted, with the values json reads; anything else is a ProtocolError."""
    try:
        expected = json.loads(data.decode("utf-8"), parse_constant=_strict)
    except ValueError:  # UnicodeDecodeError included
        expected = None
    if isinstance(expected, dict):
        assert P.decode_json(data) == expected  # for encode_json's output: the object that was encoded
    else:
        with pytest.raises(ProtocolError):
            P.decode_json(data)


def _valid_response_prefix():
    return P.pack_header(P.Op.AUTH_RESPONSE, P.DTYPE_NONE, trainer=0, length=A.MAC_SIZE + A.NONCE_SIZE)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.binary(max_size=A.MAC_SIZE + A.NONCE_SIZE).map(
    lambda b: _valid_response_prefix() + b)))
def test_fuzz_server_handshake_refuses_anything_forged(data):
    """Whatever an unauthenticated peer sends, the handshake ends in a refusal, never a trainer id."""
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    try:
        t = threading.Thread(target=lambda: (b.recv(P.HEADER_SIZE + A.NONCE_SIZE), b.sendall(data),
                                             b.shutdown(socket.SHUT_WR)), daemon=True)
        t.start()
        with pytest.raises((AuthError, ProtocolError, ConnectionLost, OSError)):
            A.server_handshake(a, lambda t: contract.derive_trainer_key(SECRET, "job-1", t), "job-1", 0, 4, True,
                               timeout=2.0)
        t.join(5)
        assert not t.is_alive()
    finally:
        a.close()
        b.close()


# -- config loading ------------------------------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                       max_leaves=10)
_hosts = st.one_of(_values, st.lists(st.one_of(st.sampled_from(["localhost", "root@10.0.0.1", "a@b:22", "h:0",
                                                                 "x@[::1]:2222", "@", "a b"]),
                                               st.text(max_size=20)), max_size=4))


def _load_in_sandbox(name: str, text: str) -> None:
    """Load ``text`` as config file ``name``; only a ClusterConfig or a ConfigError may come out, and
    nothing may be written next to it."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        before = sorted(os.listdir(d))
        try:
            cfg = load_config(str(path), environ={})
            assert isinstance(cfg, ClusterConfig) and os.path.isabs(cfg.root_dir)
            # HOSTS is the backend's to require (ssh and mpi do; slurm and k8s give the nodes).
            assert backend_of(cfg).name == cfg.backend
        except ConfigError as e:
            # One message naming the key, this file and the fix: "KEY = value in FILE: fix" or "KEY is not set";
            # an error of the file as a whole (syntax, shape, owner) names the file alone: "FILE: fix".
            msg = str(e)
            assert e.fix and msg.endswith(e.fix), msg
            if e.value == str(path):
                assert msg == f"{path}: {e.fix}", msg
            else:
                assert msg.startswith((f"{e.key} = ", f"{e.key} is not set")), msg
                assert f" in {path}: " in msg, msg
        assert sorted(os.listdir(d)) == before


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.from_regex(r"[A-Z][A-Z_]{0,12}", fullmatch=True)),
                       _values, max_size=8), _hosts)
def test_fuzz_conf_py_values(settings_, hosts):
    body = {"HOSTS": hosts, **settings_}
    _load_in_sandbox("conf.py", "".join(f"{k} = {v!r}\n" for k, v in body.items()))


@FUZZ
@given(st.one_of(st.text(max_size=300),
                 st.dictionaries(st.sampled_from(KEYS).map(str.lower), _values, max_size=8).map(json.dumps)))
def test_fuzz_cluster_yaml(text):
    _load_in_sandbox("cluster.yaml", text)


# The launcher's three forms of one job's environment, to drop variables from and change values in.
_JOB = contract.JobEnv("job-1", (contract.Endpoint("10.0.0.1", 7164), contract.Endpoint("10.0.0.2", 7164)), 3,
                       ports_num=2, ports_num_for_sparse=1, secret=SECRET, job_dir="/j", workspace="/j/ws",
                       barrier_timeout=30.0)
_FORMS = [_JOB.to_environ(), _JOB.for_process(contract.PSERVER, 1, "10.0.0.2").to_environ(),
          _JOB.for_process(contract.TRAINER, 2, "10.0.0.1").to_environ()]
_NAMES = st.sampled_from(sorted({k for f in _FORMS for k in f}))
_VALUES = st.one_of(st.sampled_from(sorted({v for f in _FORMS for v in f.values()}
                                           | {"", "0", "-1", "nan", "10.0.0.1", "10.0.0.3:1"})), st.text(max_size=30))


@FUZZ
@given(st.sampled_from(_FORMS), st.sets(_NAMES), st.dictionaries(_NAMES, _VALUES, max_size=4))
def test_fuzz_contract_from_environ(form, drop, changes):
    """Whatever a process finds in its environment: not launched (no pserver list), a refusal naming a PADDLE_
    variable, or a JobEnv that writes out and reads back as itself (less the secrets its role must not get)."""
    environ = {k: v for k, v in form.items() if k not in drop}
    environ.update(changes)
    try:
        env = contract.JobEnv.from_environ(environ)
    except contract.ContractError as e:
        assert re.search(r"\bPADDLE_[A-Z_]+", str(e)), e
        return
    if env is None:
        assert not any(environ.get(k) for k in ("PADDLE_PSERVER_ENDPOINTS", "PADDLE_PSERVER_IPS",
                                                "PADDLE_INIT_PSERVERS")), environ
    else:
        # Written out, it reads back as itself, but for what a process of that role must not see: the job
        # secret goes to pservers only, a trainer key to its trainer only.
        out = env.to_environ()
        assert ("PADDLE_JOB_SECRET" in out) == (env.role == contract.PSERVER and bool(env.secret))
        assert ("PADDLE_TRAINER_KEY" in out) == (env.role == contract.TRAINER and bool(env.trainer_key))
        assert contract.JobEnv.from_environ(out) == dataclasses.replace(
            env, secret=env.secret if env.role == contract.PSERVER else "",
            trainer_key=env.trainer_key if env.role == contract.TRAINER else "")


# -- archive unpacking: member and total sizes (names and links: test_unpack.py) -------------------------


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "d/c", "d/e/f"]), st.integers(0, 3000)), min_size=1,
                max_size=5, unique_by=lambda m: m[0]), st.integers(0, 6000))
def test_fuzz_unpack_sizes_are_capped(members, cap):
    import io
    import tarfile

    from paddle_cluster.node.unpack import UnsafeArchive, safe_extract

    with tempfile.TemporaryDirectory() as top:
        archive, dest = os.path.join(top, "a.tar"), os.path.join(top, "job")
        with tarfile.open(archive, "w") as tar:
            for name, size in members:
                info = tarfile.TarInfo(name)
                info.size = size
                tar.addfile(info, io.BytesIO(b"x" * size))
        too_big = any(s > cap for _, s in members) or sum(s for _, s in members) > cap
        try:
            safe_extract(archive, dest, max_bytes=cap)
        except UnsafeArchive as e:
            assert too_big, e
            assert not os.path.exists(dest)
        else:
            assert not too_big
            for name, size in members:
                assert os.path.getsize(os.path.join(dest, name)) == size
        assert sorted(os.listdir(top)) == sorted(["a.tar"] + (["job"] if not too_big else []))
