"""Typed errors of the parameter-server runtime.

Every error a pserver reports to a trainer travels as an ERROR frame carrying a status code and a small
JSON body; ``from_wire`` turns it back into the same exception class on the trainer side, so callers can
``except BarrierTimeout`` instead of parsing strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Type


class PSError(Exception):
    """Base class of every runtime error."""

    code = 1

    def to_wire(self) -> Dict[str, Any]:
        return {"message": str(self)}


class ProtocolError(PSError):
    """A malformed, oversized, truncated or out-of-order frame."""

    code = 2


class AuthError(PSError):
    """The peer failed the challenge-response authentication (wrong or missing secret, replay)."""

    code = 3


class ConfigMismatch(PSError):
    """Trainers disagree on the mode, optimizer, or parameter/table definitions."""

    code = 4


class UnknownKey(PSError):
    """A request named a dense block or sparse table the pserver does not hold."""

    code = 5


class CheckpointError(PSError):
    """A checkpoint is missing, torn, corrupt or does not match the job."""

    code = 6


class CheckpointUnreadable(CheckpointError):
    """A checkpoint that is there but cannot be read (permissions, I/O error): unlike an absent or incomplete
    one, never a reason to start from an older step or from scratch."""


class ConnectionLost(PSError):
    """The connection to a pserver broke (it exited, crashed or dropped us)."""

    code = 7


class RemoteError(PSError):
    """An unexpected failure inside the pserver while serving a request."""

    code = 8


class IntegrityError(ProtocolError):
    """A frame failed its MAC: changed, replayed, reordered, reflected or spliced in by someone on the path."""

    code = 10


class Forbidden(PSError):
    """The request is not allowed to this trainer's role (e.g. SAVE from a trainer other than 0)."""

    code = 11


@dataclass(frozen=True)
class MissingTrainer:
    """A trainer a barrier is still waiting for."""

    trainer_id: int
    last_seen: Optional[float]  # seconds since the pserver last heard from it; None = never

    def describe(self) -> str:
        seen = "never seen" if self.last_seen is None else f"last seen {self.last_seen:.1f} s ago"
        return f"trainer {self.trainer_id} ({seen})"


class BarrierTimeout(PSError):
    """A sync-mode barrier waited longer than ``barrier_timeout``; names the trainers it waited for."""

    code = 9

    def __init__(self, message: str, step: int = -1, pserver_id: int = -1,
                 missing: Optional[List[MissingTrainer]] = None) -> None:
        super().__init__(message)
        self.step = step
        self.pserver_id = pserver_id
        self.missing = list(missing or [])

    @property
    def missing_trainers(self) -> List[int]:
        return [m.trainer_id for m in self.missing]

    def to_wire(self) -> Dict[str, Any]:
        return {
            "message": str(self),
            "step": self.step,
            "pserver_id": self.pserver_id,
            "missing": [[m.trainer_id, m.last_seen] for m in self.missing],
        }


_BY_CODE: Dict[int, Type[PSError]] = {
    cls.code: cls
    for cls in (PSError, ProtocolError, AuthError, ConfigMismatch, UnknownKey, CheckpointError,
                ConnectionLost, RemoteError, BarrierTimeout, IntegrityError, Forbidden)
}


def from_wire(code: int, body: Dict[str, Any]) -> PSError:
    """Rebuild the exception a pserver reported."""
    cls = _BY_CODE.get(code, RemoteError)
    message = str(body.get("message", "pserver error"))
    if cls is BarrierTimeout:
        missing = [MissingTrainer(int(t), None if s is None else float(s)) for t, s in body.get("missing", [])]
        return BarrierTimeout(message, int(body.get("step", -1)), int(body.get("pserver_id", -1)), missing)
    return cls(message)
