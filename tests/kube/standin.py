"""The ``kube`` fixtures' cluster: the stand-in's API server and controller (``__init__.py``) over a
tests/sshcluster.py cluster (a node per host; each node's ``PODS_PER_NODE`` pod sandboxes are bare network
namespaces on the same bridge, so every pod has its own address, as a CNI gives it), and ``KUBECONFIG`` naming
it for the real ``kubectl`` (``env``; ``kubeconfig(deny)`` for a user denied some rights). The image ``IMAGE`` is
this checkout on PYTHONPATH with this interpreter as ``python3`` (and a non-root user, as a hardened image
has); ``BARE_IMAGE`` has Python but no paddle-cluster."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from sshstate import _netns_pids

from .store import Store

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
IMAGE = "registry.example/paddle/fit:1"
SLOW_IMAGE = "registry.example/paddle/fit:2"  # the same, but a node's first pull of it takes PULL_S
PULL_S = 4
GPU_PULL_IMAGE = "registry.example/paddle/fit:3"  # the same, but its first pull on the GPU node takes GPU_PULL_S
GPU_PULL_S = 8  # twice the START_TIMEOUT (4 s) its test sets: the trainers wait past it
BARE_IMAGE = "registry.example/python:3.11"
# Pods a node holds (a kubelet's maxPods, 110 by default): enough for the conformance suite's three jobs of four
# pods at once on the fixture's 4 nodes with room to spare; each sandbox costs ~25 ms to set up.
PODS_PER_NODE = 5
GPU = "nvidia.com/gpu"
QUEUE = "q"  # the Kueue LocalQueue of the stand-in
IMAGE_USER = 1000  # the images' USER, and the pods' runAsUser by default (--run-as-user)
NFS_CLAIM = "nfs"  # a claim whose storage ignores fsGroup (NFS): its root directory stays root's, 0755


class StandIn:
    def __init__(self, cluster, root: Path) -> None:
        self.cluster, self.root = cluster, root
        root.mkdir(parents=True)
        imagebin, barebin = root / "image-bin", root / "bare-bin"
        for d in (imagebin, barebin):
            d.mkdir()
        # Python without site-packages: no numpy, no paddle-cluster.
        (barebin / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
        (barebin / "python3").chmod(0o755)
        (imagebin / "python3").symlink_to(sys.executable)
        image_env = {"PATH": f"{imagebin}:/usr/bin:/bin", "HOME": "/tmp"}
        self.sandboxes = cluster.add_bare_hosts(PODS_PER_NODE * cluster.n)
        (root / "cluster.json").write_text(json.dumps({
            # worker-0 is a GPU node, tainted as GPU nodes are: only pods tolerating the taint go there.
            "nodes": [{"name": f"worker-{i}", "netns": cluster.netns(i), "ip": cluster.ips[i],
                       "labels": {"kubernetes.io/hostname": f"worker-{i}", "pool": "gpu" if i == 0 else "cpu"},
                       "allocatable": {"cpu": "8", "memory": "16Gi", **({GPU: "2"} if i == 0 else {})},
                       "taints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}] if i == 0 else [],
                       "pods": [{"netns": ns, "ip": ip}
                                for ns, ip in self.sandboxes[i * PODS_PER_NODE:(i + 1) * PODS_PER_NODE]]}
                      for i in range(cluster.n)],
            "images": {IMAGE: {"env": {**image_env, "PYTHONPATH": str(REPO)}, "user": IMAGE_USER},
                       SLOW_IMAGE: {"env": {**image_env, "PYTHONPATH": str(REPO)}, "user": IMAGE_USER,
                                    "pull_s": PULL_S},
                       GPU_PULL_IMAGE: {"env": {**image_env, "PYTHONPATH": str(REPO)}, "user": IMAGE_USER,
                                        "pull_s": {"worker-0": GPU_PULL_S}},
                       BARE_IMAGE: {"env": {**image_env, "PATH": f"{barebin}:/usr/bin:/bin"}, "user": IMAGE_USER}},
            "dns": cluster.gateway,
            # Kueue's queues (LocalQueue -> the CPUs its ClusterQueue lends): one job of 3 pods of 1 CPU at a time.
            "queues": {QUEUE: "4"},
            "claims": {NFS_CLAIM: {"fsGroup": False}}}))
        self.store = Store(root)
        self.setup_keys: set = set()
        self.controller = subprocess.Popen([sys.executable, "-m", "kube", "controller", str(root)],
                                           cwd=TESTS, stdin=subprocess.DEVNULL,
                                           stdout=open(root / "controller.log", "wb"), stderr=subprocess.STDOUT)
        # The API server the real kubectl (on PATH: scripts/test installs it) talks to, through a kubeconfig.
        port = root / "apiserver.port"
        self.apiserver = subprocess.Popen([sys.executable, "-m", "kube", "apiserver", str(root),
                                           str(port)], cwd=TESTS, stdin=subprocess.DEVNULL,
                                          stdout=open(root / "apiserver.log", "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (port.exists() and port.read_text()):
            assert self.apiserver.poll() is None and time.monotonic() < deadline, (root / "apiserver.log").read_text()
            time.sleep(0.02)
        self.server = f"http://127.0.0.1:{port.read_text()}"
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig()), "KUBECACHEDIR": str(root / "kubecache")}

    def kubeconfig(self, deny: str = "") -> Path:
        """A kubeconfig naming the API server and a user of its own, denied what ``deny`` lists (``"create
        jobs.batch,get pods/log"``), as RBAC would deny it: in ``auth can-i`` and in every request."""
        user = f"user-{secrets.token_hex(4)}"  # (kubectl sends no token over plain HTTP: the user it impersonates)
        users = self.root / "users.json"
        known = json.loads(users.read_text()) if users.exists() else {}
        known[user] = [d.strip() for d in deny.split(",") if d.strip()]
        users.write_text(json.dumps(known))
        path = self.root / f"kubeconfig-{user}"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.server}}],
            "users": [{"name": "user", "user": {"as": user}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "user"}}]}))
        return path

    def kubectl(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(["kubectl", *args], input=stdin, env=self.env, capture_output=True, text=True,
                              timeout=120)

    def objects(self, kind: str = "", ns: str = "") -> Dict[str, Dict[str, Any]]:
        """``kind/ns/name`` -> object, of ``kind`` in ``ns`` (all when empty); Events only when asked for (a cluster
        keeps them an hour after their objects are gone) and never the cluster's own objects (those ``setup``
        made)."""
        return {k: v for k, v in self.store.read()["objects"].items()
                if k.startswith(f"{kind}/{ns}/" if ns else kind) and (kind == "Event" or not k.startswith("Event/"))
                and k not in self.setup_keys}

    def setup(self, manifests: str) -> None:
        """Create what a cluster's admin would (ServiceAccounts, PriorityClasses, ResourceQuotas)."""
        import yaml

        res = self.kubectl("create", "--filename", "-", stdin=manifests)
        assert res.returncode == 0, res.stderr
        for d in yaml.safe_load_all(manifests):
            ns = "" if d["kind"] == "PriorityClass" else d["metadata"].get("namespace", "default")
            self.setup_keys.add(f"{d['kind']}/{ns}/{d['metadata']['name']}")

    def events(self, ns: str = "default") -> List[str]:
        """``kind/name: reason: message`` of each Event recorded."""
        return [f"{e['involvedObject']['kind']}/{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                for e in self.objects("Event", ns).values()]

    def pods(self, ns: str = "default") -> List[Dict[str, Any]]:
        return list(self.objects("Pod", ns).values())

    def wait(self, cond, seconds: float, what: str):
        deadline = time.monotonic() + seconds
        while True:
            got = cond()
            if got:
                return got
            assert self.controller.poll() is None, (self.root / "controller.log").read_text()
            assert time.monotonic() < deadline, f"no {what} within {seconds} s: {self.objects()}"
            time.sleep(0.05)

    def processes(self) -> List[int]:
        """The pods' processes still alive on the nodes and in their sandboxes."""
        return [pid for i in range(self.cluster.n) for pid in self.cluster.pids(i)] + [
            pid for ns, _ in self.sandboxes for pid in _netns_pids(ns) if Path(f"/proc/{pid}").exists()]

    def dns_fault(self, mode: str, seconds: float) -> None:
        """The cluster DNS fails on purpose for ``seconds``: ``servfail`` (EAI_AGAIN in the pods) or ``drop``."""
        from .dns import fault

        fault(self.root, mode, seconds)

    def expire_watches(self) -> None:
        """The API server ends every watch open now with 410 Expired, as after compacting its history."""
        from .apiserver import expire_watches

        expire_watches(self.root)

    def close(self) -> None:
        self.apiserver.terminate()
        self.apiserver.wait(timeout=30)
        self.controller.terminate()
        self.controller.wait(timeout=30)
