"""``run --resume_from``: the checkpoint step every pserver resumes from, chosen on the launcher before anything
starts, from what each node's probe found of its pservers' shards (``ps.checkpoint.survey``). No step complete
for every pserver is an error naming what was looked for and where; a fresh start is only what the user asked.
A ``--max_restarts`` restart resumes from the same kind of step (``newest_common``), found after the failure."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import ClusterError
from .plan import JobSpec

FIX = ("a checkpoint is a step-NNNNNNNN directory holding, for every pserver, pserver-<id>/manifest.json and the "
       "files it lists; name a job that saved one (its checkpoints are in ROOT_DIR/<job>/checkpoints on the nodes "
       "that ran its pservers) or such a directory, or leave out --resume_from to start fresh")


class NoCheckpoint(ClusterError):
    """``--resume_from`` found no checkpoint complete for every pserver; nothing was started."""

    exit_code = 2


def what(spec: JobSpec) -> str:
    """What ``--resume_from`` names, as the messages say it."""
    r = spec.resume_from or ""
    return spec.resume_root if r.startswith("/") else f"{spec.resume_root} (job {r}'s checkpoints)"


def newest_common(steps: Sequence[Iterable[int]]) -> Optional[int]:
    """The newest step in every one of ``steps`` (each pserver node's complete checkpoints); None if none is.

    Pservers on different hosts see only their own shards, so each would pick its own "latest": the launcher
    picks the one step all of them hold, which rolls every shard back to the same step.
    """
    common = set.intersection(*(set(s) for s in steps)) if steps else set()
    return max(common) if common else None


def common_step(spec: JobSpec, found: Sequence[Tuple[str, Optional[Dict[str, Any]]]],
                say: Callable[[str], None]) -> int:
    """The newest step complete for every pserver, from each pserver node's survey (``(label, survey)``), said;
    NoCheckpoint, naming each node's finding, when there is none."""
    steps = [set(s.get("complete", [])) if s and "error" not in s else set() for _, s in found]
    step = newest_common(steps)
    if step is not None:
        say(f"--resume_from {spec.resume_from}: every pserver resumes from step {step} of {what(spec)}")
        return step
    root = spec.resume_root
    lines = [f"--resume_from {spec.resume_from}: no checkpoint complete for every pserver in {what(spec)}; "
             "nothing was started (not starting fresh):"]
    job = not (spec.resume_from or "").startswith("/")
    lines += [f"  {label}: {_node(root, s, job)}" for label, s in found]
    if all(steps):
        lines.append("  no step is complete on every node")
    raise NoCheckpoint("\n".join(lines + [FIX]))


def _node(root: str, s: Optional[Dict[str, Any]], job: bool) -> str:
    """One node's finding, in a line (``job``: --resume_from named a job)."""
    if not s:
        return "did not say what it holds"
    if "error" in s:
        return str(s["error"])
    if s.get("root"):
        why = " (no job of that name ran its pservers here, or it never saved a checkpoint)" if job else ""
        return f"{root} {s['root']}{why}"
    complete, incomplete = s.get("complete", []), s.get("incomplete", [])
    if not complete and not incomplete:
        return f"no step-NNNNNNNN directory in {root}: no checkpoint was saved there"
    parts: List[str] = []
    for step, problems in reversed(incomplete):
        parts += [f"step-{step:08d}/pserver-{k}: {why}" for k, why in sorted(problems.items(), key=lambda x: int(x[0]))]
    parts.append("complete here: " + (", ".join(f"step {n}" for n in complete) if complete else "none"))
    return "; ".join(parts)
