"""The launcher's errors. Every one carries a message a user can act on; the CLI prints it and exits."""

from __future__ import annotations

from typing import Dict


class ClusterError(Exception):
    """Base class: ``str(err)`` is the whole message shown to the user; ``exit_code`` is the CLI's."""

    exit_code = 1


class ConfigError(ClusterError):
    """A wrong configuration value: names where it came from, the value and the fix. ``key`` is a config key
    (``ENTRY = 'x.py' in /p/conf.py: ...``; with ``default``, why the default applies: ``ENTRY = 'train.py'
    (the default; /p/conf.py does not set ENTRY): ...``) or, starting with ``-``, the command-line option that
    gave it (``--entry x.py: ...``); with ``unset``, the file has no such key (``HOSTS is not set in /p/conf.py:
    ...``); with ``whole_file``, ``key`` is the file's kind (``conf.py``, ``YAML``), ``value`` its path and the
    message names the path alone (``/p/conf.py: syntax error ...``)."""

    exit_code = 2

    def __init__(self, key: str, value: object, fix: str, source: str = "", default: str = "",
                 unset: bool = False, whole_file: bool = False) -> None:
        if whole_file:
            head = str(value)
        elif key.startswith("-"):
            # A value with a line break is shown quoted: the message stays one line.
            shown = f"{value!r}" if isinstance(value, str) and any(c in value for c in "\n\r\0") else value
            head = key if value is None else f"{key} {shown}"
        elif default:
            head = f"{key} = {value!r} (the default; {default})"
        else:  # unset: the file has no such key (not "= None", which a file may say)
            head = f"{key} is not set" if unset else f"{key} = {value!r}"
            head += f" in {source}" if source else ""
        super().__init__(f"{head}: {fix}")
        self.key, self.value, self.fix = key, value, fix


class UsageError(ClusterError):
    """A command-line argument that names nothing there is (``logs node5`` on three nodes): a usage error, as
    click's own, so exit 2."""

    exit_code = 2


class HostError(ClusterError):
    """Something went wrong on one host; the message starts with that host."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host, self.message = host, message


class HostConfigError(HostError):
    """A value of the command line or the config that is wrong on one host: the directory ``--job_workspace``
    names, or the script the config names in it, is not there. A configuration error, found on the host."""

    exit_code = 2


class ConnectError(HostError):
    """No SSH session to a host: one line with its address and port, what failed and the command that fixes
    or diagnoses it (docs/troubleshooting.md lists each ``what``)."""

    def __init__(self, host: str, address: str, port: int, what: str, fix: str) -> None:
        super().__init__(host, f"{address}:{port}: {what}; {fix}")
        self.address, self.port, self.what, self.fix = address, port, what, fix


class HostsFailed(ClusterError):
    """A fan-out over hosts in which one or more hosts failed; lists every failure, not just the first."""

    def __init__(self, what: str, failures: Dict[str, BaseException]) -> None:
        reach = all(isinstance(e, ConnectError) for e in failures.values())
        lines = [f"cannot reach {len(failures)} host(s) over SSH:" if reach
                 else f"{what} failed on {len(failures)} host(s):"]
        for host, err in failures.items():
            msg = err.message if isinstance(err, HostError) else f"{type(err).__name__}: {err}"
            if not isinstance(err, ClusterError):
                msg = f"unexpected error: {msg}"
            lines.append(f"  {host}: {msg}")
        super().__init__("\n".join(lines))
        self.what, self.failures = what, failures
        # Every host refused the configuration itself: a configuration error (2), as when found on this machine.
        if all(isinstance(e, ClusterError) and e.exit_code == ConfigError.exit_code for e in failures.values()):
            self.exit_code = ConfigError.exit_code


# The fix for a job name no node knows (status, logs, kill, top): most often a mistyped --job_name.
JOB_NAME_FIX = ("check the job name (run printed it; without --job_name these commands take the latest job of this "
                "config)")

# How a command ends, by exit status: the CLI's help and docs/troubleshooting.md list the same.
OUTCOMES = {0: "finished", 1: "failed", 2: "configuration or usage error", 3: "stopped by paddle-cluster kill",
            4: "lost contact with a node", 130: "interrupted (Ctrl+C, SIGTERM or SIGHUP)"}


class JobFailed(ClusterError):
    """The job ran and failed: the report says which process, how, and its last log lines."""


class StoppedByKill(JobFailed):
    """``paddle-cluster kill`` stopped the job: an outcome, not an error."""

    exit_code = 3


class LostContact(JobFailed):
    """A node's agent could no longer be heard; the job was stopped everywhere else."""

    exit_code = 4


class Interrupted(ClusterError):
    """Ctrl+C or SIGTERM stopped the job."""

    exit_code = 130
