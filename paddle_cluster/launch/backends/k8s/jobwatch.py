"""What the cluster says about a job beyond its pods' states: its Jobs' conditions (suspended, failed with a
reason) and the namespace's Events about its objects (pods refused by admission, images being pulled, warnings),
turned into events each once, and whether the cluster holds the job back for a known reason (suspended or queued
for quota room, a pod the scheduler cannot place yet, pulling an image), during which the start timeout waits;
``--pending-timeout`` bounds such a wait, failing the job with the cluster's last word. Pure: the backend feeds
it what kubectl prints."""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from paddle_cluster.node import messages as m

from ..base import Event, JobRefused, Requeued
from .kubectl import PodState, states_of
from .manifests import QUEUE_LABEL

PULL_NOTE_S = 30.0  # a pull still going on is said again this often
_IMAGE = re.compile(r'image "([^"]+)"')


def _took(seconds: float) -> str:
    return f"{seconds / 60:.0f}m" if seconds >= 90 else f"{seconds:.0f}s"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class JobWatch:
    def __init__(self, job_nodes: Dict[str, List[int]], pod_node: Callable[[PodState], Optional[int]],
                 queue: str = "", pending_timeout: Optional[float] = None) -> None:
        self.job_nodes = job_nodes  # the name of each Job of the job -> its nodes
        self.pod_node = pod_node
        self.queue = queue  # --queue: Kueue's LocalQueue
        self.objects: Dict[str, Tuple[str, int]] = {}  # uid -> ("job.batch/NAME" or "pod/NAME", its node)
        self.waiting: Dict[str, Dict[str, Any]] = {}  # Events about objects not known yet, by their name
        self.said: set = set()  # (uid, reason, message) reported
        self.suspended: Dict[str, str] = {}  # Job uid -> what it waits for
        self.queued: Dict[str, str] = {}  # Job uid -> the quota's refusal (its pods are retried)
        self.pulling: Dict[str, Tuple[str, float, float]] = {}  # pod uid -> (image, since, last said)
        self.pull_failed: set = set()  # pod uids whose pull failed: the kubelet's retries are not progress
        self.failed: set = set()
        self.pulls_said: set = set()  # the images whose pull was said (once for the job)
        self.warned: set = set()  # (reason, message) of the warnings said, whichever object they were about
        self.place = 0  # the job's place in its Kueue queue, as last said (1: next)
        self.unschedulable: Dict[str, str] = {}  # pod uid -> the scheduler's message
        self.pending_timeout = pending_timeout
        self.held_since: Optional[float] = None  # since when the cluster holds the job, without a break
        self.last_wait = ""  # the cluster's last word on why it holds the job
        self.evicted = False  # Kueue evicted the job and has not admitted it again yet
        self.evictions = 0
        self.ran: set = set()  # the uids of the Jobs seen not suspended

    def holding(self) -> bool:
        return bool(self.suspended or self.queued or self.pulling or self.unschedulable or self.evicted)

    def _waits(self, why: str) -> str:
        self.last_wait = why
        return why

    def pods(self, docs: Iterable[Dict[str, Any]]) -> List[Event]:
        for d in docs:
            (p,) = states_of([d]) or [None]
            node = None if p is None else self.pod_node(p)
            if node is None or p is None:
                continue
            uid = d["metadata"].get("uid", "")
            self.objects[uid] = (f"pod/{p.name}", node)
            if p.reason.startswith(("ErrImagePull", "ImagePullBackOff")):
                # A pull that fails is no progress, whatever order the Events were read in (a listing gives them
                # by name: its Pulling may come after the Failed that ended it).
                self.pull_failed.add(uid)
                self.pulling.pop(uid, None)
            if p.phase == "Pending" and not p.state and p.reason.startswith("Unschedulable") and not p.deleting:
                self.unschedulable[uid] = self._waits(f"pod/{p.name}: {p.reason}")
            else:
                self.unschedulable.pop(uid, None)
        return self._catch_up()

    def jobs(self, docs: Iterable[Dict[str, Any]]) -> List[Event]:
        out: List[Event] = []
        for d in docs:
            meta = d.get("metadata") or {}
            name, uid = meta.get("name", ""), meta.get("uid", "")
            nodes = self.job_nodes.get(name)
            if not nodes:
                continue
            what = f"job.batch/{name}"
            self.objects[uid] = (what, nodes[0])
            conds = {c.get("type"): c for c in (d.get("status") or {}).get("conditions") or []
                     if c.get("status") == "True"}
            # Suspended again after it ran: Kueue evicted the job, which its Workload's line says for the whole job.
            if "Suspended" in conds and uid not in self.suspended:
                queue = (meta.get("labels") or {}).get(QUEUE_LABEL) or self.queue
                self.suspended[uid] = why = (f"waiting for Kueue queue {queue} to admit it" if queue else
                                             "spec.suspend is true: it runs once resumed")
                if uid not in self.ran:
                    self._waits(f"{what} is suspended ({why})")
                    out.append(m.Note(nodes[0], f"{what} is suspended ({why}); the start timeout waits meanwhile"))
            elif "Suspended" not in conds:
                self.ran.add(uid)
                if uid in self.suspended:
                    del self.suspended[uid]
                    if not self.evictions:
                        out.append(m.Note(nodes[0], f"{what} was admitted (resumed): its pods are created"))
            for kind in ("FailureTarget", "Failed"):
                c = conds.get(kind)
                if c is None or uid in self.failed:
                    continue
                self.failed.add(uid)
                why = f"{what} failed: {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
                # A pod that failed fails its Job (BackoffLimitExceeded): that pod's exit tells more.
                out.append(m.Note(nodes[0], why) if c.get("reason") == "BackoffLimitExceeded" else JobRefused(why))
        return out + self._catch_up()

    def queued_for(self) -> str:
        """The Kueue queue a suspended Job of the job waits in, if any: where to ask for its place in line."""
        return self.queue if any(w.startswith("waiting for Kueue") for w in self.suspended.values()) else ""

    def in_line(self, summary: Dict[str, Any], owners: Iterable[str]) -> List[Event]:
        """Kueue's ``PendingWorkloadsSummary`` of the queue -> ``waiting for Kueue queue q: 3rd in line`` once per
        place the job's workload (the one ``owners`` own) takes, as those before it are admitted."""
        names = set(owners)
        for w in summary.get("items") or []:
            if any(r.get("name") in names for r in (w.get("metadata") or {}).get("ownerReferences") or []):
                place = int(w.get("positionInLocalQueue", 0)) + 1
                if place == self.place:
                    return []
                self.place = place
                self._waits(f"waiting for Kueue queue {self.queue}: {_ordinal(place)} in line")
                node = next(iter(self.job_nodes.values()))[0]
                return [m.Note(node, f"waiting for Kueue queue {self.queue}: {_ordinal(place)} in line")]
        return []

    def workloads(self, docs: Iterable[Dict[str, Any]], owners: Iterable[str]) -> List[Event]:
        """Kueue's verdict on the job, from the conditions of its Workload (the one ``owners`` own): a queue that
        does not exist (``Inadmissible``) or a request no flavor can ever fit (``request > maximum capacity``) fail
        the job in one line; waiting for unused quota is said once and waited for; an eviction (preemption) is said
        once with Kueue's reason and takes the job back (``Requeued``: its pods were stopped), and its admission
        again once."""
        names, out = set(owners), []
        node = next(iter(self.job_nodes.values()))[0]
        for w in docs:
            meta = w.get("metadata") or {}
            if not any(r.get("name") in names for r in meta.get("ownerReferences") or []):
                continue
            what = f"workload.kueue.x-k8s.io/{meta.get('name', '')}"
            conds = {c.get("type"): c for c in (w.get("status") or {}).get("conditions") or []}
            reserved, evicted = conds.get("QuotaReserved") or {}, conds.get("Evicted") or {}
            queue = (w.get("spec") or {}).get("queueName") or self.queue
            said = (meta.get("uid"), reserved.get("reason"), evicted.get("status"))
            admitted = (conds.get("Admitted") or {}).get("status") == "True"
            if evicted.get("status") == "True" and not admitted:
                if not self.evicted:
                    self.evicted, self.evictions = True, self.evictions + 1
                    why = f"{evicted.get('reason', '')}: {evicted.get('message', '')}"
                    out += [m.Note(node, f"Kueue evicted the job ({what}): {why}; its pods are stopped, and it "
                                         f"waits to be admitted again to queue {queue}"), Requeued(why)]
                self._waits(f"Kueue evicted the job ({what}) and has not admitted it again: "
                            f"{reserved.get('message') or evicted.get('message', '')}")
            elif self.evicted and admitted:
                self.evicted = False
                out.append(m.Note(node, f"Kueue admitted the job again ({what}): its pods are created"))
            elif reserved.get("status") == "False":
                message = reserved.get("message", "")
                never = reserved.get("reason") == "Inadmissible" or "maximum capacity" in message
                if never and said not in self.said:
                    self.said.add(said)
                    out.append(JobRefused(f"Kueue cannot admit the job to queue {queue} ({what}): {message}"))
                elif not never:
                    self._waits(f"Kueue queue {queue}: {message}")
                    if said not in self.said:
                        self.said.add(said)
                        out.append(m.Note(node, f"Kueue queue {queue}: {message}"))
        return out

    def events(self, docs: Iterable[Dict[str, Any]]) -> List[Event]:
        out: List[Event] = []
        for e in docs:
            if (e.get("involvedObject") or {}).get("uid") in self.objects:
                out += self._event(e)
            elif len(self.waiting) < 1000:  # maybe about a pod or Job this watch has not seen yet
                self.waiting[(e.get("metadata") or {}).get("name", "")] = e
        return out

    def _catch_up(self) -> List[Event]:
        known = [k for k, e in self.waiting.items() if e["involvedObject"].get("uid") in self.objects]
        return [ev for k in known for ev in self._event(self.waiting.pop(k))]

    def _event(self, e: Dict[str, Any]) -> List[Event]:
        uid = e["involvedObject"]["uid"]
        what, node = self.objects[uid]
        reason, message = e.get("reason", ""), (e.get("message") or "").strip()
        key = (uid, reason, message)
        if key in self.said:
            return []
        self.said.add(key)
        if reason == "Pulling" and uid in self.pull_failed:
            return []
        if reason == "Pulling":
            image = (_IMAGE.search(message) or [None, "?"])[1]
            now = time.monotonic()
            said = image in self.pulls_said  # by another pod: said once
            self.pulls_said.add(image)
            self.pulling[uid] = (image, now, now)
            self._waits(f"{what}: pulling image {image}")
            return [] if said else [m.Note(node, f"{what}: pulling image {image}; the start timeout waits meanwhile")]
        if reason in ("Pulled", "Failed", "ErrImagePull", "BackOff") and uid in self.pulling:
            image, since, _ = self.pulling.pop(uid)
            if reason == "Pulled":  # the kubelet's "Successfully pulled image ... in 2m3.5s ..."
                return [m.Note(node, f"{what}: {message}")]
        if reason == "SuccessfulCreate":
            self.queued.pop(uid, None)
            return []
        if reason == "FailedCreate":
            why = message.removeprefix("Error creating: ")
            if "exceeded quota" in why:  # room may come: the Job controller retries
                self.queued[uid] = why
                self._waits(f"{what} waits for room in the namespace's quota: {why}")
                return [m.Note(node, f"{what} waits for room in the namespace's quota: {why}")]
            return [JobRefused(f"{what} cannot create its pods: {why}")]
        if e.get("type") == "Warning" and reason != "FailedScheduling":  # (the pod's state says that one)
            # A pod's waiting state says its reason (ErrImagePull with the registry's word, ImagePullBackOff, a
            # CreateContainerConfigError): the kubelet's echoes of it, and a warning said of another pod, are not
            # said again.
            if message.startswith(("Error: ", "Failed to pull image")) or (reason, message) in self.warned:
                return []
            self.warned.add((reason, message))
            return [m.Note(node, f"{what}: {reason}: {message}")]
        return []

    def due(self) -> List[Event]:
        """A pull still going on, said again every ``PULL_NOTE_S``: ``pulling image ... for 2m``; the job failed
        once the cluster has held it for ``pending_timeout`` s without a break."""
        out: List[Event] = []
        now = time.monotonic()
        if not self.holding():
            self.held_since = None
        elif self.held_since is None:
            self.held_since = now
        elif self.pending_timeout is not None and now - self.held_since > self.pending_timeout:
            limit, self.pending_timeout = self.pending_timeout, None  # said once
            out.append(JobRefused(f"the cluster held the job for {limit:g} s (--pending-timeout): {self.last_wait}"))
        for uid, (image, since, said) in list(self.pulling.items()):
            if now - said >= PULL_NOTE_S:
                self.pulling[uid] = (image, since, now)
                what, node = self.objects[uid]
                out.append(m.Note(node, f"{what}: pulling image {image} for {_took(now - since)}"))
        return out
