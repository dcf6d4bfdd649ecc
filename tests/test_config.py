"""Configuration: every bad conf.py / cluster.yaml gets a ConfigError naming the key, the value and the fix,
through ``load_config`` and through the real CLI (exit code 2, no traceback)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import checkout_env, free_port_range

from paddle_cluster.launch.backends import REGISTRY, backend_of, declared_conf_keys
from paddle_cluster.launch.config import (
    BUILTIN_SOURCE,
    KEYS,
    ClusterConfig,
    HostSpec,
    load_config,
    parse_config,
)
from paddle_cluster.launch.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
HOSTS_LINE = 'HOSTS = ["root@192.168.100.17", "root@192.168.100.18"]\n'
BACKEND_KEYS = declared_conf_keys()  # MPI_IMPL, K8S_NAMESPACE...: the CLI hands them to the configuration
ALL_KEYS = KEYS + tuple(k.name for k in BACKEND_KEYS)


def load(path: str) -> ClusterConfig:
    """``path`` read as the CLI reads it: the backends' keys known too."""
    return load_config(path, environ={}, keys=BACKEND_KEYS)


def cli(*args: str, cwd=None, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=cwd, env=checkout_env(env),
                          capture_output=True, text=True, timeout=timeout)


def assert_clean_config_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    assert "paddle-cluster: error:" in res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)




# -- bad values: (id, conf.py body, substrings the message must contain: key, value, fix) ---------------
BAD = [
    ("missing-hosts", 'ROOT_DIR = "/home/paddle"\n', ["HOSTS", "is not set", 'HOSTS = ["root@']),
    ("hosts-string", 'HOSTS = "root@10.0.0.1"\n', ["HOSTS", "'root@10.0.0.1'", "non-empty list"]),
    ("hosts-empty", "HOSTS = []\n", ["HOSTS", "[]", "non-empty list"]),
    ("hosts-dict", 'HOSTS = {"a": 1}\n', ["HOSTS", "{'a': 1}", "non-empty list"]),
    ("host-double-at", 'HOSTS = ["root@@x"]\n', ["HOSTS", "'root@@x'", '"user@host:port"']),
    ("host-port-range", 'HOSTS = ["host:99999"]\n', ["HOSTS", "'host:99999'", "between 1 and 65535"]),
    ("host-port-zero", 'HOSTS = ["host:0"]\n', ["HOSTS", "'host:0'", "between 1 and 65535"]),
    ("host-space", 'HOSTS = ["root@my host"]\n', ["HOSTS", "'root@my host'", "cannot parse"]),
    ("host-not-string", "HOSTS = [42]\n", ["HOSTS", "42", "must be a string"]),
    ("host-twice", 'HOSTS = ["root@10.0.0.1", "paddle@10.0.0.1"]\n',
     ["HOSTS", "'paddle@10.0.0.1'", "'root@10.0.0.1'", "overlap", "PSERVERS_PER_NODE"]),
    ("host-twice-case", 'HOSTS = ["Node1", "node1"]\n', ["HOSTS", "'node1'", "overlap"]),
    ("port-privileged", HOSTS_LINE + "PADDLE_PORT = 80\n", ["PADDLE_PORT", "80", "1024..65535", "7164"]),
    ("port-negative", HOSTS_LINE + "PADDLE_PORT = -1\n", ["PADDLE_PORT", "-1", "1024..65535"]),
    ("port-too-big", HOSTS_LINE + "PADDLE_PORT = 70000\n", ["PADDLE_PORT", "70000", "1024..65535"]),
    ("ports-past-65535", HOSTS_LINE + "PADDLE_PORT = 65534\n",
     ["PADDLE_PORT", "65534", "65534..65539", "1024..65535"]),
    ("ports-past-65535-per-node", HOSTS_LINE + "PADDLE_PORT = 65000\nPSERVERS_PER_NODE = 200\n",
     ["PADDLE_PORT", "65000", "65000..65801"]),
    ("ports-num-zero", HOSTS_LINE + "PADDLE_PORTS_NUM = 0\n", ["PADDLE_PORTS_NUM", "0", "at least 1"]),
    ("sparse-negative", HOSTS_LINE + "PADDLE_PORTS_NUM_FOR_SPARSE = -1\n",
     ["PADDLE_PORTS_NUM_FOR_SPARSE", "-1", "0 or more"]),
    ("relative-root", HOSTS_LINE + 'ROOT_DIR = "paddle/jobs"\n', ["ROOT_DIR", "'paddle/jobs'", "absolute path"]),
    ("tilde-root", HOSTS_LINE + 'ROOT_DIR = "~/jobs"\n', ["ROOT_DIR", "'~/jobs'", "absolute path"]),
    ("port-string", HOSTS_LINE + 'PADDLE_PORT = "seven"\n', ["PADDLE_PORT", "'seven'", "whole number"]),
    ("port-bool", HOSTS_LINE + "PADDLE_PORT = True\n", ["PADDLE_PORT", "True", "whole number"]),
    ("port-float", HOSTS_LINE + "PADDLE_PORT = 7164.5\n", ["PADDLE_PORT", "7164.5", "whole number"]),
    ("port-superscript", HOSTS_LINE + 'PADDLE_PORT = "\u00b2"\n', ["PADDLE_PORT", "whole number"]),
    ("ports-num-none", HOSTS_LINE + "PADDLE_PORTS_NUM = None\n", ["PADDLE_PORTS_NUM", "None", "whole number"]),
    ("nic-number", HOSTS_LINE + "PADDLE_NIC = 0\n", ["PADDLE_NIC", "0", "must be a string"]),
    ("nic-shell", HOSTS_LINE + 'PADDLE_NIC = "eth0; reboot"\n', ["PADDLE_NIC", "'eth0; reboot'", "eth0"]),
    ("bool-string", HOSTS_LINE + 'SSH_ACCEPT_NEW_HOST_KEYS = "yes"\n',
     ["SSH_ACCEPT_NEW_HOST_KEYS", "'yes'", "True or False"]),
    ("bool-int", HOSTS_LINE + "SSH_ACCEPT_NEW_HOST_KEYS = 1\n", ["SSH_ACCEPT_NEW_HOST_KEYS", "1", "True or False"]),
    ("timeout-negative", HOSTS_LINE + "START_TIMEOUT = -1\n", ["START_TIMEOUT", "-1", "positive number"]),
    ("timeout-string", HOSTS_LINE + 'SSH_CONNECT_TIMEOUT = "10"\n',
     ["SSH_CONNECT_TIMEOUT", "'10'", "positive number"]),
    ("timeout-bool", HOSTS_LINE + "KILL_GRACE = True\n", ["KILL_GRACE", "True", "positive number"]),
    ("timeout-nan", HOSTS_LINE + 'BARRIER_TIMEOUT = float("nan")\n', ["BARRIER_TIMEOUT", "nan", "positive number"]),
    ("identity-number", HOSTS_LINE + "SSH_IDENTITY_FILE = 5\n", ["SSH_IDENTITY_FILE", "5", "must be a string"]),
    ("identity-missing", HOSTS_LINE + 'SSH_IDENTITY_FILE = "/nonexistent/id_rsa"\n',
     ["SSH_IDENTITY_FILE", "'/nonexistent/id_rsa'", "no such file"]),
    ("ssh-config-missing", HOSTS_LINE + 'SSH_CONFIG_FILE = "/nonexistent/ssh_config"\n',
     ["SSH_CONFIG_FILE", "'/nonexistent/ssh_config'", "no such file"]),
    ("env-list", HOSTS_LINE + 'ENV = ["A=1"]\n', ["ENV", "['A=1']", "mapping"]),
    ("env-bad-name", HOSTS_LINE + 'ENV = {"A=B": "1"}\n', ["ENV", "'A=B'", "not a variable name"]),
    ("env-reserved", HOSTS_LINE + 'ENV = {"PADDLE_TRAINERS": "5"}\n',
     ["ENV", "PADDLE_TRAINERS is set by paddle-cluster for every pserver and trainer", "remove it"]),
    # The reason names the processes that truly get the variable.
    ("env-reserved-pserver", HOSTS_LINE + 'ENV = {"POD_IP": "10.0.0.9"}\n',
     ["ENV", "POD_IP is set by paddle-cluster for each pserver", "remove it"]),
    ("env-reserved-trainer", HOSTS_LINE + 'ENV = {"RANK": "0"}\n',
     ["ENV", "RANK is set by paddle-cluster for each trainer"]),
    # ENV reaches every process: a trainer would hold the job secret; INTEGRITY is the config's key.
    ("env-secret", HOSTS_LINE + 'ENV = {"PADDLE_JOB_SECRET": "a" * 64}\n',
     ["ENV", "PADDLE_JOB_SECRET is set by paddle-cluster for each pserver"]),
    ("env-trainer-key", HOSTS_LINE + 'ENV = {"PADDLE_TRAINER_KEY": "a" * 64}\n',
     ["ENV", "PADDLE_TRAINER_KEY is set by paddle-cluster for each trainer"]),
    ("env-integrity", HOSTS_LINE + 'ENV = {"PADDLE_INTEGRITY": "0"}\n',
     ["ENV", "PADDLE_INTEGRITY", "INTEGRITY = False sets it"]),
    ("env-newline", HOSTS_LINE + 'ENV = {"A": "x\\ny"}\n', ["ENV", "'A'", "newline"]),
    ("command-placeholder", HOSTS_LINE + 'TRAINER_COMMAND = "{python} train.py {epochs}"\n',
     ["TRAINER_COMMAND", "'{python} train.py {epochs}'", "epochs", "{python}", "{{"]),
    ("command-brace", HOSTS_LINE + 'PSERVER_COMMAND = "{python} -c \'{\'"\n', ["PSERVER_COMMAND", "{{"]),
    ("command-attribute", HOSTS_LINE + 'PSERVER_COMMAND = "{python.x}"\n', ["PSERVER_COMMAND", "{python.x}"]),
    ("collective-pserver-command", HOSTS_LINE + 'PSERVERS_PER_NODE = 0\nPSERVER_COMMAND = "{python} -m x"\n',
     ["PSERVER_COMMAND", "PSERVERS_PER_NODE = 0", "runs no pserver program"]),
    ("collective-env-master", HOSTS_LINE + 'PSERVERS_PER_NODE = 0\nENV = {"MASTER_PORT": "1"}\n',
     ["ENV", "MASTER_PORT is set by paddle-cluster"]),
    ("no-trainers", HOSTS_LINE + "TRAINERS_PER_NODE = 0\n", ["TRAINERS_PER_NODE", "0", "at least one trainer"]),
    ("syntax-error", HOSTS_LINE + "# a comment\nPADDLE_PORT = = 7164\n", ["conf.py", "syntax error", "line 3"]),
    ("unclosed-list", 'HOSTS = [\n  "root@10.0.0.1",\n\nROOT_DIR = "/x"\n', ["conf.py", "syntax error", "line 1"]),
    ("raises", HOSTS_LINE + 'PADDLE_PORT = int("x")\n', ["conf.py", "raised ValueError", "invalid literal"]),
    ("raises-name", HOSTS_LINE + "PADDLE_PORT = BASE + 1\n", ["conf.py", "raised NameError", "BASE"]),
    ("sys-exit", "import sys\nsys.exit(3)\n", ["conf.py", "SystemExit"]),
    ("backend-unknown", HOSTS_LINE + 'BACKEND = "kube"\n', ["BACKEND", "'kube'", "ssh, mpi, slurm, k8s"]),
    ("mpi-impl-unknown", HOSTS_LINE + 'MPI_IMPL = "mvapich"\n', ["MPI_IMPL", "'mvapich'", "auto, openmpi, mpich"]),
]


def write(tmp_path: Path, body, name: str = "conf.py") -> Path:
    p = tmp_path / name
    if isinstance(body, bytes):
        p.write_bytes(body)
    else:
        p.write_text(body, encoding="utf-8")
    return p


# Found once the backend is known (``--backend`` may choose one that needs no HOSTS), not by reading the file.
BY_BACKEND = {"missing-hosts"}


@pytest.mark.parametrize("body, needles", [c[1:] for c in BAD if c[0] not in BY_BACKEND],
                         ids=[c[0] for c in BAD if c[0] not in BY_BACKEND])
def test_bad_conf_load_config(tmp_path, body, needles):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as ei:
        load(str(path))
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert str(path) in msg  # where the problem is
    assert ei.value.fix and ei.value.key


@pytest.fixture(scope="module")
def bad_cli_results(tmp_path_factory) -> dict:
    """``paddle-cluster --conf FILE check`` for every BAD case, run a few at a time (each is ~0.5 s of imports)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("bad_cli")

    def one(case) -> subprocess.CompletedProcess:
        d = root / case[0]
        d.mkdir()
        return cli("--conf", str(write(d, case[1])), "check")

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip([c[0] for c in BAD], pool.map(one, BAD)))


@pytest.mark.parametrize("case", [c[0] for c in BAD])
def test_bad_conf_cli_check(bad_cli_results, case):
    needles = next(c[2] for c in BAD if c[0] == case)
    assert_clean_config_error(bad_cli_results[case], *needles)


@pytest.mark.parametrize("case", ["missing-hosts", "relative-root", "ports-num-zero", "syntax-error"])
def test_bad_conf_cli_run_starts_nothing(tmp_path, case):
    body, needles = next(c[1:] for c in BAD if c[0] == case)
    path = write(tmp_path, body)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('hi')\n")
    res = cli("--conf", str(path), "run", "--job_dispatch_package", str(ws))
    assert_clean_config_error(res, *needles)
    assert not (tmp_path / "ws" / "log").exists()


def test_non_utf8_conf(tmp_path):
    path = write(tmp_path, b'HOSTS = ["\xff\xfe"]\n')
    with pytest.raises(ConfigError, match="UTF-8"):
        load(str(path))
    assert_clean_config_error(cli("--conf", str(path), "check"), "conf.py", "UTF-8")


def test_nul_byte_conf(tmp_path):
    path = write(tmp_path, b'HOSTS = ["a"]\x00\n')
    with pytest.raises(ConfigError, match="syntax error"):
        load(str(path))
    assert_clean_config_error(cli("--conf", str(path), "check"), "conf.py", "null bytes")


# -- YAML ----------------------------------------------------------------------------------------------
FULL_PY = '''HOSTS = ["root@192.168.100.17", "paddle@node2:2222", "gpu-box"]
ROOT_DIR = "/data/paddle"
PADDLE_NIC = "ib0"
PADDLE_PORT = 9000
PADDLE_PORTS_NUM = 4
PADDLE_PORTS_NUM_FOR_SPARSE = 0
LD_LIBRARY_PATH = "/usr/local/cuda/lib64:/usr/lib64"
PSERVERS_PER_NODE = 2
TRAINERS_PER_NODE = 3
PYTHON = "/opt/py/bin/python3"
PSERVER_COMMAND = "{python} -m paddle_cluster.ps --fast"
TRAINER_COMMAND = "{python} train.py --epochs 2"
ENTRY = "dist_train.py"
ENV = {"OMP_NUM_THREADS": "1", "SEED": 7}
SSH_IDENTITY_FILE = "~/.ssh/id_ed25519"
SSH_CONFIG_FILE = "~/.ssh/config"
SSH_KNOWN_HOSTS = "~/.ssh/known_hosts_cluster"
SSH_ACCEPT_NEW_HOST_KEYS = True
SSH_CONNECT_TIMEOUT = 3
START_TIMEOUT = 30.5
BARRIER_TIMEOUT = 600
ORPHAN_TIMEOUT = 15
KILL_GRACE = 2
MAX_RESTARTS = 3
BACKEND = "k8s"
MPI_IMPL = "mpich"
K8S_IMAGE = "registry.example/ml/fit:1"
K8S_NAMESPACE = "ml"
K8S_PSERVER_REQUESTS = "cpu=2"
K8S_TRAINER_REQUESTS = "cpu=4,nvidia.com/gpu=1"
INTEGRITY = False
'''

FULL_YAML = '''# the same settings as FULL_PY
HOSTS:
  - root@192.168.100.17
  - paddle@node2:2222
  - gpu-box
root_dir: /data/paddle          # keys may be lower case in YAML
PADDLE_NIC: ib0
PADDLE_PORT: 9000
PADDLE_PORTS_NUM: 4
PADDLE_PORTS_NUM_FOR_SPARSE: 0
LD_LIBRARY_PATH: /usr/local/cuda/lib64:/usr/lib64
PSERVERS_PER_NODE: 2
TRAINERS_PER_NODE: 3
PYTHON: /opt/py/bin/python3
PSERVER_COMMAND: "{python} -m paddle_cluster.ps --fast"
TRAINER_COMMAND: "{python} train.py --epochs 2"
ENTRY: dist_train.py
ENV:
  OMP_NUM_THREADS: "1"
  SEED: 7
SSH_IDENTITY_FILE: ~/.ssh/id_ed25519
SSH_CONFIG_FILE: ~/.ssh/config
SSH_KNOWN_HOSTS: ~/.ssh/known_hosts_cluster
SSH_ACCEPT_NEW_HOST_KEYS: true
SSH_CONNECT_TIMEOUT: 3
START_TIMEOUT: 30.5
BARRIER_TIMEOUT: 600
ORPHAN_TIMEOUT: 15
KILL_GRACE: 2
MAX_RESTARTS: 3
BACKEND: k8s
MPI_IMPL: mpich
K8S_IMAGE: registry.example/ml/fit:1
K8S_NAMESPACE: ml
K8S_PSERVER_REQUESTS: cpu=2
K8S_TRAINER_REQUESTS: cpu=4,nvidia.com/gpu=1
INTEGRITY: false
'''


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A scratch $HOME with the SSH files FULL_PY names (they must exist on the launching machine)."""
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    (h / ".ssh" / "id_ed25519").write_text("key\n")
    (h / ".ssh" / "config").write_text("Host gpu-box\n  HostName 10.0.0.9\n")
    monkeypatch.setenv("HOME", str(h))
    return h


def same(a: ClusterConfig, b: ClusterConfig) -> bool:
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def test_full_conf_sets_every_key(tmp_path, home):
    cfg = load(str(write(tmp_path, FULL_PY)))
    default = ClusterConfig(hosts=())
    for key in KEYS:  # the file set every key: ClusterConfig's and the backends' (MPI_IMPL, K8S_NAMESPACE...)
        assert getattr(cfg, key.lower()) != getattr(default, key.lower()), key
    for conf_key in BACKEND_KEYS:
        assert conf_key.of(cfg) != conf_key.default, conf_key.name
    assert cfg.file_keys == set(ALL_KEYS) and cfg.options == ()
    assert cfg.hosts == (HostSpec("root@192.168.100.17", "192.168.100.17", "root", None),
                         HostSpec("paddle@node2:2222", "node2", "paddle", 2222),
                         HostSpec("gpu-box", "gpu-box", None, None))
    assert cfg.env == {"OMP_NUM_THREADS": "1", "SEED": "7"}
    assert cfg.node_ports() == tuple(range(9000, 9008))
    # "~" in the SSH paths means the launching user's home
    assert cfg.ssh_identity_file == str(home / ".ssh" / "id_ed25519")
    assert cfg.ssh_config_file == str(home / ".ssh" / "config")
    assert cfg.ssh_known_hosts == str(home / ".ssh" / "known_hosts_cluster")  # may not exist yet
    assert cfg.source == str(tmp_path / "conf.py")


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.yml"])
def test_yaml_equals_conf_py(tmp_path, home, name):
    py = load(str(write(tmp_path, FULL_PY)))
    ym = load(str(write(tmp_path, FULL_YAML, name)))
    assert same(py, ym)
    assert ym.source.endswith(name)


BAD_YAML = [
    ("syntax", "HOSTS: [a]\nPADDLE_PORT: [1, 2\nROOT_DIR: /x\n", ["YAML", "cannot parse", "line 3"]),
    ("indent", "HOSTS:\n  - a\n PADDLE_PORT: 1\n", ["YAML", "cannot parse", "line 3"]),
    ("not-mapping", "- root@10.0.0.1\n- root@10.0.0.2\n", ["YAML", "mapping of KEY: value"]),
    ("empty", "", ["HOSTS", "is not set"]),
    ("hosts-string", "HOSTS: root@10.0.0.1\n", ["HOSTS", "'root@10.0.0.1'", "non-empty list"]),
    ("port-string", "HOSTS: [a]\nPADDLE_PORT: seven\n", ["PADDLE_PORT", "'seven'", "whole number"]),
    ("bool-string", "HOSTS: [a]\nSSH_ACCEPT_NEW_HOST_KEYS: 'yes'\n",
     ["SSH_ACCEPT_NEW_HOST_KEYS", "'yes'", "True or False"]),
    ("relative-root", "HOSTS: [a]\nROOT_DIR: jobs\n", ["ROOT_DIR", "'jobs'", "absolute path"]),
    ("ports-num-zero", "HOSTS: [a]\nPADDLE_PORTS_NUM: 0\n", ["PADDLE_PORTS_NUM", "0", "at least 1"]),
]


@pytest.mark.parametrize("body, needles", [c[1:] for c in BAD_YAML], ids=[c[0] for c in BAD_YAML])
def test_bad_yaml(tmp_path, body, needles):
    path = write(tmp_path, body, "cluster.yaml")
    with pytest.raises(ConfigError) as ei:
        backend_of(load(str(path)))  # (HOSTS is required by the backend: ssh here)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    assert_clean_config_error(cli("--conf", str(path), "check"), *needles)


def test_yaml_digit_string_is_a_number(tmp_path):
    cfg = load(str(write(tmp_path, "HOSTS: [a]\nPADDLE_PORT: '9000'\n", "cluster.yaml")))
    assert cfg.paddle_port == 9000


# -- unknown keys are refused, with the closest key ------------------------------------------------------
def test_misspelt_key_is_refused_with_closest_key(tmp_path):
    path = write(tmp_path, HOSTS_LINE + "PADDLE_PROT = 7850\n")
    with pytest.raises(ConfigError, match=r"PADDLE_PROT = 7850 in .*conf\.py: not a paddle-cluster key; "
                                          r"did you mean PADDLE_PORT\?"):
        load(str(path))


def test_lower_case_key_in_conf_py_is_refused_with_its_upper_case_name(tmp_path):
    with pytest.raises(ConfigError, match="did you mean ROOT_DIR"):
        load(str(write(tmp_path, HOSTS_LINE + "root_dir = '/srv'\n")))


def test_unknown_key_without_close_match_lists_known_keys(tmp_path):
    path = write(tmp_path, HOSTS_LINE + "ZZZZ = 1\n")
    with pytest.raises(ConfigError, match="known keys: HOSTS, ROOT_DIR.*start its name with _"):
        load(str(path))


def test_conf_py_helpers_are_not_keys(tmp_path):
    body = "import os\nfrom os.path import join\n_base = '10.0.0.'\nclass X: pass\n" \
           "HOSTS = [_base + str(i) for i in (1, 2)]\nROOT_DIR = join('/srv', 'paddle')\n"
    cfg = load(str(write(tmp_path, body)))
    assert [h.host for h in cfg.hosts] == ["10.0.0.1", "10.0.0.2"] and cfg.root_dir == "/srv/paddle"


def local_conf(root: Path, extra: str = "") -> str:
    return (f'HOSTS = ["localhost"]\nROOT_DIR = "{root}"\nPADDLE_NIC = "lo"\n'
            f"PADDLE_PORT = {free_port_range(4)}\n{extra}")


def check_json(res: subprocess.CompletedProcess) -> list:
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    return json.loads(res.stdout)


def test_misspelt_key_fails_check_in_one_line(tmp_path):
    root = tmp_path / "root"
    path = write(tmp_path, local_conf(root, "PADDLE_PROT = 7850\n"))
    res = cli("--conf", str(path), "check")
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "PADDLE_PROT = 7850" in lines[0] and "did you mean PADDLE_PORT?" in lines[0], lines
    assert "Traceback" not in res.stderr and not root.exists()  # refused before the check touched anything


# -- lookup order ------------------------------------------------------------------------------------
def clean_environ(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_CLUSTER_CONF"}
    env.update(kw)
    return env


def test_lookup_order_load_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "conf.py").write_text(HOSTS_LINE + 'ROOT_DIR = "/from/conf_py"\n')
    (tmp_path / "cluster.yaml").write_text("HOSTS: [a]\nROOT_DIR: /from/cluster_yaml\n")
    (tmp_path / "env.py").write_text(HOSTS_LINE + 'ROOT_DIR = "/from/env"\n')
    (tmp_path / "explicit.yaml").write_text("HOSTS: [a]\nROOT_DIR: /from/explicit\n")
    env = {"PADDLE_CLUSTER_CONF": str(tmp_path / "env.py")}
    assert load_config("explicit.yaml", environ=env).root_dir == "/from/explicit"
    assert load_config(None, environ=env).root_dir == "/from/env"
    assert load_config(None, environ={"PADDLE_CLUSTER_CONF": ""}).root_dir == "/from/conf_py"
    (tmp_path / "conf.py").unlink()
    assert load_config(None, environ={}).root_dir == "/from/cluster_yaml"
    (tmp_path / "cluster.yaml").unlink()
    cfg = load_config(None, environ={})
    assert cfg.is_builtin_default and cfg.source == BUILTIN_SOURCE
    assert cfg.root_dir == str(tmp_path / "home" / "paddle_cluster_jobs")
    assert [h.text for h in cfg.hosts] == ["localhost"] and cfg.hosts[0].is_local
    assert cfg.paddle_nic == "lo" and cfg.pservers_per_node == 2 and cfg.trainers_per_node == 2


def test_lookup_order_cli(tmp_path):
    """The real CLI in a scratch cwd: each config has its own ROOT_DIR, and ``check`` creates that one."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    roots = {k: tmp_path / f"root_{k}" for k in ("explicit", "env", "conf_py", "yaml", "home")}
    write(cwd, local_conf(roots["explicit"]), "explicit.py")
    write(cwd, local_conf(roots["env"]), "env.py")
    write(cwd, local_conf(roots["conf_py"]), "conf.py")
    write(cwd, f'HOSTS: [localhost]\nROOT_DIR: {roots["yaml"]}\nPADDLE_NIC: lo\n'
               f"PADDLE_PORT: {free_port_range(4)}\n", "cluster.yaml")
    env_var = clean_environ(PADDLE_CLUSTER_CONF=str(cwd / "env.py"), HOME=str(roots["home"]))
    no_var = clean_environ(HOME=str(roots["home"]))

    def created() -> set:  # HOME's ROOT_DIR is ~/paddle_cluster_jobs (HOME itself also gets ~/.cache)
        return {k for k, p in roots.items() if (p / "paddle_cluster_jobs" if k == "home" else p).exists()}

    check_json(cli("--conf", "explicit.py", "check", "--json", cwd=cwd, env=env_var))
    assert created() == {"explicit"}
    check_json(cli("check", "--json", cwd=cwd, env=env_var))
    assert created() == {"explicit", "env"}
    check_json(cli("check", "--json", cwd=cwd, env=no_var))
    assert created() == {"explicit", "env", "conf_py"}
    (cwd / "conf.py").unlink()
    check_json(cli("check", "--json", cwd=cwd, env=no_var))
    assert created() == {"explicit", "env", "conf_py", "yaml"}
    (cwd / "cluster.yaml").unlink()
    rows = check_json(cli("check", "--json", cwd=cwd, env=no_var))  # ports 7164.. may be busy: rc 0 or 1
    assert [r["host"] for r in rows] == ["localhost"]
    assert (roots["home"] / "paddle_cluster_jobs").is_dir()


def test_conf_flag_missing_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match="no such file") as ei:
        load_config(missing, environ={})
    assert ei.value.key == "--conf" and ei.value.value == missing
    assert_clean_config_error(cli("--conf", missing, "check"), "--conf", missing, "no such file")


def test_conf_flag_directory(tmp_path):
    assert_clean_config_error(cli("--conf", str(tmp_path), "check"), "--conf", "no such file")


def test_env_var_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="PADDLE_CLUSTER_CONF"):
        load_config(None, environ={"PADDLE_CLUSTER_CONF": missing})
    res = cli("check", cwd=tmp_path, env=clean_environ(PADDLE_CLUSTER_CONF=missing))
    assert_clean_config_error(res, "PADDLE_CLUSTER_CONF", missing, "unset")


# -- HostSpec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, host, user, port", [
    ("root@192.168.100.17", "192.168.100.17", "root", None),
    ("root@192.168.100.17:9090", "192.168.100.17", "root", 9090),
    ("192.168.100.17:22", "192.168.100.17", None, 22),
    ("node-1.example.com", "node-1.example.com", None, None),
    ("gpu_box", "gpu_box", None, None),  # an alias from ~/.ssh/config
    ("paddle.user@alias", "alias", "paddle.user", None),
    ("  root@h:2222 ", "h", "root", 2222),
    ("[::1]:2200", "::1", None, 2200),
    ("root@[fe80::1]", "fe80::1", "root", None),
    ("h:65535", "h", None, 65535),
])
def test_hostspec_parse(text, host, user, port):
    h = HostSpec.parse(text)
    assert (h.host, h.user, h.port) == (host, user, port)
    assert h.text == text.strip()
    assert not h.is_local


@pytest.mark.parametrize("text", ["root@@x", "@host", "root@", "host:", "host:99999", "host:0", "host:-1",
                                  "a b", "::1", "host:22:33", "", "root@host/x"])
def test_hostspec_refuses(text):
    with pytest.raises(ConfigError) as ei:
        HostSpec.parse(text, "conf.py")
    assert ei.value.key == "HOSTS" and ei.value.value == text and "conf.py" in str(ei.value)


def test_localhost_is_local():
    assert HostSpec.parse("localhost").is_local
    assert not HostSpec.parse("localhost:2222").is_local  # an sshd on another port: use SSH
    assert not HostSpec.parse("paddle@localhost").is_local  # log in as that user: use SSH
    assert not HostSpec.parse("127.0.0.2").is_local


# -- the examples and the docs ------------------------------------------------------------------------
def test_conf_py_example_loads_and_sets_every_key(tmp_path):
    path = shutil.copy(REPO / "conf.py.example", tmp_path / "conf.py")
    cfg = load(str(path))  # an unknown or misspelt key in the example would raise
    text = (REPO / "conf.py.example").read_text()
    for key in ALL_KEYS:
        assert f"\n{key} = " in text, key
    # the seed's keys come first, in the seed's order
    seed = ["HOSTS", "ROOT_DIR", "PADDLE_NIC", "PADDLE_PORT", "PADDLE_PORTS_NUM", "PADDLE_PORTS_NUM_FOR_SPARSE",
            "LD_LIBRARY_PATH"]
    positions = [text.index(f"\n{k} = ") for k in ALL_KEYS]
    assert positions[:len(seed)] == sorted(positions[:len(seed)])
    assert max(positions[:len(seed)]) < min(positions[len(seed):])
    assert [h.text for h in cfg.hosts] == ["root@192.168.100.17", "root@192.168.100.18"]
    assert (cfg.root_dir, cfg.paddle_nic, cfg.paddle_port, cfg.paddle_ports_num,
            cfg.paddle_ports_num_for_sparse) == ("/home/paddle", "eth0", 7164, 2, 2)
    # The example says what the defaults are and sets them: PSERVER_COMMAND set to any value would fix the
    # pserver program and stop ENTRY's PSERVER role from choosing it (the example once set it so).
    assert cfg.pserver_command is None and ClusterConfig(hosts=()).pserver_command is None


def test_cluster_yaml_example_equals_conf_py_example(tmp_path):
    py = load(str(shutil.copy(REPO / "conf.py.example", tmp_path / "conf.py")))
    ym = load(str(shutil.copy(REPO / "cluster.yaml.example", tmp_path / "cluster.yaml")))
    assert same(py, ym)
    text = (REPO / "cluster.yaml.example").read_text()
    for key in KEYS:
        assert f"\n{key}:" in text, key


def test_configuration_doc_covers_every_key():
    doc = (REPO / "docs" / "configuration.md").read_text()
    for key in KEYS:
        assert f"`{key}`" in doc, key
    for needle in ("PADDLE_CLUSTER_CONF", "ProxyJump", "localhost", "~/.ssh/config"):
        assert needle in doc


def test_backend_key_is_checked_and_hosts_is_the_backends_to_require(tmp_path):
    with pytest.raises(ConfigError, match="BACKEND.*must be one of ssh, mpi, slurm, k8s"):
        parse_config({"HOSTS": ["a"], "BACKEND": "pbs"}, "t")
    for backend in REGISTRY:  # read alike; ``--backend`` may still change the backend
        cfg = parse_config({"BACKEND": backend, "ROOT_DIR": "/shared/paddle"}, "t")
        assert (cfg.backend, cfg.hosts) == (backend, ())
    assert backend_of(parse_config({"BACKEND": "slurm"}, "t")).name == "slurm"
    with pytest.raises(ConfigError, match=r"HOSTS is not set in t: backend mpi \(BACKEND = 'mpi' in t\)"):
        backend_of(parse_config({"BACKEND": "mpi"}, "t"))


# -- every error names where the wrong value came from: an option, the conf key and file, or the default -----
def _run_in(tmp_path: Path, conf_body: str, *args: str) -> subprocess.CompletedProcess:
    """``paddle-cluster run ARGS`` in ``tmp_path`` holding ``conf_body`` as conf.py and ws/ with one script."""
    (tmp_path / "conf.py").write_text(conf_body)
    (tmp_path / "ws").mkdir(exist_ok=True)
    (tmp_path / "ws" / "dist_train.py").write_text("print('hi')\n")
    return cli("run", *args, cwd=tmp_path, env=clean_environ(HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "s")))


def _local_body(tmp_path: Path, extra: str = "") -> str:
    return f'HOSTS = ["localhost"]\nROOT_DIR = "{tmp_path / "root"}"\nPADDLE_NIC = "lo"\n{extra}'


@pytest.mark.parametrize("extra, args, message", [
    ("", ["--job_dispatch_package", "ws", "--entry", "nope.py"],
     "--entry nope.py: no such file in the workspace {ws} (its scripts: dist_train.py)"),
    ('ENTRY = "nope.py"\n', ["--job_dispatch_package", "ws"],
     "ENTRY = 'nope.py' in {conf}: no such file in the workspace {ws} (its scripts: dist_train.py)"),
    ("", ["--job_dispatch_package", "ws"],
     "ENTRY = 'train.py' (the default; {conf} does not set ENTRY): no such file in the workspace {ws}"),
    ("", ["--job_dispatch_package", "./nope"], "--job_dispatch_package ./nope: no such directory ({tmp}/nope)"),
    ("", ["--job_dispatch_package", "ws/dist_train.py"],
     "--job_dispatch_package ws/dist_train.py: is not a directory ({ws}/dist_train.py)"),
    ('ENTRY = "dist_train.py"\n', ["--job_dispatch_package", "ws", "--entry", "../x.py"],
     "--entry ../x.py: must be a script's path inside the workspace"),
    ('ENTRY = "dist_train.py"\n', ["--job_dispatch_package", "ws", "--", "--port", "80"],
     "--port 80: a node's pservers and trainers need ports 80..85"),
    ('ENTRY = "dist_train.py"\nPSERVERS_PER_NODE = 20000\n', ["--job_dispatch_package", "ws"],
     "PADDLE_PORT = 7164 (the default; {conf} does not set PADDLE_PORT): a node's pservers and trainers need ports"),
    ('ENTRY = "dist_train.py"\nPADDLE_PORT = 80\n', ["--job_dispatch_package", "ws"],
     "PADDLE_PORT = 80 in {conf}: a node's pservers and trainers need ports 80..85"),
], ids=["entry-option", "entry-conf", "entry-default", "package-missing", "package-file", "entry-option-outside",
        "port-script-option", "port-default", "port-conf"])
def test_errors_name_where_the_value_came_from(tmp_path, extra, args, message):
    res = _run_in(tmp_path, _local_body(tmp_path, extra), *args)
    expected = message.format(ws=tmp_path / "ws", conf=tmp_path / "conf.py", tmp=tmp_path)
    assert_clean_config_error(res, f"paddle-cluster: error: {expected}")
    assert not (tmp_path / "root").exists(), "nothing may start"


def test_built_in_default_is_named_as_the_source(tmp_path):
    (tmp_path / "ws").mkdir()
    res = cli("run", "--job_dispatch_package", "ws", cwd=tmp_path,
              env=clean_environ(HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "s")))
    assert_clean_config_error(res, "ENTRY = 'train.py' (the default; no conf.py or cluster.yaml found: the built-in "
                              f"local cluster): no such file in the workspace {tmp_path / 'ws'} (it has no .py file)")


def test_conf_path_is_absolute_in_errors(tmp_path):
    """A relative --conf still gives its absolute path: the message stands on its own."""
    (tmp_path / "c.py").write_text(HOSTS_LINE + 'ROOT_DIR = "rel"\n')
    res = cli("--conf", "c.py", "check", cwd=tmp_path, env=clean_environ(HOME=str(tmp_path)))
    assert_clean_config_error(res, f"ROOT_DIR = 'rel' in {tmp_path / 'c.py'}: must be an absolute path")


@pytest.mark.parametrize("extra, args, message", [
    ('K8S_NAMESPACE = "Bad"\n', [], "K8S_NAMESPACE = 'Bad' in {conf}: must be a Kubernetes namespace name"),
    ('K8S_NAMESPACE = "ml"\n', ["--namespace", "Bad_NS"], "--namespace Bad_NS: must be a Kubernetes namespace name"),
    ('K8S_TRAINER_REQUESTS = "cpu"\n', [], "K8S_TRAINER_REQUESTS = 'cpu' in {conf}: 'cpu' is not NAME=VALUE"),
    ("", ["--trainer-requests", "gpu"], "--trainer-requests gpu: 'gpu' is not NAME=VALUE"),
], ids=["namespace-conf", "namespace-option", "requests-conf", "requests-option"])
def test_k8s_keys_name_their_source(tmp_path, extra, args, message):
    """The K8S_* keys and the flags that override them: the same mechanism (``config.override``)."""
    (tmp_path / "conf.py").write_text(_local_body(tmp_path, extra))
    res = cli("render", "k8s", "--image", "img:1", *args, cwd=tmp_path, env=clean_environ(HOME=str(tmp_path)))
    assert_clean_config_error(res, message.format(conf=tmp_path / "conf.py"))
