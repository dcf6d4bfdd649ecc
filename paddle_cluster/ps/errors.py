"""Typed errors of the parameter-server runtime.

Every error a pserver reports to a trainer travels as an ERROR frame carrying a status code and a small
JSON body; ``from_wire`` turns it back into the same exception class on the trainer side, so callers can
``except BarrierTimeout`` instead of parsing strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Type

_BY_CODE: Dict[int, Type[PSError]] = {}


class PSError(Exception):
    """Base class of every runtime error. A kind declares its status code on the wire in its class line
    (``class UnknownKey(PSError, code=5)``); a kind without one travels as its parent."""

    code = 1
    said = False  # the pserver said it (an ERROR frame, ``from_wire``): its reason beats what a send then met

    def __init_subclass__(cls, code: Optional[int] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            if code in _BY_CODE:
                raise TypeError(f"status code {code} is {_BY_CODE[code].__name__}'s already")
            cls.code = code
            _BY_CODE[code] = cls

    def to_wire(self) -> Dict[str, Any]:
        return {"message": str(self)}


_BY_CODE[PSError.code] = PSError


class ProtocolError(PSError, code=2):
    """A malformed, oversized, truncated or out-of-order frame."""


class AuthError(PSError, code=3):
    """The peer failed the challenge-response authentication (wrong or missing secret, replay)."""


class ConfigMismatch(PSError, code=4):
    """Trainers disagree on the mode, optimizer, or parameter/table definitions."""


class UnknownKey(PSError, code=5):
    """A request named a dense block or sparse table the pserver does not hold."""


class CheckpointError(PSError, code=6):
    """A checkpoint is missing, torn, corrupt or does not match the job."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint that is there but cannot be read (permissions, I/O error): unlike an absent or incomplete
    one, never a reason to start from an older step or from scratch."""


class ConnectionLost(PSError, code=7):
    """The connection to a pserver broke (it exited, crashed or dropped us)."""


class RemoteError(PSError, code=8):
    """An unexpected failure inside the pserver while serving a request."""


class IntegrityError(ProtocolError, code=10):
    """A frame failed its MAC: changed, replayed, reordered, reflected or spliced in by someone on the path."""


class Forbidden(PSError, code=11):
    """The request is not allowed to this trainer's role (e.g. SAVE from a trainer other than 0)."""


class LimitExceeded(PSError, code=12):
    """A request would make a pserver hold more than declared: a sparse id outside its table's id space, rows
    past the table's row budget, or memory past the pserver's budget (``PADDLE_PSERVER_MEMORY``)."""


class NonFinite(PSError, code=13):
    """A pushed gradient holds NaN or Inf, or an update, an initial value or a table's initial scale would make a
    parameter do so (refused unless ``PADDLE_ALLOW_NONFINITE=1``; an initial scale always)."""


@dataclass(frozen=True)
class MissingTrainer:
    """A trainer a barrier is still waiting for."""

    trainer_id: int
    last_seen: Optional[float]  # seconds since the pserver last heard from it; None = never

    def label(self) -> str:
        seen = "never seen" if self.last_seen is None else f"last seen {self.last_seen:.1f} s ago"
        return f"trainer {self.trainer_id} ({seen})"


class BarrierTimeout(PSError, code=9):
    """A sync-mode barrier waited longer than ``barrier_timeout``; names the trainers it waited for."""

    def __init__(self, message: str, step: int = -1, pserver_id: int = -1,
                 missing: Optional[List[MissingTrainer]] = None, again: bool = False) -> None:
        super().__init__(message)
        self.again = again  # the same trainers' timeout as an earlier barrier's (logged once, by that one)
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


def from_wire(code: int, body: Dict[str, Any]) -> PSError:
    """Rebuild the exception a pserver reported."""
    cls = _BY_CODE.get(code, RemoteError)
    message = str(body.get("message", "pserver error"))
    e: PSError
    if cls is BarrierTimeout:
        missing = [MissingTrainer(int(t), None if s is None else float(s)) for t, s in body.get("missing", [])]
        e = BarrierTimeout(message, int(body.get("step", -1)), int(body.get("pserver_id", -1)), missing)
    else:
        e = cls(message)
    e.said = True
    return e
