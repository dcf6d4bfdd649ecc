"""The in-pod entry point (``python -m paddle_cluster.node pod``) run as real processes with what the rendered
manifests give each container, and fit_a_line trained to its target by 2 pserver pods and 2 trainer pods.

What is real: the rendered documents (validated as in test_k8s_render), the processes, each pod's own network
namespace with its own address (one host of tests/sshcluster.py per pod, so all pservers use the same port as
on Kubernetes), hostname and job-dir volume, TCP between pods by name, and the container's command, args,
workingDir and environment taken from the manifests (the Secret reference resolved against the rendered
Secret). What is simulated, as a kubelet and the cluster would do it: the completion index and hostname the
Job controller gives each pod, the cluster DNS (each pod's /etc/hosts maps every pod's stable name to its
address, as CoreDNS would answer for the headless Service), and the image (this checkout on PYTHONPATH, this
interpreter as ``python3``, a copy of the example as the workspace).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml
from k8s_job import k8s_job
from kube.validate import env_of, problems
from rt_helpers import free_port_range

from paddle_cluster.launch.backends.k8s import manifests as k8s
from paddle_cluster.launch.backends.k8s.backend import log_events
from paddle_cluster.launch.config import parse_config
from paddle_cluster.node import messages as m

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fit_a_line"


class Pod:
    """One pod of an Indexed Job as a real process in a host of the cluster, started from its manifest."""

    def __init__(self, job: Dict[str, Any], index: int, secret: Dict[str, Any], host: int, cluster, tmp: Path):
        self.job, self.index, self.host, self.cluster = job, index, host, cluster
        self.spec = job["spec"]["template"]["spec"]
        (self.container,) = self.spec["containers"]
        self.hostname = f"{job['metadata']['name']}-{index}"  # what the Job controller sets for an Indexed Job
        self.fqdn = f"{self.hostname}.{self.spec['subdomain']}.{job['metadata']['namespace']}.svc"
        self.address = cluster.ips[host]
        self.dir = tmp / self.hostname
        self.dir.mkdir()
        self.log = self.dir / "output.log"
        self.volume = self.dir / "job-dir"  # its emptyDir
        self.volume.mkdir()
        self.secret = secret
        self.proc: subprocess.Popen | None = None

    def environ(self) -> Dict[str, str]:
        """The container's environment: its env entries (literal values only: the secret is a file), then what
        Kubernetes and the image add."""
        env: Dict[str, str] = {e["name"]: e["value"] for e in self.container["env"]}
        env.update({"JOB_COMPLETION_INDEX": str(self.index), "HOSTNAME": self.hostname,
                    # the image: python3 with numpy, paddle_cluster installed
                    "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHONPATH": str(REPO)})
        return env

    def start(self, pods: List[Pod]) -> None:
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{p.address} {p.fqdn} {p.fqdn}.cluster.local" + (f" {p.hostname}" if p is self else "") + "\n"
            for p in pods))
        mount = self.container["volumeMounts"][0]["mountPath"]
        assert self.spec["volumes"][0] == {"name": self.container["volumeMounts"][0]["name"], "emptyDir": {}}
        Path(mount).mkdir(parents=True, exist_ok=True)
        # The Secret's volume: its keys as files, as the kubelet writes them.
        (vol,) = [v for v in self.spec["volumes"] if "secret" in v]
        assert vol["secret"]["secretName"] == self.secret["metadata"]["name"]
        (secret_mount,) = [m["mountPath"] for m in self.container["volumeMounts"] if m["name"] == vol["name"]]
        files = self.dir / "secret"
        files.mkdir()
        for item in vol["secret"]["items"]:
            (files / item["path"]).write_text(self.secret["stringData"][item["key"]])
            os.chmod(files / item["path"], vol["secret"]["defaultMode"])
        Path(secret_mount).mkdir(parents=True, exist_ok=True)
        argv = [*self.container["command"], *self.container["args"]]
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in self.environ().items())
        script = (f"hostname {self.hostname} && mount --bind {hosts} /etc/hosts && "
                  f"mount --bind {self.volume} {shlex.quote(mount)} && mount --bind {files} {shlex.quote(secret_mount)}"
                  f" && cd {shlex.quote(self.container['workingDir'])} && exec env -i {env} {shlex.join(argv)}")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.cluster.netns(self.host)}", "--", "unshare", "--mount",
                 "--uts", "--propagation", "private", "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, seconds: float) -> re.Match:
        deadline = time.monotonic() + seconds
        while True:
            m = re.search(pattern, self.output(), re.M)
            if m:
                return m
            assert self.proc is not None
            assert self.proc.poll() is None, f"{self.hostname} exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"{self.hostname}: no {pattern!r} within {seconds} s:\n{self.output()}"
            time.sleep(0.05)


def rendered(tmp: Path, port: int) -> List[Dict[str, Any]]:
    workspace = tmp / "image" / "workspace"
    shutil.copytree(EXAMPLE, workspace, ignore=shutil.ignore_patterns("log", "output", "__pycache__"))
    cfg = parse_config({"HOSTS": ["a", "b"], "ROOT_DIR": str(tmp / "root"), "PADDLE_PORT": port,
                        "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 1, "START_TIMEOUT": 60}, "test")
    job = k8s_job(cfg, job_name="fit", image="registry.example/fit:1", namespace="ml", workspace=str(workspace),
                    trainer_args=("--passes", "5"))
    docs = list(yaml.safe_load_all(k8s.render(job)))
    assert problems(docs) == []
    return docs


@pytest.fixture
def pods_cluster(make_ssh_cluster):
    cluster = make_ssh_cluster(4)
    yield cluster
    for i in range(cluster.n):
        cluster.kill_all(i)


def test_fit_a_line_in_pods_2x2(pods_cluster, tmp_path: Path) -> None:
    secret, _svc, ps_job, tr_job = rendered(tmp_path, free_port_range(2))
    pservers = [Pod(ps_job, i, secret, i, pods_cluster, tmp_path) for i in range(ps_job["spec"]["completions"])]
    trainers = [Pod(tr_job, i, secret, 2 + i, pods_cluster, tmp_path) for i in range(tr_job["spec"]["completions"])]
    every = pservers + trainers
    try:
        # Trainers first: they must wait for the pservers by name, not fail.
        for p in trainers:
            p.start(every)
        for p in trainers:
            p.wait_for(r"waiting for 2 pserver\(s\) to listen", 30)
        for p in pservers:
            p.start(every)
        for i, p in enumerate(pservers):
            # The pserver bound its stable name, which resolves to its own pod's address.
            p.wait_for(rf"^PSERVER_READY {i} fit-pserver-{i}\.fit\.ml\.svc \d+,\d+$", 60)
        # The entry point read the secret from the Secret's file: no pod's entry point holds it in its environment
        # (/proc/<pid>/environ, readable by every process of the pod's user), a trainer's process not either.
        job_secret = secret["stringData"][k8s.SECRET_KEY].encode()
        for p in every:
            assert p.proc is not None
            p.wait_for(r"ready: (pserver|trainer) \d+: .*; starting", 30)
            assert job_secret not in Path(f"/proc/{p.proc.pid}/environ").read_bytes(), p.hostname
            kids: List[str] = []
            until = time.monotonic() + 10
            while not kids and p.proc.poll() is None and time.monotonic() < until:
                kids = Path(f"/proc/{p.proc.pid}/task/{p.proc.pid}/children").read_text().split()
                time.sleep(0.05)
            assert kids or p in trainers, p.hostname  # (a trainer may have finished already)
            held = [job_secret in Path(f"/proc/{k}/environ").read_bytes() for k in kids]
            assert held == [p in pservers] * len(kids), p.hostname  # a pserver needs it; a trainer has its key
        codes = {}
        deadline = time.monotonic() + 180
        for p in every:
            assert p.proc is not None
            codes[p.hostname] = p.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in every:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
    logs = {p.hostname: p.output() for p in every}
    assert codes == dict.fromkeys(logs, 0), logs
    mse = float(re.search(r"^final test_mse=(\S+)$", logs["fit-trainer-0"], re.M).group(1))
    assert mse < 30, logs["fit-trainer-0"]
    for i, p in enumerate(trainers):
        # Each trainer pod wrote its metrics into its own job-dir volume, under the id its index gave it.
        assert (p.volume / "log" / f"metrics.trainer{i}.jsonl").stat().st_size > 0
        assert f"trainer {i}: every pserver listens" in logs[p.hostname]
    for i in range(pods_cluster.n):
        assert pods_cluster.pids(i) == []
    # What run --backend k8s makes of these logs: each pod says once that its process starts, none fails.
    for node, p in enumerate(every):
        events = [e for line in logs[p.hostname].splitlines() for e in log_events(node, p.hostname, line)]
        assert [e for e in events if not isinstance(e, m.Log)] == [m.Ready(node)], logs[p.hostname]


# -- a pod that cannot become its process says why, and exits -----------------------------------------------

def _pod_env(role: str, index: str, port: int) -> Dict[str, str]:
    cfg = parse_config({"HOSTS": ["a"], "PADDLE_PORT": port, "PADDLE_PORTS_NUM": 1, "PADDLE_PORTS_NUM_FOR_SPARSE": 0},
                       "test")
    docs = k8s.manifests(k8s_job(cfg, job_name="fit", image="img:1", namespace="nowhere-ns"))
    (c,) = docs[2 if role == "pserver" else 3]["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update(env_of(c), PYTHONPATH=str(REPO))
    if index:
        env["JOB_COMPLETION_INDEX"] = index
    return env


@pytest.mark.parametrize("role,index,named", [
    ("pserver", "0", "fit-pserver-0.fit.nowhere-ns.svc does not resolve"),  # no DNS record for it
    ("trainer", "0", "no pserver listening on fit-pserver-0.fit.nowhere-ns.svc:"),
    ("trainer", "", "JOB_COMPLETION_INDEX=''"),
    ("trainer", "1", "PADDLE_TRAINER_ID=1: must be in [0, 1)"),
    ("pserver", "1", "PADDLE_PSERVER_ID=1: must be in [0, 1)"),
])
def test_a_pod_that_cannot_start_says_why(tmp_path: Path, role: str, index: str, named: str) -> None:
    res = subprocess.run([sys.executable, "-m", "paddle_cluster.node", "pod", "--start-timeout", "0.5", "--",
                          sys.executable, "-c", "print('must not run')"], cwd=tmp_path,
                         env=_pod_env(role, index, free_port_range(1)), capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and "must not run" not in res.stdout, res
    assert named in res.stderr and "Traceback" not in res.stderr, res.stderr
