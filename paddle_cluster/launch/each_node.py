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


def each_node(nodes: Sequence[Node], fn: Callable[[Node], T], max_workers: int = 32) -> NodeResults[T]:
    """Run ``fn(node)`` on every node concurrently; collect each value or exception."""
    values: Dict[int, T] = {}
    errors: Dict[int, BaseException] = {}
    if not nodes:
        return NodeResults(values, errors, {})
    interrupted = False
    with ThreadPoolExecutor(max_workers=min(max_workers, len(nodes)), thread_name_prefix="each_node") as pool:
        futures = {n.index: pool.submit(fn, n) for n in nodes}
        for i, fut in futures.items():
            while True:
                try:
                    values[i] = fut.result()
                except BaseException as e:  # noqa: B036 - a fan-out must never drop a host's failure
                    if isinstance(e, KeyboardInterrupt) and not (fut.done() and fut.exception() is e):
                        # Ctrl+C reached this thread while it waited: the user's, not this node's failure
                        # ("unexpected error: KeyboardInterrupt" on node0, exit 1). Every node's work still ends
                        # here, then the interrupt goes on to the command.
                        interrupted = True
                        continue
                    errors[i] = e
                break
    if interrupted:
        raise KeyboardInterrupt
    return NodeResults(values, errors, {n.index: n.label for n in nodes})
