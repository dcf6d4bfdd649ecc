"""A packed archive the launcher sends to the nodes (the node library, a workspace, a delta): named by its SHA-256."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    path: str
    sha256: str
    size: int
    files: int
