"""The command line of a command that passes arguments on to the entry script (``run``, ``render k8s``): its own
options first, the script's arguments after ``--``. An option it does not have is refused, with the closest
one it has, before anything starts: a typo handed to the script would start the job on every host and fail
there (``train.py: error: unrecognized arguments: --max_restart 1``), or silently run without the setting."""

from __future__ import annotations

import difflib
from typing import Optional, Sequence


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
