"""The one primitive over nodes: run a function on every node at once and keep every result *and*
every exception, in node order."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Generic, List, Sequence, TypeVar

from .errors import HostsFailed

if TYPE_CHECKING:
    from .hosts import Node

T = TypeVar("T")


@dataclass
class NodeResults(Generic[T]):
    """Every node's value or exception, in node order. Nothing is dropped."""

    values: Dict[int, T]
    errors: Dict[int, BaseException]
    labels: Dict[int, str]

    def ok(self, what: str) -> List[T]:
        """The values in node order, or ``HostsFailed`` listing every failed host."""
        if self.errors:
            raise HostsFailed(what, {self.labels[i]: e for i, e in sorted(self.errors.items())})
        return [self.values[i] for i in sorted(self.values)]


class NodesInterrupted(KeyboardInterrupt):
    """Ctrl+C while ``each_node`` waited. Every node still at work then was aborted (``Node.abort``);
    ``unanswered``: those that were waited on (a node's label -> what was awaited of it)."""

    def __init__(self, unanswered: Dict[str, List[str]]) -> None:
        super().__init__()
        self.unanswered = unanswered

    def lines(self) -> List[str]:
        """One sentence per node that had not answered, for the user."""
        return [f"{label} had not answered ({', '.join(what)}): what it ran for the job there was killed"
                for label, what in self.unanswered.items()]


def each_node(nodes: Sequence[Node], fn: Callable[[Node], T], max_workers: int = 32) -> NodeResults[T]:
    """Run ``fn(node)`` on every node concurrently; collect each value or exception. A Ctrl+C meanwhile aborts
    every node still at work and raises ``NodesInterrupted`` once each one's work has ended."""
    values: Dict[int, T] = {}
    errors: Dict[int, BaseException] = {}
    if not nodes:
        return NodeResults(values, errors, {})
    interrupted = False
    unanswered: Dict[str, List[str]] = {}
    with ThreadPoolExecutor(max_workers=min(max_workers, len(nodes)), thread_name_prefix="each_node") as pool:
        futures = {n.index: pool.submit(fn, n) for n in nodes}
        for i, fut in futures.items():
            while True:
                try:
                    values[i] = fut.result()
                except BaseException as e:  # noqa: B036 - a fan-out must never drop a host's failure
                    if isinstance(e, KeyboardInterrupt) and not (fut.done() and fut.exception() is e):
                        # Ctrl+C reached this thread while it waited: the user's, not this node's failure
                        # ("unexpected error: KeyboardInterrupt" on node0, exit 1). A node still at work may wait
                        # for something that never comes (a login script, a PYTHON wrapper, a hung sshd): what it
                        # waits on is ended now, so every node's work ends here within moments, then the
                        # interrupt goes on to the command.
                        if not interrupted:
                            unanswered = _abort([n for n in nodes if not futures[n.index].done()])
                        interrupted = True
                        continue
                    errors[i] = e
                break
    if interrupted:
        raise NodesInterrupted(unanswered)
    return NodeResults(values, errors, {n.index: n.label for n in nodes})


def _abort(nodes: Sequence[Node]) -> Dict[str, List[str]]:
    """``Node.abort`` on every one of ``nodes`` at once (one may wait on its network), through the same fan-out;
    what was awaited of each."""
    done = each_node(nodes, lambda n: n.abort())
    return {n.label: done.values[n.index] for n in nodes if done.values.get(n.index)}
