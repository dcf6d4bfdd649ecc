"""Cluster configuration: ``conf.py`` (executed as Python) or YAML, validated into a typed ``ClusterConfig``.

Lookup order: ``--conf FILE``, then ``$PADDLE_CLUSTER_CONF``, then ``./conf.py``, then ``./cluster.yaml``;
with none of them, a built-in local default (two pservers and two trainers on this machine).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import stat
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

import yaml

from .. import contract
from .errors import ConfigError
from .registry import DEFAULT, REGISTRY

LOCAL_HOSTS = ("localhost",)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_RESERVED_ENV = contract.reserved_env()
_HOST_RE = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class HostSpec:
    """One entry of ``HOSTS``: ``user@host[:port]``, an alias from ``~/.ssh/config``, or ``localhost``; made from
    the entry's text by ``parse``, which names the entry and the fix when it is wrong."""

    text: str
    host: str
    user: Optional[str]
    port: Optional[int]

    @property
    def is_local(self) -> bool:
        # ``user@localhost`` or ``localhost:2222`` ask for an SSH login (as that user / to that sshd).
        return self.host in LOCAL_HOSTS and self.port is None and self.user is None

    @classmethod
    def parse(cls, text: object, source: str = "") -> HostSpec:
        if not isinstance(text, str):
            raise ConfigError("HOSTS", text, 'each host must be a string like "user@host" or "user@host:2222"',
                              source)
        m = _HOST_RE.match(text.strip())
        if not m:
            raise ConfigError("HOSTS", text, 'cannot parse this host; write it as "host", "user@host", '
                              '"user@host:port" or an alias from ~/.ssh/config', source)
        port = m.group("port")
        if port is not None and not 1 <= int(port) <= contract.PORT_MAX:
            raise ConfigError("HOSTS", text, f"the SSH port must be between 1 and {contract.PORT_MAX}", source)
        return cls(text.strip(), m.group("host").strip("[]"), m.group("user"), int(port) if port else None)


@dataclass(frozen=True)
class ClusterConfig:
    """Every setting, with the seed's keys first. Field names are the config keys in lower case."""

    hosts: Tuple[HostSpec, ...]
    root_dir: str = "/home/paddle"
    paddle_nic: str = "eth0"
    paddle_port: int = 7164
    paddle_ports_num: int = 2
    paddle_ports_num_for_sparse: int = 2
    ld_library_path: str = ""
    # Beyond the seed.
    pservers_per_node: int = 1
    trainers_per_node: int = 1
    python: str = "python3"
    # None: chosen by the entry script (launch/entry.py: it runs as pserver when it handles that role); any
    # value set is used as it is, the built-in pserver's own command included.
    pserver_command: Optional[str] = None
    trainer_command: str = "{python} {entry}"
    entry: str = "train.py"
    env: Dict[str, str] = field(default_factory=dict)
    ssh_identity_file: Optional[str] = None
    ssh_config_file: Optional[str] = None
    ssh_known_hosts: Optional[str] = None
    ssh_accept_new_host_keys: bool = False
    ssh_connect_timeout: float = 10.0
    start_timeout: float = 60.0
    barrier_timeout: float = 120.0
    orphan_timeout: float = 20.0
    kill_grace: float = 5.0
    max_restarts: int = 0
    # Where jobs run: "ssh" (HOSTS), "mpi" (mpirun over HOSTS), "slurm" (an allocation) or "k8s" (a
    # Kubernetes namespace); docs/backends.md.
    backend: str = DEFAULT
    # The keys the backends declare (``ConfKey``: MPI_IMPL, K8S_NAMESPACE...) that the file or an option set, as
    # (field name, value) in name order; each backend reads its own (``ConfKey.of``) into its typed settings.
    backend_keys: Tuple[Tuple[str, Any], ...] = ()
    # Frames between trainers and pservers carry MACs; False only on an isolated fabric (docs/reliability.md).
    integrity: bool = True
    # Where the values came from, so that an error names it (``error``): the file, the keys it set, and the
    # keys a command-line option set (KEY, "--entry"); every other key has its default.
    source: str = "<built-in local default>"
    file_keys: FrozenSet[str] = frozenset()
    options: Tuple[Tuple[str, str], ...] = ()

    @property
    def is_builtin_default(self) -> bool:
        return self.source == BUILTIN_SOURCE

    def error(self, name: str, fix: str, value: Any = None) -> ConfigError:
        """The ``ConfigError`` for setting ``name`` (a field name), naming where its value came from: the option
        that gave it, the file that set it, or the default (and that the file does not set it)."""
        key = name.upper()
        if value is None:  # a backend's key (``ConfKey.error``) gives its value
            value = getattr(self, name) if key in KEYS else dict(self.backend_keys).get(name)
        option = dict(self.options).get(key)
        if option:
            return ConfigError(option, value, fix)
        if key in self.file_keys:
            return ConfigError(key, value, fix, self.source)
        why = "no conf.py or cluster.yaml found: the built-in local cluster" if self.is_builtin_default else \
            f"{self.source} does not set {key}"
        return ConfigError(key, value, fix, default=why)

    def pserver_ports(self, local_index: int) -> Tuple[int, ...]:
        """Ports of the ``local_index``-th pserver on a node (the contract's port model)."""
        return contract.pserver_ports(self.paddle_port, self.paddle_ports_num, self.paddle_ports_num_for_sparse,
                                      local_index)

    def commands(self, python: Optional[str] = None) -> Tuple[str, str]:
        """PSERVER_COMMAND and TRAINER_COMMAND with ``{python}`` (PYTHON) and ``{entry}`` (ENTRY) filled in, each
        shell-quoted: a path with a space stays one word."""
        values = {"python": shlex.quote(python or self.python), "entry": shlex.quote(self.entry)}
        return (self.pserver_command or BUILTIN_PSERVER).format(**values), self.trainer_command.format(**values)

    @property
    def pserver_runs_entry(self) -> bool:
        """Whether pservers run the entry script (so its arguments reach them too)."""
        return "{entry}" in (self.pserver_command or "")

    @property
    def collective(self) -> bool:
        """A job without pservers (PSERVERS_PER_NODE = 0, ``run --collective``): trainers only."""
        return self.pservers_per_node == 0

    def trainer_ports(self) -> Tuple[int, ...]:
        """MASTER_PORT, then each trainer's port of a node, after the pservers' (the contract's port model)."""
        return contract.trainer_ports(self.paddle_port, self.pservers_per_node, self.paddle_ports_num,
                                      self.paddle_ports_num_for_sparse, self.trainers_per_node)

    def node_ports(self) -> Tuple[int, ...]:
        """The ports a job listens on on each node, which preflight checks are free: the pservers'; the
        trainers' in a collective job (a pserver job's trainers use theirs only if the script is collective)."""
        ps = tuple(p for k in range(self.pservers_per_node) for p in self.pserver_ports(k))
        return ps or self.trainer_ports()

    def job_dir(self, job_name: str) -> str:
        """A job's directory on every node."""
        return f"{self.root_dir}/{job_name}"

    @property
    def known_hosts(self) -> str:
        """The known_hosts file both SSH paths (paramiko and OpenSSH) check host keys against."""
        return self.ssh_known_hosts or os.path.expanduser("~/.ssh/known_hosts")


BUILTIN_SOURCE = "<built-in local default>"
BUILTIN_PSERVER = "{python} -m paddle_cluster.ps"  # the runtime's pserver (paddle_cluster/ps)
ENTRY_PSERVER = "{python} {entry}"  # the entry script, as PADDLE_TRAINING_ROLE=PSERVER
_ORIGIN = ("source", "file_keys", "options", "backend_keys")  # not settings of their own
KEYS = tuple(f.name.upper() for f in dataclasses.fields(ClusterConfig) if f.name not in _ORIGIN)


@dataclass(frozen=True)
class ConfKey:
    """A key of conf.py (or cluster.yaml) that a backend declares (``Backend.conf_keys``) rather than
    ``ClusterConfig``: its name, its default (whose type the value must have, None: a string or nothing), the values
    it may take (none: any) and its own check (the fix for a wrong value, "" for a right one). The configuration
    knows the keys it is handed (``load_config(keys=...)``), not the backends."""

    name: str  # "MPI_IMPL"
    default: Any
    choices: Tuple[str, ...] = ()
    check: Optional[Callable[[Any], str]] = None

    def of(self, cfg: ClusterConfig) -> Any:
        """Its value in ``cfg``: the one the file or an option gave, else its default."""
        return dict(cfg.backend_keys).get(self.name.lower(), self.default)

    def error(self, cfg: ClusterConfig, fix: str) -> ConfigError:
        """``cfg.error`` for this key: naming the option, the file or the default that gave its value."""
        return cfg.error(self.name.lower(), fix, self.of(cfg))

    def fix(self, value: Any) -> str:
        """What is wrong with ``value`` by its own rules (``choices``, ``check``); "" when nothing."""
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return self.check(value) if self.check else ""


def builtin_default() -> ClusterConfig:
    """Two pservers and two trainers on this machine over loopback; no SSH needed."""
    return ClusterConfig(
        hosts=(HostSpec.parse("localhost"),),
        root_dir=str(Path.home() / "paddle_cluster_jobs"),
        paddle_nic="lo",
        paddle_ports_num=1,
        paddle_ports_num_for_sparse=1,
        pservers_per_node=2,
        trainers_per_node=2,
        python=os.environ.get("PADDLE_CLUSTER_PYTHON", "") or _this_python(),
        source=BUILTIN_SOURCE,
    )


def _this_python() -> str:
    import sys

    return sys.executable or "python3"


def find_config_file(explicit: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """The file to read, by the documented order; None means the built-in default."""
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise ConfigError("--conf", explicit, "no such file; give the path of a conf.py or cluster.yaml")
        return p
    env_path = environ.get("PADDLE_CLUSTER_CONF")
    if env_path:
        p = Path(env_path)
        if not p.is_file():
            raise ConfigError("PADDLE_CLUSTER_CONF", env_path, "no such file; fix or unset the variable")
        return p
    for name in ("conf.py", "cluster.yaml"):
        if Path(name).is_file():
            return Path(name)
    return None


def load_config(explicit: Optional[str] = None, environ: Mapping[str, str] = os.environ,
                keys: Sequence[ConfKey] = ()) -> ClusterConfig:
    """The config the documented order finds, with ``keys`` (the backends' declared keys, which the caller hands
    over: ``backends.declared_conf_keys``) known beside ``ClusterConfig``'s."""
    path = find_config_file(explicit, environ)
    if path is None:
        return builtin_default()
    raw = _read_yaml(path) if path.suffix in (".yaml", ".yml") else _read_python(path)
    return parse_config(raw, os.path.abspath(path), keys)  # errors name the file wherever the command ran


def _file_error(path: Path, fix: str) -> ConfigError:
    """An error of the config file as a whole, named by its absolute path (``conf.py = 'conf.py' in conf.py``
    said it as if it were a key)."""
    kind = "YAML" if path.suffix in (".yaml", ".yml") else "conf.py"
    return ConfigError(kind, os.path.abspath(path), fix, whole_file=True)


def _read_text(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            _check_owner(path, os.fstat(f.fileno()))  # of the file read, not of a name that may change
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise _file_error(path, f"not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except OSError as e:
        raise _file_error(path, f"cannot read it: {e.strerror or e}; check the path and its permissions") from None


def _check_owner(path: Path, st: os.stat_result) -> None:
    """Refuse, as OpenSSH does, a config file another user could have written: it says what runs where, and
    conf.py is executed. Owned by the user running the launcher or root; not group- or other-writable."""
    import pwd

    path = Path(os.path.abspath(path))  # the fix is a command to paste, from any directory

    def name(uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"

    me = os.geteuid()
    if st.st_mode & 0o022:
        who = "group and others" if st.st_mode & 0o002 else "its group"
        raise _file_error(path, f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), so another user "
                          f"could change what the launcher runs; fix: chmod go-w {path}")
    if st.st_uid not in (me, 0):
        raise _file_error(path, f"is owned by {name(st.st_uid)}, not by {name(me)} who runs the launcher (or "
                          f"root); fix: chown {name(me)} {path}, or copy it to a file of your own")


def _read_python(path: Path) -> Dict[str, Any]:
    text = _read_text(path)
    try:
        code = compile(text, str(path), "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes, on older Pythons
        where = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise _file_error(path, f"syntax error{where}: {getattr(e, 'msg', e)}; "
                          f"the file is Python, e.g. HOSTS = [\"root@10.0.0.1\"]") from None
    namespace: Dict[str, Any] = {"__file__": str(path), "__name__": "paddle_cluster_conf"}
    try:
        exec(code, namespace)  # noqa: S102 - conf.py is the user's own Python, as in the seed
    except (Exception, SystemExit) as e:  # a conf.py calling sys.exit() must not end the launcher silently
        raise _file_error(path, f"running it raised {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def _read_yaml(path: Path) -> Dict[str, Any]:
    try:
        data = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise _file_error(path, f"cannot parse it as YAML{line}: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _file_error(path, "the YAML must be a mapping of KEY: value")
    return {str(k).upper(): v for k, v in data.items()}


def parse_config(raw: Mapping[str, Any], source: str, keys: Sequence[ConfKey] = ()) -> ClusterConfig:
    """Validate ``raw`` (upper-case keys; ``keys``: the backends' declared keys it may set too) into a
    ``ClusterConfig``; wrong values raise ``ConfigError``."""
    declared = {k.name: k for k in keys}
    known = KEYS + tuple(declared)
    for key in raw:
        if key not in known:
            # A misspelt key must not leave its setting at the default unnoticed (PADDLE_PROT = 7850 ran on 7164).
            close = difflib.get_close_matches(key.upper(), known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
            raise ConfigError(key, raw[key], f"not a paddle-cluster key; {hint} (a helper variable of your own in "
                              "conf.py: start its name with _)", source)
    # HOSTS may be left out: the backends whose nodes are its machines require it once the backend is known
    # (``--backend`` included), and those whose engine gives the nodes (Slurm, Kubernetes) do not.
    base = ClusterConfig(hosts=())
    values: Dict[str, Any] = {"source": source, "file_keys": frozenset(k for k in raw if k in known)}
    for f in dataclasses.fields(ClusterConfig):
        key = f.name.upper()
        if key in raw and f.name not in _ORIGIN:
            values[f.name] = _coerce(key, raw[key], getattr(base, f.name), source)
    values["backend_keys"] = tuple(sorted((k.lower(), _coerce(k, raw[k], declared[k].default, source))
                                          for k in raw if k in declared))
    values["hosts"] = _hosts(raw["HOSTS"], source) if "HOSTS" in raw else ()
    for name in ("ssh_identity_file", "ssh_config_file", "ssh_known_hosts"):
        if values.get(name):  # files on this machine: "~" is ours, expanded here once for the SSH layer
            values[name] = os.path.expanduser(values[name])
    cfg = ClusterConfig(**values)
    validate(cfg, keys)
    return cfg


def override(cfg: ClusterConfig, given: Mapping[str, Tuple[str, Any]], keys: Sequence[ConfKey] = ()) -> ClusterConfig:
    """``cfg`` with the settings of ``given`` (field name -> (the command-line option, its value); ``keys``: the
    declarations of the backend keys among them), validated together: an error names the option, not the file."""
    options = dict(cfg.options)
    options.update({name.upper(): option for name, (option, _) in given.items()})
    declared = {k.name.lower() for k in keys}
    values = dict(cfg.backend_keys)
    values.update({name: v for name, (_, v) in given.items() if name in declared})
    new = dataclasses.replace(cfg, **{name: v for name, (_, v) in given.items() if name not in declared},
                              options=tuple(options.items()), backend_keys=tuple(sorted(values.items())))
    validate(new, [k for k in keys if k.name.lower() in given])
    return new


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
    if key == "HOSTS":
        return value
    if key == "ENV":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(key, value, "must be a mapping of variable names to values, "
                              'e.g. {"OMP_NUM_THREADS": "1"}', source)
        for name, v in value.items():
            if not _ENV_NAME.fullmatch(name):
                raise ConfigError(key, value, f"{name!r} is not a variable name: use letters, digits and _, "
                                  "not starting with a digit", source)
            if name in _RESERVED_ENV:
                how = " (INTEGRITY = False sets it)" if name == "PADDLE_INTEGRITY" else ""
                raise ConfigError(key, value, f"{name} is set by paddle-cluster for {_RESERVED_ENV[name]}{how}, "
                                  "see docs/environment.md; remove it from ENV", source)
            if line_break(str(v)):
                raise ConfigError(key, value, f"the value of {name} contains {line_break(str(v))}, which an "
                                  "environment variable cannot carry", source)
        return {k: str(v) for k, v in value.items()}
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(key, value, "must be True or False", source)
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
                return int(value)
            raise ConfigError(key, value, "must be a whole number", source)
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(key, value, "must be a positive number of seconds", source)
        return float(value)
    if value is None and default is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(key, value, "must be a string", source)
    return value


def _hosts(value: Any, source: str) -> Tuple[HostSpec, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError("HOSTS", value, 'must be a non-empty list, e.g. HOSTS = ["root@10.0.0.1", "root@10.0.0.2"]',
                          source)
    hosts = tuple(HostSpec.parse(v, source) for v in value)
    seen: Dict[Tuple[str, Optional[int]], str] = {}
    for h in hosts:
        ident = (h.host.lower(), h.port)  # host names are case-insensitive
        if ident in seen:
            raise ConfigError("HOSTS", h.text, f"lists the same machine as {seen[ident]!r}: their pservers' ports "
                              "would overlap; list each machine once and raise PSERVERS_PER_NODE / "
                              "TRAINERS_PER_NODE instead", source)
        seen[ident] = h.text
    return hosts


_BREAKS = {"\n": "a newline", "\r": "a carriage return", "\0": "a NUL byte"}
# Values end up in scripts, config files and manifests (an #SBATCH line, mpirun's ssh config, a pod's command):
# a line break there would end the line and make the rest a line of its own.
NO_BREAKS = "a value written into a script or config file must stay on one line; remove it"


def line_break(value: str) -> str:
    """What line break (or NUL) ``value`` holds, as words ("a newline"); "" when none."""
    return next((what for c, what in _BREAKS.items() if c in value), "")


def refuse_line_break(option: str, value: Optional[str]) -> None:
    """``ConfigError`` naming ``option`` when its value holds a line break or NUL (``line_break``)."""
    if value and line_break(value):
        raise ConfigError(option, value, f"contains {line_break(value)}: {NO_BREAKS}")


def validate(cfg: ClusterConfig, keys: Sequence[ConfKey] = ()) -> None:
    """Each setting alone and together (``keys``: the backends' declared keys, each by its own rules); an error
    names where the wrong value came from (``ClusterConfig.error``)."""
    values = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in _ORIGIN]
    for name, value in values + list(cfg.backend_keys):
        if isinstance(value, str) and line_break(value):
            raise cfg.error(name, f"contains {line_break(value)}: {NO_BREAKS}", value)
    if not os.path.isabs(cfg.root_dir):
        raise cfg.error("root_dir", "must be an absolute path on every host, e.g. /home/paddle")
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", cfg.paddle_nic):
        raise cfg.error("paddle_nic", "must be an interface name such as eth0, ib0 or lo")
    if cfg.paddle_ports_num < 1:
        raise cfg.error("paddle_ports_num", "must be at least 1")
    if cfg.paddle_ports_num_for_sparse < 0:
        raise cfg.error("paddle_ports_num_for_sparse", "must be 0 or more")
    for key in ("pservers_per_node", "trainers_per_node"):
        if getattr(cfg, key) < 0:
            raise cfg.error(key, "must be 0 or more")
    if cfg.max_restarts < 0:
        raise cfg.error("max_restarts", "must be 0 (fail fast) or more")
    if cfg.backend not in REGISTRY:
        raise cfg.error("backend", f"must be one of {', '.join(REGISTRY)}")
    for key in keys:  # each backend's keys, by its own rules
        if key.fix(key.of(cfg)):
            raise key.error(cfg, key.fix(key.of(cfg)))
    nodes = max(1, len(cfg.hosts))  # without HOSTS the engine gives the nodes (Slurm's --nodes, k8s: the pods)
    if cfg.trainers_per_node * nodes < 1:
        raise cfg.error("trainers_per_node", "the job needs at least one trainer")
    if cfg.collective and cfg.pserver_command is not None:
        raise cfg.error("pserver_command", "a job without pservers (PSERVERS_PER_NODE = 0, run --collective) runs "
                        "no pserver program: remove PSERVER_COMMAND, or give the job pservers")
    last = cfg.trainer_ports()[-1]
    if not 1024 <= cfg.paddle_port or last > contract.PORT_MAX:
        raise cfg.error("paddle_port", f"a node's pservers and trainers need ports {cfg.paddle_port}..{last} "
                        f"(docs/environment.md#port-layout), which must lie within 1024..{contract.PORT_MAX}; choose "
                        "a PADDLE_PORT such as 7164")
    for key in ("ssh_identity_file", "ssh_config_file"):
        path = getattr(cfg, key)
        if path and not os.path.isfile(path):
            raise cfg.error(key, "no such file on this machine; give an existing file or None for the default")
    for key in ("pserver_command", "trainer_command"):
        try:
            (getattr(cfg, key) or "").format(python="python3", entry="train.py")
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
            raise cfg.error(key, f"bad placeholder {e}; only {{python}} and {{entry}} are substituted (write {{{{ "
                            "and }} for literal braces)") from None
    if not cfg.entry.strip() or os.path.isabs(cfg.entry) or ".." in cfg.entry.split("/"):
        raise cfg.error("entry", "must be a script's path inside the workspace, e.g. train.py or dist_train.py")


def origin_line(cfg: ClusterConfig) -> str:
    """The first line of a command about a job: which config it read, so a wrong directory shows at once."""
    if not cfg.is_builtin_default:
        return f"config {cfg.source}"
    return (f"no conf.py or cluster.yaml in {os.getcwd()}: using the built-in local cluster ({cfg.pservers_per_node} "
            f"pservers and {cfg.trainers_per_node} trainers on this machine, ROOT_DIR={cfg.root_dir}); for your "
            "cluster's jobs run where its conf.py is, or give --conf FILE")
