"""The command line of a command that passes arguments on to the entry script (``run``, ``render k8s``): its own
options first, the script's arguments after ``--``. An option it does not have is refused, with the closest
one it has, before anything starts: a typo handed to the script would start the job on every host and fail
there (``train.py: error: unrecognized arguments: --max_restart 1``), or silently run without the setting. So is
an option of another backend than the job's (``run --namespace`` on the ssh backend; ``check`` alike)."""

from __future__ import annotations

import difflib
from typing import Optional, Sequence, Tuple

from .config import ClusterConfig
from .registry import DEFAULT


def _norm(option: str) -> str:
    """``--Job-Name`` and ``--job_name`` alike: the spelling differences a did-you-mean should see through."""
    return option.lstrip("-").replace("-", "_").lower()


def closest_option(option: str, known: Sequence[str]) -> Optional[str]:
    """The option of ``known`` that ``option`` most likely misspells (``--max_restart`` -> ``--max_restarts``,
    ``--job-name`` and ``--jobname`` -> ``--job_name``); None when none is close."""
    longs = [k for k in known if k.startswith("--")]
    by_norm = {_norm(k): k for k in longs}
    same = by_norm.get(_norm(option))
    if same:
        return same
    close = difflib.get_close_matches(_norm(option), list(by_norm), n=1, cutoff=0.75)
    return by_norm[close[0]] if close else None


def unknown_option(command: str, option: str, known: Sequence[str], argv: Sequence[str],
                   before: Sequence[str] = ()) -> str:
    """The usage error for ``option``, which ``command`` does not have: the closest option it has, and how the
    entry script's arguments are given, with the user's own tokens from ``argv``. ``before``: the options of
    ``paddle-cluster`` itself (``--conf``), which go before the command."""
    own = closest_option(option, before)
    if own and _norm(own) == _norm(option):
        return (f"{own} is an option of paddle-cluster itself, not of {command}; nothing was started. Give it "
                f"before the command: paddle-cluster {_script_part(option, argv)} {command} ...")
    guess = closest_option(option, known)
    head = f"{command} has no option {option}" + (f" (did you mean {guess}?)" if guess else "")
    return (f"{head}; nothing was started. The entry script's own arguments go after --: "
            f"paddle-cluster {command} [OPTIONS] -- {_script_part(option, argv)}")


def _script_part(option: str, argv: Sequence[str]) -> str:
    """``option`` as the user typed it with its value (``--max_restart 1``, ``--max_restart=1``), for the
    example of ``-- ARGS``."""
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if tok == option:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return f"{tok} {nxt}" if nxt and not nxt.startswith("-") else tok
        if tok.startswith(option + "="):
            return tok
    return f"{option} ..."


def not_for_this_job(cfg: ClusterConfig, foreign: Sequence[Tuple[str, str]], backend_given: bool) -> str:
    """The usage error of ``run`` given options of other backends (``foreign``: (flag, the backends declaring it),
    ``backends.foreign_options``): whose each is, where the job's backend came from (``backend_given``:
    ``--backend``), and the fix."""
    owners = {owner: [f for f, o in foreign if o == owner] for _, owner in foreign}
    chosen = "--backend" if backend_given else "the built-in local cluster" if cfg.is_builtin_default else \
        f"BACKEND in {cfg.source}, else {DEFAULT}"
    return ("; ".join(f"{', '.join(flags)}: for --backend {owner} only" for owner, flags in owners.items())
            + f" (this job runs on backend {cfg.backend}, from {chosen}): drop "
            f"{'it' if len(foreign) == 1 else 'them'}, or run with --backend {foreign[0][1]}")


def not_for_this_check(cfg: ClusterConfig, foreign: Sequence[Tuple[str, str]]) -> str:
    """The usage error of ``check`` given an option of another backend (the first of ``foreign``)."""
    flag, owner = foreign[0]
    return (f"{flag}: for --backend {owner} only (backend {cfg.backend} is checked here): add --backend {owner}, or "
            f"leave {flag} out")
