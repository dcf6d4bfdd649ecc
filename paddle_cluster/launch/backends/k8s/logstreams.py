"""The job's pods' output as ``run`` follows it: one ``kubectl logs --follow --prefix`` per batch of pods that
started together (a set-based selector on their role and completion indexes), not one process per pod -- a job of
a hundred pods runs a handful of kubectl processes, each following its pods over the API server's log streams.

Each line is ``[pod/NAME/CONTAINER] text``: the pod names it, the copy of its log is kept (``pods.followed_copy``)
and its events put. A pod's entry point ends its log with an ``END`` line, so the caller knows when a pod's last
lines have been read (``wait_read``) without the stream, shared with other pods, having ended.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from typing import Callable, Dict, List, Optional, TextIO, Tuple

from paddle_cluster.node import messages as m
from paddle_cluster.node import pod as pod_entry

from ...errors import ClusterError
from ..base import Event
from . import pods
from .kubectl import Kubectl, log_events

BATCH_S = 0.5  # pods that start within this of each other share a stream (a Job starts its pods together)
_PREFIXED = re.compile(r"^\[pod/([^/\]]+)/[^\]]*\] ?(.*)$")


class LogStreams:
    def __init__(self, kubectl: Kubectl, job_dir: str, put: Callable[[Event], None],
                 readied: Callable[[int], None]) -> None:
        self.kubectl, self.job_dir, self.put, self.readied = kubectl, job_dir, put, readied
        self.pods: Dict[str, Tuple[int, str]] = {}  # pod name -> (node, process name)
        self.done: Dict[int, threading.Event] = {}  # node -> its log read to its END line (or its stream ended)
        self.first: set = set()  # pods a line was read of
        self.pending: List[Tuple[str, str, int]] = []  # (pod, role word, completion index) not followed yet
        self.procs: List[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.reading = threading.Lock()
        self.wake = threading.Event()
        self.closed = False
        threading.Thread(target=self._batches, daemon=True, name="k8s-logs").start()

    def follow(self, node: int, pod: str, proc: str, role: str, index: int) -> None:
        """Follow ``pod`` (node ``node``, process ``proc``), once; its stream starts with the next batch."""
        with self.lock:
            if pod in self.pods or self.closed:
                return
            self.pods[pod] = (node, proc)
            self.done[node] = threading.Event()
            self.pending.append((pod, role, index))
        self.wake.set()

    def wait_read(self, node: int, timeout: float) -> None:
        """Until ``node``'s pod's log has been read to its end (its last lines are then the caller's). A pod its
        stream gave nothing of (kubectl could not open its log when the stream began) is read once, whole."""
        done = self.done.get(node)
        if done is None:
            return
        done.wait(timeout)
        pod = next((name for name, (n, _) in self.pods.items() if n == node), "")
        if pod and pod not in self.first and not self.closed:
            try:
                text = self.kubectl.run(self.kubectl.logs(pod, follow=False), timeout=60)
            except ClusterError as e:
                self.put(m.Note(node, f"kubectl logs pod/{pod}: {e}"))
                return
            self._lines(pod, text.splitlines(), None)

    def _batches(self) -> None:
        while not self.closed:
            self.wake.wait()
            if self.closed:
                return
            threading.Event().wait(BATCH_S)
            with self.lock:
                batch, self.pending = self.pending, []
                self.wake.clear()
            by_role: Dict[str, List[Tuple[str, int]]] = {}
            for pod, role, index in batch:
                by_role.setdefault(role, []).append((pod, index))
            for role, members in by_role.items():
                self._stream(role, members)

    def _stream(self, role: str, members: List[Tuple[str, int]]) -> None:
        argv = self.kubectl.logs_of(role, [i for _, i in members])
        with self.lock:
            if self.closed:
                return
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, errors="replace")
            self.procs.append(p)
        threading.Thread(target=self._read, args=(p, [pod for pod, _ in members]), daemon=True,
                         name=f"logs-{role}").start()

    def _read(self, p: subprocess.Popen, members: List[str]) -> None:
        assert p.stdout is not None and p.stderr is not None
        os.makedirs(os.path.join(self.job_dir, "log"), exist_ok=True)
        copies = {pod: open(pods.followed_copy(self.job_dir, pod), "a", encoding="utf-8") for pod in members}
        try:
            for raw in p.stdout:
                got = _PREFIXED.match(raw.rstrip("\n"))
                if got is not None and got.group(1) in copies:
                    self._lines(got.group(1), [got.group(2)], copies[got.group(1)])
        finally:
            for f in copies.values():
                f.close()
            err = p.stderr.read().strip()
            code = p.wait()
            for pod in members:  # the stream ended: nothing more of its pods will come
                self.done[self.pods[pod][0]].set()
            if code != 0 and err and not self.closed:
                self.put(m.Note(self.pods[members[0]][0], f"kubectl logs of {', '.join(f'pod/{x}' for x in members)}"
                                                          f": {err.splitlines()[-1]}"))

    def _lines(self, pod: str, lines: List[str], copy: Optional[TextIO]) -> None:
        """Lines of ``pod``'s log: kept (``copy``), their events put, its END noted."""
        node, proc = self.pods[pod]
        with self.reading:  # a pod's lines come from its stream, or once from wait_read: never both at once
            for line in lines:
                if copy is not None:
                    copy.write(line + "\n")
                    copy.flush()
                if pod not in self.first:
                    self.first.add(pod)
                    if pods.began_rotated([line]):  # followed late: its process ran, the kubelet rotated
                        self.readied(node)
                        self.put(m.Note(node, f"pod/{pod}: the beginning of its log was rotated away on its node "
                                              "before it was followed"))
                for ev in log_events(node, proc, line):
                    if isinstance(ev, (m.Ready, m.NotReady)):
                        self.readied(node)
                    self.put(ev)
                if line.startswith(pod_entry.END):
                    self.done[node].set()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            procs = list(self.procs)
        self.wake.set()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
