"""Two HOSTS entries that reach the same machine (``root@127.0.0.1:2222`` and ``root@localhost:2222``) would
put two job directories and two pservers' ports on one host: ``check`` and ``run`` refuse them, naming both.

A machine is known by what its probe answers: the hash of its ``/etc/machine-id`` and its address on
PADDLE_NIC. The id alone is not enough (containers and network namespaces share the file, and cloned images
copy it); the address alone is not either (``lo`` is 127.0.0.1 everywhere)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from .errors import ConfigError


def same_machine_problems(labels: Sequence[str], probes: Sequence[Mapping[str, Any]]) -> Dict[int, str]:
    """For each entry that is the same machine as an earlier one, why (keyed by its index)."""
    first: Dict[tuple, int] = {}
    out: Dict[int, str] = {}
    for i, doc in enumerate(probes):
        key = (doc.get("machine"), doc.get("address"))
        if None in key:
            continue
        if key in first:
            j = first[key]
            out[i] = (f"{labels[j]} and {labels[i]} are the same machine (same machine id, address {key[1]}); "
                      "list it once in HOSTS and raise PSERVERS_PER_NODE / TRAINERS_PER_NODE instead")
        else:
            first[key] = i
    return out


def refuse_same_machines(labels: Sequence[str], probes: Sequence[Mapping[str, Any]], source: str) -> None:
    """``ConfigError`` naming the first two entries that are one machine."""
    problems = same_machine_problems(labels, probes)
    if problems:
        i = min(problems)
        raise ConfigError("HOSTS", labels[i], problems[i], source)
