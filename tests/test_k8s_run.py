"""``run --backend k8s`` end to end against the Kubernetes stand-in (tests/kube/: the Job controller,
scheduler, kubelet and DNS it models, each pod a real process in a network namespace of its own): a job to
its end, a name clash that changes nothing of the other job, and a failing trainer ending the whole job with its
launcher killed (followed by a launcher, that is the conformance suite's fail_fast[k8s])."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest
from enginecluster import kubectl_unavailable_reason
from kube.standin import (
    BARE_IMAGE,
    GPU_PULL_IMAGE,
    GPU_PULL_S,
    IMAGE,
    IMAGE_USER,
    NFS_CLAIM,
    PODS_PER_NODE,
    PULL_S,
    QUEUE,
    SLOW_IMAGE,
    StandIn,
)
from rt_helpers import free_port_range

from paddle_cluster.node.trainerwatch import GONE_GRACE_S as TRAINERS_GONE_GRACE_S

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fit_a_line"
# Trainer 1 fails after 3 s; the others train as usual.
FLAKY = """import os, runpy, sys, time
if os.environ.get("PADDLE_TRAINING_ROLE") == "TRAINER" and os.environ["PADDLE_TRAINER_ID"] == "1":
    time.sleep(3)
    sys.exit("trainer 1: out of data")
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.fixture
def fresh_kube(make_ssh_cluster, tmp_path):
    reason = kubectl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = make_ssh_cluster(4)
    k = StandIn(cluster, tmp_path / "kube")
    yield k
    k.close()
    assert k.processes() == []


@pytest.fixture
def job_dir(tmp_path: Path, fresh_kube) -> Path:
    """A user's directory: conf.py as the README has it, and the workspace as the image would hold it."""
    ws = tmp_path / "ws"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns("log", "output", "__pycache__"))
    (ws / "flaky.py").write_text(FLAKY)
    chown_tree(ws, IMAGE_USER)  # the pods' user writes output/ into it: docs/backends.md's COPY --chown=1000:1000
    port = free_port_range(2)
    (tmp_path / "conf.py").write_text(f'HOSTS = ["a", "b"]\nROOT_DIR = "{tmp_path}/root"\nPADDLE_PORT = {port}\n'
                                      'PADDLE_PORTS_NUM = 1\nPADDLE_PORTS_NUM_FOR_SPARSE = 1\n')
    return tmp_path


def chown_tree(d: Path, uid: int) -> None:
    for path in [d, *d.rglob("*")]:
        os.chown(path, uid, uid)


def cli(kube: StandIn, cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd), XDG_STATE_HOME=str(cwd / "state"))
    return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_args(cwd: Path, *more: str) -> List[str]:
    return ["run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "2", "--job_workspace",
            str(cwd / "ws"), *more]


def test_a_job_runs_to_its_end_and_leaves_nothing(fresh_kube: StandIn, job_dir: Path) -> None:
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "2"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^final test_mse=\S+$", res.stdout, re.M) or "final test_mse" in res.stdout + res.stderr
    assert fresh_kube.objects() == {}, fresh_kube.objects()  # every object of the job deleted, pods included
    assert f"logs and metrics of 3 pod(s) saved in {job_dir / 'root' / 'fit' / 'log'}" in res.stderr
    metrics = (job_dir / "root/fit/log/metrics.trainer1.jsonl").read_text().splitlines()
    assert len(metrics) > 10 and all(json.loads(r)["trainer"] == 1 for r in metrics[:3]), metrics[:3]
    logs = cli(fresh_kube, job_dir, "logs", "pserver.0")
    assert logs.returncode == 0 and "PSERVER_READY 0 fit-pserver-0.fit.default.svc" in logs.stdout, logs


def test_a_conf_py_without_hosts_runs_per_node_counts_of_pods(fresh_kube: StandIn, job_dir: Path) -> None:
    """Kubernetes places the pods: a conf.py without HOSTS (nor BACKEND: --backend k8s) runs PSERVERS_PER_NODE
    pserver and TRAINERS_PER_NODE trainer pods, and trains."""
    conf = job_dir / "conf.py"
    conf.write_text("".join(ln + "\n" for ln in conf.read_text().splitlines() if not ln.startswith("HOSTS"))
                    + "TRAINERS_PER_NODE = 2\n")
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", IMAGE, "--job_workspace", str(job_dir / "ws"),
              "--job_name", "nohosts", "--", "--passes", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 pserver pod(s), 2 trainer pod(s)" in res.stderr, res.stderr
    assert "final test_mse" in res.stdout + res.stderr
    assert fresh_kube.objects() == {}, fresh_kube.objects()


def identity(kube: StandIn) -> dict:
    """What another run must not change of an object: its uid, labels, owners and content (not its status)."""
    return {k: (o["metadata"]["uid"], o["metadata"].get("labels"), o["metadata"].get("ownerReferences"),
                o.get("spec"), o.get("data")) for k, o in kube.objects().items()}


def test_a_name_clash_changes_nothing_of_the_other_job(fresh_kube: StandIn, job_dir: Path) -> None:
    # Another team's job "fit", created from paddle-cluster's own manifests and left running.
    render = cli(fresh_kube, job_dir, "render", "k8s", "--image", IMAGE, "--job_name", "fit", "--pservers", "1",
                 "--trainers", "2", "--job_workspace", str(job_dir / "ws"), "--", "--passes", "100000")
    assert render.returncode == 0, render.stderr
    assert fresh_kube.kubectl("create", "--filename", "-", stdin=render.stdout).returncode == 0
    fresh_kube.wait(lambda: len([p for p in fresh_kube.pods() if p["status"].get("phase") == "Running"]) == 3, 60,
                    "3 pods")
    before = identity(fresh_kube)
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "2"))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "already has" in ln]
    assert "secret/fit-secret" in line and "job.batch/fit-trainer" in line and "nothing was changed" in line, line
    assert identity(fresh_kube) == before  # the same objects and pods, none replaced, deleted or added
    assert len([p for p in fresh_kube.pods() if p["status"].get("phase") == "Running"]) == 3
    assert fresh_kube.kubectl("delete", "jobs.batch,services,secrets", "--selector", "paddle-cluster/job=fit",
                        "--cascade=foreground", "--wait=true").returncode == 0


def failed(kube: StandIn, job: str) -> dict:
    """Job ``job``'s pods' exit codes by hostname once it failed, else {}."""
    j = kube.objects(f"Job/default/{job}").get(f"Job/default/{job}")
    if j is None or not any(c["type"] == "Failed" for c in j["status"].get("conditions", [])):
        return {}
    return {p["spec"]["hostname"]: p["status"].get("containerStatuses", [{}])[0].get("state", {}).get(
        "terminated", {}).get("exitCode") for p in kube.pods() if p["metadata"]["labels"]["job-name"] == job}


def test_with_the_launcher_killed_a_failing_trainer_still_ends_the_whole_job(fresh_kube: StandIn,
                                                                              job_dir: Path) -> None:
    argv = [sys.executable, "-m", "paddle_cluster", *run_args(job_dir, "--job_name", "fit", "--entry", "flaky.py",
                                                               "--ttl", "5", "--", "--passes", "500")]
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen(argv, cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        fresh_kube.wait(lambda: sum(p["status"].get("phase") == "Running" for p in fresh_kube.pods()) == 3, 60,
                        "3 running pods")
        # The launcher made the Jobs own the Secret and the Service right after creating them all.
        fresh_kube.wait(lambda: all(o["metadata"].get("ownerReferences") for k, o in fresh_kube.objects().items()
                              if k in ("Secret/default/fit-secret", "Service/default/fit")), 30,
                  "the Secret and the Service owned by the Jobs")
    finally:
        launcher.kill()
        launcher.wait()
    # Nobody watches now: trainer 1 fails, so the trainer Job fails and its other pod is stopped; the pserver
    # pod sees every trainer gone and fails too; 5 s later both Jobs are deleted with their pods (a short ttl:
    # each wait below sees its Job's end within a poll of 0.05 s, well before the Job goes).
    trainers = fresh_kube.wait(lambda: failed(fresh_kube, "fit-trainer"), 60, "the trainer Job failed")
    assert trainers["fit-trainer-1"] == 1, trainers
    # (Within START_TIMEOUT, 60 s, even had the pserver pod never seen a trainer pod: node/pod.py.)
    pservers = fresh_kube.wait(lambda: failed(fresh_kube, "fit-pserver"), 90, "the pserver Job failed")
    assert pservers == {"fit-pserver-0": 5}, pservers
    fresh_kube.wait(lambda: fresh_kube.objects() == {}, 60, "the Jobs deleted after ttlSecondsAfterFinished")
    assert fresh_kube.processes() == []


def test_detach_then_status_logs_kill_and_the_results_survive(fresh_kube: StandIn, job_dir: Path) -> None:
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--detach", "--", "--passes", "3"))
    assert res.returncode == 0, res.stderr
    assert "job fit created in namespace default" in res.stdout + res.stderr
    status = cli(fresh_kube, job_dir, "status")
    assert status.returncode == 0 and "trainer.1" in status.stdout and "pod/fit-trainer-1-" in status.stdout, status
    fresh_kube.wait(lambda: any(c["type"] == "Complete" for c in fresh_kube.objects("Job/default/fit-trainer")[
        "Job/default/fit-trainer"]["status"].get("conditions", [])), 120, "the trainers done")
    logs = cli(fresh_kube, job_dir, "logs", "trainer.0")
    assert logs.returncode == 0 and "final test_mse=" in logs.stdout, logs
    logs = cli(fresh_kube, job_dir, "logs", "all", "--role", "trainer", "-n", "1")  # each trainer's last line
    assert logs.returncode == 0 and [ln.split("] ")[0] for ln in logs.stdout.splitlines()] == [
        "[trainer.0@fit-trainer-0", "[trainer.1@fit-trainer-1"] and "] final test_mse=" in logs.stdout, logs
    logs = cli(fresh_kube, job_dir, "logs", "trainer.0", "--role", "pserver")  # a pod runs one process: not ignored
    assert logs.returncode == 1 and "trainer.0 is a trainer's pod" in logs.stderr and not logs.stdout, logs
    kill = cli(fresh_kube, job_dir, "kill")
    assert kill.returncode == 0 and f"saved in {job_dir / 'root' / 'fit' / 'log'}" in kill.stdout, kill
    assert fresh_kube.objects() == {}
    # The pods are gone; what they left is here: status, logs and plot read it.
    status = cli(fresh_kube, job_dir, "status")
    assert status.returncode == 0 and "ended (pod deleted)" in status.stdout and "trainer.1" in status.stdout, status
    logs = cli(fresh_kube, job_dir, "logs", "fit-trainer-0", "-n", "3")
    assert logs.returncode == 0 and "final test_mse=" in logs.stdout, logs
    assert "paddle-cluster pod: metrics" not in (job_dir / "root/fit/log/trainer.0.log").read_text()
    plot = cli(fresh_kube, job_dir, "plot", "-o", str(job_dir / "fit.png"))
    assert plot.returncode == 0 and (job_dir / "fit.png").stat().st_size > 0, plot.stderr
    assert re.search(r"trainer0 +loss", plot.stdout), plot.stdout


# Trainer 0 prints ~11 MiB, past the 10 MiB at which a kubelet rotates a container's log, then trains as usual. It
# begins once the file GO exists (the pods see this machine's files): once the test saw the run follow its log.
CHATTY = """import os, runpy, sys, time
if os.environ.get("PADDLE_TRAINING_ROLE") == "TRAINER" and os.environ["PADDLE_TRAINER_ID"] == "0":
    while not os.path.exists({go!r}):
        time.sleep(0.05)
    for i in range(11000):
        print(f"chatty {{i:05d}} " + "x" * 1010)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_log_past_the_kubelets_rotation_is_shown_and_saved_whole(fresh_kube: StandIn, job_dir: Path) -> None:
    """``kubectl logs`` returns a rotated log's current file alone: the followed run keeps every line, shown and
    saved; a detached job's saved log says that its beginning was rotated away."""
    go = job_dir / "go"
    (job_dir / "ws" / "chatty.py").write_text(CHATTY.format(go=str(go)))
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    p = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *run_args(
        job_dir, "--job_name", "chat", "--entry", "chatty.py", "--", "--passes", "1")], cwd=job_dir, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    out = []
    for line in p.stdout:  # (the test's timeout bounds this)
        out.append(line)
        if line.startswith("[trainer.0@chat-trainer-0] "):  # the run follows trainer 0's log: let it chatter
            go.touch()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0, err[-2000:]
    kubelet_log = fresh_kube.store.log("default", next(p.name for p in (fresh_kube.root / "logs" / "default").glob(
        "chat-trainer-0-*.log")).removesuffix(".log"))
    assert Path(f"{kubelet_log}.1").exists()  # the stand-in's kubelet rotated it
    shown = re.findall(r"^\[trainer\.0@chat-trainer-0\] chatty (\d+) ", "".join(out), re.M)
    assert [int(i) for i in shown] == list(range(11000))  # followed across the rotation: every line, once
    saved = (job_dir / "root/chat/log/trainer.0.log").read_text().splitlines()
    assert saved[0].startswith("paddle-cluster pod: image: ")
    assert [ln.split()[1] for ln in saved if ln.startswith("chatty ")] == [f"{i:05d}" for i in range(11000)]
    assert "final test_mse=" in saved[-1] and (job_dir / "root/chat/log/metrics.trainer0.jsonl").stat().st_size
    assert not list((job_dir / "root/chat/log").glob(".*"))  # the followed copies are gone
    # Detached, nobody followed: what is saved is the current file, and says so.
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "quiet", "--entry", "chatty.py", "--detach",
                                              "--", "--passes", "1"))
    assert res.returncode == 0, res.stderr
    fresh_kube.wait(lambda: any(c["type"] == "Complete" for c in fresh_kube.objects("Job/default/quiet-trainer")[
        "Job/default/quiet-trainer"]["status"].get("conditions", [])), 120, "the trainers done")
    kill = cli(fresh_kube, job_dir, "kill")
    assert kill.returncode == 0, kill.stderr
    saved = (job_dir / "root/quiet/log/trainer.0.log").read_text().splitlines()
    assert saved[0].startswith("[paddle-cluster: the beginning of this log was rotated away on its node"), saved[0]
    assert "final test_mse=" in saved[-1] and (job_dir / "root/quiet/log/metrics.trainer0.jsonl").stat().st_size


def test_a_pod_log_is_joined_with_what_its_follower_kept() -> None:
    """``whole_log``: the kubelet's current file after a rotation, joined with the copy a follower kept where they
    overlap; without a copy reaching the beginning, the first line says the beginning is gone."""
    from paddle_cluster.launch.backends.k8s.pods import ROTATED, whole_log

    full = ["paddle-cluster pod: image: Python 3", *[f"line {i}" for i in range(10)]]
    assert whole_log(full, full[:4]) == full  # not rotated: the current file is the whole log
    assert whole_log(full[6:], full[:8]) == full  # rotated, the copy overlapping it
    assert whole_log(full[6:], full) == full  # the pod ended: the copy holds it all
    assert whole_log(full[6:], []) == [ROTATED, *full[6:]]  # nobody followed
    assert whole_log(full[6:], full[3:8]) == [ROTATED, *full[3:]]  # followed late


# What a cluster's admin provides: the ServiceAccount and PriorityClass the pod options name.
ADMIN = """apiVersion: v1
kind: ServiceAccount
metadata: {name: trainer-sa, namespace: default}
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: ml-high}
value: 1000
"""


def test_run_takes_the_pod_options_render_takes(fresh_kube: StandIn, job_dir: Path) -> None:
    fresh_kube.setup(ADMIN)
    opts = ["--trainer-requests", "cpu=2", "--gpus", "1", "--pserver-limits", "memory=2Gi", "--node-selector",
            "pool=gpu", "--toleration", "nvidia.com/gpu:NoSchedule", "--priority-class", "ml-high",
            "--service-account", "trainer-sa", "--image-pull-secret", "regcred", "--deadline", "3600"]
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--detach", *opts, "--", "--passes", "1"))
    assert res.returncode == 0, res.stderr
    rendered = cli(fresh_kube, job_dir, "render", "k8s", "--image", IMAGE, "--job_name", "fit", "--pservers", "1",
                   "--trainers", "2", "--job_workspace", str(job_dir / "ws"), *opts, "--", "--passes", "1")
    assert rendered.returncode == 0, rendered.stderr
    import yaml

    for doc in list(yaml.safe_load_all(rendered.stdout))[2:]:
        made = fresh_kube.objects("Job")[f"Job/default/{doc['metadata']['name']}"]
        for spec in (made["spec"], doc["spec"]):
            # The job id differs per run; run reads the workspace (train.py serves pservers too), render cannot.
            spec["template"]["spec"]["containers"][0].update(env=[], args=[])
            spec["template"]["metadata"]["labels"].pop("paddle-cluster/job-id")
        assert made["spec"]["template"] == doc["spec"]["template"]
        assert made["spec"]["activeDeadlineSeconds"] == 3600
    # Only the GPU node (labelled pool=gpu, its taint tolerated) runs them: its 2 GPUs, one per trainer.
    fresh_kube.wait(lambda: len([p for p in fresh_kube.pods() if p["spec"].get("nodeName")]) == 3, 30,
                    "3 pods scheduled")
    assert {p["spec"]["nodeName"] for p in fresh_kube.pods()} == {"worker-0"}
    assert cli(fresh_kube, job_dir, "kill").returncode == 0
    assert fresh_kube.objects() == {}


def until_said(kube: StandIn, cwd: Path, args: List[str], pattern: str, within: float) -> tuple:
    """Start ``paddle-cluster ARGS``, read its output until a line matches ``pattern`` (or it ends), then stop it
    as a user would (Ctrl+C): (that line or None, seconds it took, the whole output, exit code)."""
    env = {k: v for k, v in kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd), XDG_STATE_HOME=str(cwd / "state"))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    seen, found, took = [], None, 0.0
    try:
        for line in p.stdout:
            seen.append(line)
            if re.search(pattern, line):
                found, took = line.strip(), time.monotonic() - t0
                break
            if time.monotonic() - t0 > within:
                break
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        seen += p.stdout.readlines()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return found, took, "".join(seen), p.returncode


@pytest.mark.parametrize("opts, said", [
    (["--service-account", "nobody-sa"], 'job.batch/fit-pserver cannot create its pods: pods "fit-pserver-0-" is '
     'forbidden: error looking up service account default/nobody-sa: serviceaccount "nobody-sa" not found'),
    (["--priority-class", "ml-low"], 'job.batch/fit-pserver cannot create its pods: pods "fit-pserver-0-" is '
     'forbidden: no PriorityClass with name ml-low was found'),
])
def test_pods_the_api_server_refuses_fail_the_job_at_once_saying_why(fresh_kube: StandIn, job_dir: Path,
                                                                     opts: List[str], said: str) -> None:
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", *opts, "--", "--passes", "1"),
              timeout=30)  # not START_TIMEOUT (60 s) + 30 s
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert said in res.stderr, res.stdout + res.stderr
    assert fresh_kube.objects() == {}


QUOTA = """apiVersion: v1
kind: ResourceQuota
metadata: {name: compute, namespace: default}
spec:
  hard: {limits.memory: 8Gi, requests.cpu: "4"}
"""


def test_a_quota_is_named_when_it_refuses_the_pods_and_met_with_limits(fresh_kube: StandIn, job_dir: Path) -> None:
    fresh_kube.setup(QUOTA)
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "1"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert ('job.batch/fit-pserver cannot create its pods: pods "fit-pserver-0-" is forbidden: failed quota: '
            'compute: must specify limits.memory for: pserver') in res.stderr, res.stderr
    assert fresh_kube.objects() == {}
    # With limits the quota admits one job of 3 pods (3 of its 4 CPUs); of a second one the pserver fits, the
    # trainers wait for room, and the launcher says so (the start timeout waits meanwhile).
    limits = ["--pserver-limits", "memory=1Gi", "--trainer-limits", "memory=1Gi"]
    first = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "first", "--detach", *limits, "--", "--passes",
                                               "50"))
    assert first.returncode == 0, first.stderr
    fresh_kube.wait(lambda: len(fresh_kube.pods()) == 3, 30, "the first job's pods")
    line, took, out, _ = until_said(fresh_kube, job_dir, run_args(job_dir, "--job_name", "second", *limits, "--",
                                                             "--passes", "1"), "waits for room|cannot create", 60)
    assert line and line.endswith("job.batch/second-trainer waits for room in the namespace's quota: pods "
                                  '"second-trainer-0-" is forbidden: exceeded quota: compute, requested: '
                                  "requests.cpu=1, used: requests.cpu=4, limited: requests.cpu=4"), out
    assert took < 20, took
    assert cli(fresh_kube, job_dir, "kill", "--job_name", "first").returncode == 0
    fresh_kube.wait(lambda: fresh_kube.objects() == {}, 60, "both jobs gone")


def test_an_unschedulable_pod_says_what_the_scheduler_said(fresh_kube: StandIn, job_dir: Path) -> None:
    line, took, out, _ = until_said(fresh_kube, job_dir, run_args(job_dir, "--job_name", "fit", "--gpus", "4", "--",
                                                             "--passes", "1"), "Unschedulable", 60)
    assert line and "0/4 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: present}, 3 " \
        "Insufficient nvidia.com/gpu." in line, out
    assert took < 20, took
    fresh_kube.wait(lambda: fresh_kube.objects() == {}, 60, "the job deleted after Ctrl+C")


ROOM_FOR_ONE = """apiVersion: v1
kind: ResourceQuota
metadata: {name: compute, namespace: default}
spec:
  hard: {requests.cpu: "%s"}
"""


# Each trainer prints LINES numbered lines as fast as it can and ends (it needs no pserver).
LINES = 2000
SPEAKER = f"""import os
me = os.environ["PADDLE_TRAINER_ID"]
for i in range({LINES}):
    print(f"trainer {{me}} says {{i:05d}}", flush=i % 100 == 0)
"""


def test_every_line_of_many_pods_arrives_with_one_log_follower_process(fresh_kube: StandIn, job_dir: Path) -> None:
    """Ten trainers print 2000 lines each and end, half of them only once the quota has room, so they start while
    the run follows the others and some end before run has seen them run: every line of every pod is shown, in
    its order, and saved; ``logs all -f`` from another terminal, started once the first pods run, shows every
    pod's lines too (those that ended before it started included) and ends with the job; the logs came through
    one kubectl proxy per command, not a kubectl process per pod."""
    (job_dir / "ws" / "speaker.py").write_text(SPEAKER)
    fresh_kube.setup(ROOM_FOR_ONE % 6)  # the pserver and 5 trainers at a time
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *run_args(
        job_dir, "--job_name", "many", "--trainers", "10", "--entry", "speaker.py", "--pserver", "builtin")],
        cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kubectls, output, followed = set(), [], []
    reader = threading.Thread(target=lambda: output.append(launcher.communicate(timeout=300)), daemon=True)
    reader.start()
    follower: Optional[subprocess.Popen] = None
    tailer = threading.Thread()
    try:
        while launcher.poll() is None:  # the kubectl processes the run (and logs -f) have
            if follower is None and any(p["status"].get("phase") == "Running" for p in fresh_kube.pods()):
                follower = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "logs", "all", "-f", "-n",
                                             "100000"], cwd=job_dir, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                tailer = threading.Thread(target=lambda f=follower: followed.append(f.communicate(timeout=300)),
                                          daemon=True)
                tailer.start()
            kubectls |= {(c, " ".join(_cmdline(c))) for c in [*_children(launcher.pid), *(
                _children(follower.pid) if follower else [])] if "kubectl" in " ".join(_cmdline(c)[:1])}
            time.sleep(0.2)
        reader.join(timeout=60)
        ((out, err),) = output
        assert follower is not None, "no pod ran"
        tailer.join(timeout=60)
        assert follower.returncode == 0, followed
    finally:
        for p in (launcher, follower):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    ((tail, tail_err),) = followed
    for t in range(10):
        shown = re.findall(rf"^\[trainer\.{t}@many-trainer-{t}\] trainer {t} says (\d+)$", out, re.M)
        assert [int(i) for i in shown] == list(range(LINES)), (t, len(shown))
        shown = re.findall(rf"^\[trainer\.{t}@many-trainer-{t}\] trainer {t} says (\d+)$", tail, re.M)
        assert [int(i) for i in shown] == list(range(LINES)), (t, len(shown), tail_err[-2000:])
        saved = (job_dir / f"root/many/log/trainer.{t}.log").read_text().splitlines()
        assert [ln for ln in saved if ln.startswith("trainer ")] == [f"trainer {t} says {i:05d}" for i in
                                                                    range(LINES)], t
    assert "waits for room in the namespace's quota" in out, out[-3000:]
    assert not [c for c in kubectls if " logs " in c[1]], kubectls  # (run's saving of the logs included)
    assert len([c for c in kubectls if " proxy --port=0 " in c[1]]) == 2, kubectls  # run's, and logs -f's
    last = cli(fresh_kube, job_dir, "logs", "all", "--role", "trainer", "-n", "1")  # the saved logs, pods gone
    assert last.stdout.splitlines() == [f"[trainer.{t}] trainer {t} says {LINES - 1:05d}" for t in range(10)], last


def _children(pid: int) -> List[int]:
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def _cmdline(pid: int) -> List[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def test_trainers_waiting_for_quota_past_the_start_timeout_end_nothing(fresh_kube: StandIn, job_dir: Path) -> None:
    """The quota has room for the pserver pod alone: the trainers wait for room well past START_TIMEOUT (and past
    a pserver's NXDOMAIN grace) -- the launcher's start timeout paused, the pserver never counting trainers it has
    not seen as gone -- and once room comes the job runs to its end."""
    with open(job_dir / "conf.py", "a") as f:
        f.write("START_TIMEOUT = 3\n")
    fresh_kube.setup(ROOM_FOR_ONE % 1)
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *run_args(job_dir, "--job_name", "fit", "--",
                                                                                   "--passes", "1")],
                                cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        fresh_kube.wait(lambda: any("waiting for 1 pserver" in p.read_text() or "PSERVER_READY" in p.read_text()
                                    for p in (fresh_kube.root / "logs" / "default").glob("fit-pserver-0-*.log")), 60,
                        "the pserver running")
        with pytest.raises(subprocess.TimeoutExpired):  # the run goes on past START_TIMEOUT and the grace...
            launcher.wait(timeout=3 + TRAINERS_GONE_GRACE_S + 3)
        assert all("trainer" not in p["metadata"]["name"] for p in fresh_kube.pods())
        room = fresh_kube.kubectl("patch", "resourcequota", "compute", "--type", "merge", "--patch",
                                  '{"spec": {"hard": {"requests.cpu": "4"}}}')
        assert room.returncode == 0, room.stderr
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    assert out.count("waits for room in the namespace's quota") == 1, out
    assert "no trainer pod is left" not in out and "final test_mse" in out, out
    assert fresh_kube.objects() == {}


def test_a_pending_timeout_ends_a_job_the_cluster_cannot_place_with_the_schedulers_word(fresh_kube: StandIn,
                                                                                      job_dir: Path) -> None:
    """An unschedulable pod pauses the start timeout (the autoscaler may add a node); --pending-timeout bounds that
    wait and names the scheduler's reason."""
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--node-selector", "pool=tpu",
                                             "--pending-timeout", "4", "--", "--passes", "1"), timeout=40)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert "the cluster held the job for 4 s (--pending-timeout): pod/fit-" in line, line
    assert "Unschedulable: 0/4 nodes are available" in line and "node affinity/selector" in line, line
    # One line per distinct reason, not one per pod: the 3 pods wait for the same.
    assert len([ln for ln in res.stdout.splitlines() if "Unschedulable" in ln]) == 1, res.stdout
    assert fresh_kube.objects() == {}


def test_an_image_that_cannot_be_pulled_is_said_once_and_named_by_the_error(fresh_kube: StandIn,
                                                                          job_dir: Path) -> None:
    """A kubelet retries a pull that fails (ErrImagePull, then ImagePullBackOff, again and again, with its Events for
    each pod): run says each distinct reason once for the whole job, and the start timeout's error names the image
    and the pods."""
    with open(job_dir / "conf.py", "a") as f:
        f.write("START_TIMEOUT = 1\n")
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", "registry.example/paddle/typo:1",
              "--pservers", "1", "--trainers", "2", "--job_workspace", str(job_dir / "ws"), "--job_name", "fit",
              timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    said = [ln for ln in res.stdout.splitlines() if "typo:1" in ln]
    assert 1 <= len(said) <= 3 and any("ErrImagePull" in ln and "not found" in ln for ln in said), res.stdout
    assert "pservers not ready within START_TIMEOUT=1 s: " in res.stderr, res.stderr
    assert 'Back-off pulling image "registry.example/paddle/typo:1"' in res.stderr or \
        'failed to pull and unpack image "registry.example/paddle/typo:1"' in res.stderr, res.stderr
    assert "fit-pserver-0-" in res.stderr and "fit-trainer-1-" in res.stderr, res.stderr
    assert fresh_kube.objects() == {}


def test_a_deadline_always_ends_as_deadline_exceeded(fresh_kube: StandIn, job_dir: Path) -> None:
    """activeDeadlineSeconds fails both Jobs and the Job controller stops their pods (143): the Job's reason ends
    the run, never the exit code of a pod it stopped."""
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--deadline", "8", "--", "--passes",
                                             "100000"), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert "failed: DeadlineExceeded: Job was active longer than specified deadline" in line, res.stderr
    assert "exited with code 143" not in res.stderr and "exited 143" not in res.stderr, res.stderr
    assert fresh_kube.objects() == {}


def test_a_slow_first_pull_is_reported_and_waited_for(fresh_kube: StandIn, job_dir: Path) -> None:
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", SLOW_IMAGE, "--pservers", "1", "--trainers",
              "2", "--job_workspace", str(job_dir / "ws"), "--job_name", "fit", "--", "--passes", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    pulls = re.findall(r"pod/fit-\S+: pulling image registry.example/paddle/fit:2; the start timeout waits", res.stdout)
    pulled = re.findall(r'pod/fit-\S+: Successfully pulled image "registry.example/paddle/fit:2" in ([\d.]+)s',
                        res.stdout)
    assert pulls and pulled and max(float(s) for s in pulled) >= PULL_S, res.stdout
    assert fresh_kube.objects() == {}


def test_trainers_wait_past_their_start_timeout_for_a_pserver_pulling_its_image(fresh_kube: StandIn,
                                                                               job_dir: Path) -> None:
    """The pserver's node pulls the image for GPU_PULL_S, the trainers' nodes have it: the trainer pods run and
    wait for the pserver past START_TIMEOUT, since its pod has an address but its entry point never answered."""
    with open(job_dir / "conf.py", "a") as f:
        f.write("START_TIMEOUT = 4\n")
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", GPU_PULL_IMAGE, "--pservers", "1",
              "--trainers", "2", "--job_workspace", str(job_dir / "ws"), "--job_name", "fit",
              "--pserver-requests", "cpu=1,memory=1Gi,nvidia.com/gpu=1", "--toleration", "nvidia.com/gpu:NoSchedule",
              "--", "--passes", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    pulled = re.findall(r'pod/fit-pserver-\S+: Successfully pulled image "\S+" in ([\d.]+)s', res.stdout)
    assert pulled and float(pulled[0]) >= GPU_PULL_S, res.stdout  # the trainers waited out a pull past 4 s
    assert "[agent@fit-pserver-0] pod/fit-pserver-0-" in res.stdout and f"pulling image {GPU_PULL_IMAGE}" in \
        res.stdout, res.stdout
    waited = [ln for ln in res.stdout.splitlines() if "has an address but its container does not run yet" in ln]
    assert waited and all(ln.startswith("[trainer.") for ln in waited), res.stdout


def test_a_node_holds_several_pods_each_with_its_own_address(fresh_kube: StandIn, job_dir: Path) -> None:
    """Pods share a node as on a cluster (the conformance suite runs three jobs at once on the stand-in), each
    with an address of its own; one more than the node selector's nodes hold stays Pending, and status says
    why."""
    slots = PODS_PER_NODE  # only worker-0 is pool=gpu
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers",
              str(slots), "--job_workspace", str(job_dir / "ws"), "--job_name", "fit", "--detach", "--node-selector",
              "pool=gpu", "--toleration", "nvidia.com/gpu:NoSchedule", "--", "--passes", "50")
    assert res.returncode == 0, res.stderr
    def placed():
        pods = fresh_kube.pods()
        with_ip = [p for p in pods if p["status"].get("podIP")]
        return with_ip if len(pods) == slots + 1 and len(with_ip) == slots else None

    pods = fresh_kube.wait(placed, 60, f"{slots} pods placed")
    assert {p["spec"]["nodeName"] for p in pods} == {"worker-0"}
    addresses = {p["status"]["podIP"] for p in pods}
    assert len(addresses) == slots and pods[0]["status"]["hostIP"] not in addresses, addresses
    status = fresh_kube.wait(lambda: "Unschedulable" in (st := cli(fresh_kube, job_dir, "status")).stdout and st, 60,
                       "status to show the pending pod")
    assert status.returncode == 0 and "pending: Unschedulable" in status.stdout, status.stdout
    assert cli(fresh_kube, job_dir, "kill").returncode == 0
    assert fresh_kube.objects() == {}


def test_a_small_workspace_is_dispatched_in_a_configmap(fresh_kube: StandIn, job_dir: Path) -> None:
    args = ["run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "2", "--job_name", "fit",
            "--job_dispatch_package", "ws", "--", "--passes", "2"]
    res = cli(fresh_kube, job_dir, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    unpacked = f"entries unpacked into {job_dir / 'root' / 'fit' / 'workspace'}"
    assert res.stdout.count(unpacked) == 3 and "final test_mse=" in res.stdout, res.stdout
    assert fresh_kube.objects() == {}
    # Too big for a ConfigMap: refused before anything is created, saying what to do instead.
    (job_dir / "ws" / "big.bin").write_bytes(os.urandom(1536 * 1024))
    res = cli(fresh_kube, job_dir, *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--job_dispatch_package" in res.stderr and "KiB a ConfigMap holds" in res.stderr, res.stderr
    assert fresh_kube.objects() == {}


def test_an_image_without_paddle_cluster_fails_in_one_line(fresh_kube: StandIn, job_dir: Path) -> None:
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", BARE_IMAGE, "--pservers", "1", "--trainers",
              "1", "--job_name", "fit", "--job_dispatch_package", "ws")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert "the image cannot run the pod entry point" in line and "No module named 'paddle_cluster'" in line, line
    assert fresh_kube.objects() == {}
    # A good image says what it offers, in one line per pod.
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--", "--passes", "1"))
    assert res.returncode == 0, res.stderr
    assert re.search(r"\[trainer\.0@fit-trainer-0\] paddle-cluster pod: image: Python 3\.\d+\.\d+, numpy \S+, "
                     r"paddle-cluster \S+", res.stdout), res.stdout


# Each trainer pushes ones for N steps (w -= 0.5 each); trainer 0 saves a checkpoint at the end.
RESUMABLE = r'''
import sys
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
steps = int(sys.argv[1])
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
w = ps.register_dense({"w": np.zeros(20000, np.float32)})["w"]
print(f"start step={ps.step} w0={w[0]:g}", flush=True)
for _ in range(steps):
    ps.push({"w": np.ones(20000, np.float32)})
w = ps.pull()["w"]
if ps.trainer_id == 0:
    print(f"saved step={ps.save_checkpoint().step}", flush=True)
print(f"end step={ps.step} w0={w[0]:g}", flush=True)
ps.close()
'''


def test_checkpoints_on_a_pvc_let_a_job_resume_from_another(fresh_kube: StandIn, job_dir: Path) -> None:
    ws = job_dir / "resumable"
    ws.mkdir()
    (ws / "train.py").write_text(RESUMABLE)

    def run(name: str, *more: str) -> subprocess.CompletedProcess:
        return cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", IMAGE, "--pservers", "2", "--trainers",
                   "2", "--job_name", name, "--job_dispatch_package", "resumable", "--checkpoint-pvc", "ckpt", *more)

    first = run("first", "--", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "[trainer.0@first-trainer-0] end step=3 w0=-1.5" in first.stdout, first.stdout
    pvc = fresh_kube.root / "pvcs" / "default" / "ckpt"
    assert (pvc / "first" / "step-00000003" / "pserver-1" / "manifest.json").exists()
    assert fresh_kube.objects() == {}  # the pods and their volumes are gone, the claim's data is not
    second = run("second", "--resume_from", "first", "--", "2")
    assert second.returncode == 0, second.stdout + second.stderr
    for t in (0, 1):
        assert f"[trainer.{t}@second-trainer-{t}] start step=3 w0=-1.5" in second.stdout  # the checkpoint's values
        assert f"[trainer.{t}@second-trainer-{t}] end step=5 w0=-2.5" in second.stdout
    assert (pvc / "first" / "step-00000005").is_dir()  # as on every backend: it goes on writing there
    # Without a claim there is nothing to resume from, and the error says what to give.
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "third", "--resume_from", "first"))
    assert res.returncode == 2 and "--checkpoint-pvc" in res.stderr, res.stderr


def test_pods_run_as_their_user_and_a_volume_it_cannot_write_fails_at_once(fresh_kube: StandIn,
                                                                          job_dir: Path) -> None:
    """The pods run as runAsUser (1000) with their volumes given to fsGroup where the storage allows it: a claim
    whose storage ignores fsGroup (NFS) keeps its root directory root's, and the pserver says so before it starts,
    naming the directory and both owners, instead of failing at its first checkpoint."""
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--checkpoint-pvc", NFS_CLAIM, "--",
                                              "--passes", "1"), timeout=60)  # at once, not after START_TIMEOUT
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "the checkpoint directory (PADDLE_CHECKPOINT_DIR) /checkpoints/fit is not writable by this pod's user " \
        "(uid 1000, gid 1000, groups 1000): /checkpoints has owner 0:0, mode 0755" in res.stderr, res.stderr
    # A claim whose storage applies fsGroup is the pods' group's; what the pods wrote is their user's.
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "ok", "--checkpoint-pvc", "ckpt", "--",
                                              "--passes", "1"))
    assert res.returncode == 0, res.stderr
    claim = (fresh_kube.root / "pvcs" / "default" / "ckpt").stat()
    assert (claim.st_uid, claim.st_gid, claim.st_mode & 0o2070) == (0, IMAGE_USER, 0o2070)
    assert (job_dir / "ws" / "output").stat().st_uid == IMAGE_USER  # trainer 0's output/, in the image's workspace


def test_ctrl_c_stops_every_pod_and_keeps_the_logs(fresh_kube: StandIn, job_dir: Path) -> None:
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *run_args(
        job_dir, "--job_name", "fit", "--", "--passes", "100000")], cwd=job_dir, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        fresh_kube.wait(lambda: any("Pass 1:" in p.read_text() for p in (fresh_kube.root / "logs" / "default").glob(
            "fit-trainer-0-*.log")), 120, "trainer 0 in its second pass")
        os.killpg(launcher.pid, signal.SIGINT)  # as a terminal's Ctrl+C: to the launcher and its kubectls
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, err
    assert "interrupted" in err and f"saved in {job_dir / 'root' / 'fit' / 'log'}" in err, err
    assert fresh_kube.objects() == {} and fresh_kube.processes() == []
    assert "Pass 1:" in (job_dir / "root/fit/log/trainer.0.log").read_text()


# Each trainer connects, then trains on for N seconds (its connection open, as a long pass keeps it) and ends.
PATIENT = r'''
import sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.5))
ps.register_dense({"w": np.zeros(8, np.float32)})
print("connected", flush=True)
time.sleep(float(sys.argv[1]))
ps.push({"w": np.ones(8, np.float32)})
print(f"done w0={ps.pull()['w'][0]:g}", flush=True)
ps.close()
'''


def test_a_dns_outage_is_not_the_trainers_ending(fresh_kube: StandIn, job_dir: Path) -> None:
    """The cluster DNS failing (SERVFAIL, then no answer at all, as while CoreDNS restarts) for longer than a
    pserver's grace for NXDOMAIN while the trainers are connected: nothing ends, the job finishes."""
    # SERVFAIL alone outlasts the grace: each lookup fails at once, so a pserver counting it stops within the
    # outage. Without any answer a round of lookups takes seconds (resolv.conf's timeout:1 attempts:2, per name).
    servfail, drop = TRAINERS_GONE_GRACE_S + 2, 4
    ws = job_dir / "patient"
    ws.mkdir()
    (ws / "train.py").write_text(PATIENT)
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "run", "--backend", "k8s", "--image", IMAGE,
                                 "--pservers", "1", "--trainers", "2", "--job_name", "fit", "--job_dispatch_package",
                                 "patient", "--", f"{servfail + drop + 4:g}"], cwd=job_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fresh_kube.wait(lambda: sum("connected" in p.read_text() for p in (fresh_kube.root / "logs" / "default").glob(
            "fit-trainer-*.log")) == 2, 90, "both trainers connected")
        fresh_kube.dns_fault("servfail", servfail)
        time.sleep(servfail)
        fresh_kube.dns_fault("drop", drop)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out + err
    assert "[trainer.1@fit-trainer-1] done w0=" in out, out
    pserver = (job_dir / "root/fit/log/pserver.0.log").read_text()
    # Its trainers connected, the pserver asked the DNS nothing (their connections say they are there).
    assert "cannot resolve" not in pserver and "no trainer pod is left" not in pserver, pserver
    assert fresh_kube.objects() == {}


def test_a_queued_job_is_admitted_whole_and_its_pservers_wait_for_it(fresh_kube: StandIn, job_dir: Path) -> None:
    """--queue makes the job one JobSet, one Kueue workload: while another job holds the queue neither its
    pservers nor its trainers start (as two Jobs, two workloads, its pservers were admitted, waited START_TIMEOUT
    for trainers Kueue held back, and failed the job); once admitted it runs to its end."""
    with open(job_dir / "conf.py", "a") as f:
        f.write("START_TIMEOUT = 8\n")
    ws = job_dir / "patient"
    ws.mkdir()
    (ws / "train.py").write_text(PATIENT)
    first = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "2",
                "--job_name", "first", "--job_dispatch_package", "patient", "--queue", QUEUE, "--detach", "--", "16")
    assert first.returncode == 0, first.stderr
    fresh_kube.wait(lambda: sum("connected" in p.read_text() for p in (fresh_kube.root / "logs" / "default").glob(
        "first-trainer-0-*.log")) == 2, 60, "the first job's trainers connected")
    second = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "second", "--queue", QUEUE, "--", "--passes",
                                                "1"))
    assert second.returncode == 0, second.stdout + second.stderr  # it waited, suspended, past its START_TIMEOUT
    assert "[agent@second-pserver-0-0] job.batch/second-pserver-0 is suspended (waiting for Kueue queue q to " \
           "admit it); the start timeout waits meanwhile" in second.stdout, second.stdout
    assert "job.batch/second-pserver-0 was admitted (resumed)" in second.stdout, second.stdout
    assert "[trainer.1@second-trainer-0-1] final test_mse=" in second.stdout or "final test_mse" in second.stdout
    assert cli(fresh_kube, job_dir, "kill", "--job_name", "first").returncode == 0
    assert fresh_kube.objects() == {}, fresh_kube.objects()


def test_a_queued_job_says_its_place_in_line_and_when_it_moves_up(fresh_kube: StandIn, job_dir: Path) -> None:
    """Kueue's visibility API lists a LocalQueue's pending workloads in line: the followed run says its place, and
    again when a job before it leaves the queue."""
    (job_dir / "ws" / "sleepy.py").write_text("import time\ntime.sleep(300)\n")  # holds the queue, idle
    for name in ("first", "second", "third"):  # the first is admitted, the other two wait (4 CPUs, 3 a job)
        res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", name, "--queue", QUEUE, "--detach",
                                                  "--entry", "sleepy.py", "--pserver", "builtin"))
        assert res.returncode == 0, res.stderr
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    p = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *run_args(job_dir, "--job_name", "fourth", "--queue",
                                                                            QUEUE, "--", "--passes", "1")],
                         cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in p.stdout], daemon=True).start()

    def said(text: str) -> None:
        seen = []
        deadline = time.monotonic() + 60
        while text not in "".join(seen):
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            assert time.monotonic() < deadline, "".join(seen)

    try:
        said("[agent@fourth-pserver-0-0] waiting for Kueue queue q: 3rd in line\n")
        assert cli(fresh_kube, job_dir, "kill", "--job_name", "second").returncode == 0
        said("[agent@fourth-pserver-0-0] waiting for Kueue queue q: 2nd in line\n")
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    assert p.returncode == 130 and "Kueue's visibility API does not" not in "".join(lines.queue)
    # (first and third: their pods are ended with the stand-in)


def test_kueues_verdicts_are_read_from_the_jobs_workload(fresh_kube: StandIn, job_dir: Path) -> None:
    """Kueue's Workload conditions: a LocalQueue that does not exist and a job no flavor can ever fit (6 CPUs, the
    ClusterQueue has 4) fail at once in one line with Kueue's message."""
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--queue", "nosuch", "--", "--passes",
                                             "1"), timeout=30)  # at once: a deadline on the run
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert line.endswith("Kueue cannot admit the job to queue nosuch (workload.kueue.x-k8s.io/jobset-fit-"
                         f"{line.split('jobset-fit-')[1][:5]}): LocalQueue nosuch doesn't exist"), line
    assert fresh_kube.objects() == {}, fresh_kube.objects()
    res = cli(fresh_kube, job_dir, "run", "--backend", "k8s", "--image", IMAGE, "--pservers", "1", "--trainers", "5",
              "--job_workspace", str(job_dir / "ws"), "--job_name", "big", "--queue", QUEUE, timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "couldn't assign flavors to pod set pserver: insufficient quota for cpu in flavor default-flavor, " \
           "request > maximum capacity (6 > 4)" in res.stderr, res.stderr
    assert fresh_kube.objects() == {}


# Trainer 0 steps to N (argv[1]) with a gradient that depends on w under momentum (so a resume that lost the
# optimizer's state would show), checkpointing every step; at step 3 it waits while the file argv[2] (if given)
# exists. It continues from ps.step, as docs/checkpoints.md asks of a script that may be resumed.
PREEMPTIBLE = r'''
import os, sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
steps, hold = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
ps = connect(mode="sync", optimizer=OptimizerSpec("momentum", lr=0.1, momentum=0.9))
target = np.linspace(-1, 1, 1000).astype(np.float32)
w = ps.register_dense({"w": np.zeros(1000, np.float32)})["w"]
print(f"start step={ps.step}", flush=True)
while ps.step < steps:
    ps.push({"w": w - target})
    w = ps.pull()["w"]
    ps.save_checkpoint()
    while ps.step == 3 and hold and os.path.exists(hold):
        print("holding at step 3", flush=True)
        time.sleep(0.1)
print(f"end step={ps.step} w={float(np.abs(w).sum()):.9g}", flush=True)
ps.close()
'''

PRIORITIES = """apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: low}
value: 10
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: high}
value: 1000
"""


def test_a_preempted_job_waits_to_be_admitted_again_and_resumes(fresh_kube: StandIn, job_dir: Path) -> None:
    """Kueue preempts a low-priority job for a higher-priority one in the same ClusterQueue (3 CPUs each, 4 in
    the queue): the low job says so once with Kueue's reason, waits (its pods' exits 143 are not its end), is
    admitted again once the high one finished, its pservers resume from the newest checkpoint complete for both,
    and it ends with the result of the high job, which ran the same script without a preemption."""
    fresh_kube.setup(PRIORITIES)
    ws = job_dir / "preemptible"
    ws.mkdir()
    (ws / "train.py").write_text(PREEMPTIBLE)
    hold = job_dir / "hold"
    hold.touch()

    def args(name: str, priority: str) -> List[str]:
        return ["run", "--backend", "k8s", "--image", IMAGE, "--pservers", "2", "--trainers", "1", "--job_name", name,
                "--job_dispatch_package", "preemptible", "--queue", QUEUE, "--priority-class", priority]

    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", *args("low", "low"), "--checkpoint-pvc",
                                 "ckpt", "--pending-timeout", "120", "--", "8", str(hold)], cwd=job_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fresh_kube.wait(lambda: any("holding at step 3" in p.read_text() for p in (
            fresh_kube.root / "logs" / "default").glob("low-trainer-0-0-*.log")), 90, "the low job at step 3")
        high = cli(fresh_kube, job_dir, *args("high", "high"), "--", "8", timeout=120)
        hold.unlink()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert high.returncode == 0, high.stdout + high.stderr
    assert launcher.returncode == 0, out + err
    (evicted,) = [ln for ln in out.splitlines() if "Kueue evicted" in ln]
    assert "Kueue evicted the job (workload.kueue.x-k8s.io/jobset-low-" in evicted and "): Preempted: Preempted " \
        "to accommodate a workload (UID: " in evicted and evicted.endswith("due to prioritization in the "
                                                                            "ClusterQueue; its pods are stopped, and "
                                                                            "it waits to be admitted again to queue q")
    assert out.count("Kueue admitted the job again (workload.kueue.x-k8s.io/jobset-low-") == 1, out
    assert out.index("Kueue evicted") < out.index("Kueue admitted the job again"), out
    assert "exited with code 143" not in out + err and "is suspended" not in out.split("Kueue evicted")[1], out
    for i in (0, 1):  # every pserver from the newest step complete for both: the trainer held at step 3
        assert f"[pserver.{i}@low-pserver-0-{i}] paddle-cluster pod: pserver {i} started before in this run (the " \
            "job was evicted): resuming from step 3, the newest checkpoint in /checkpoints/low complete for all 2 " \
            "pserver(s)" in out, out
    starts = re.findall(r"\[trainer\.0@low-trainer-0-0\] start step=(\d+)", out)
    assert starts == ["0", "3"], out
    (reference,) = re.findall(r"\[trainer\.0@high-trainer-0-0\] (end step=8 w=\S+)", high.stdout)
    assert re.findall(r"\[trainer\.0@low-trainer-0-0\] (end step=\d+ w=\S+)", out) == [reference], out
    assert fresh_kube.objects() == {}


def test_a_watch_the_api_server_expires_is_listed_again(fresh_kube: StandIn, job_dir: Path) -> None:
    """The API server ends every watch with 410 Expired (its history compacted) while the job runs: run lists
    again and watches on, says nothing of it, and follows the job to its end."""
    ws = job_dir / "patient"
    ws.mkdir()
    (ws / "train.py").write_text(PATIENT)
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(job_dir), XDG_STATE_HOME=str(job_dir / "state"))
    launcher = subprocess.Popen([sys.executable, "-m", "paddle_cluster", "run", "--backend", "k8s", "--image", IMAGE,
                                 "--pservers", "1", "--trainers", "2", "--job_name", "fit", "--job_dispatch_package",
                                 "patient", "--", "4"], cwd=job_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fresh_kube.wait(lambda: sum("connected" in p.read_text() for p in (fresh_kube.root / "logs" / "default").glob(
            "fit-trainer-*.log")) == 2, 90, "both trainers connected")
        fresh_kube.expire_watches()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0 and "cannot follow" not in out + err, out + err
    assert "[trainer.1@fit-trainer-1] done w0=" in out, out
    expired = (fresh_kube.root / "apiserver.log").read_text()
    assert all(f"watch of {kind} in default expired (410)" in expired for kind in ("Pod", "Job", "Event")), expired
    assert fresh_kube.objects() == {}


def test_a_waiting_pod_ends_at_once_when_deleted(fresh_kube: StandIn, job_dir: Path) -> None:
    """The runtime sends SIGTERM to the container's PID 1 only, which the kernel drops unless PID 1 handles it:
    trainer pods waiting for a pserver that cannot be scheduled end at once when the job is killed, not after
    their grace period (KILL_GRACE, 30 s here)."""
    with open(job_dir / "conf.py", "a") as f:
        f.write("KILL_GRACE = 30\n")
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "fit", "--detach", "--pserver-requests", "cpu=100",
                                       "--", "--passes", "1"))
    assert res.returncode == 0, res.stderr
    fresh_kube.wait(lambda: sum("waiting for 1 pserver(s)" in p.read_text()
                                for p in (fresh_kube.root / "logs" / "default").glob("fit-trainer-*.log")) == 2,
                    60, "both trainers waiting for the pserver")
    kill = cli(fresh_kube, job_dir, "kill", timeout=15)  # not the pods' grace period waited out
    assert kill.returncode == 0, kill.stdout + kill.stderr
    (log,) = (fresh_kube.root / "logs" / "default").glob("fit-trainer-0-*.log")  # (kill saved it before deleting)
    assert "stopped by signal 15 before starting the process" in log.read_text()
    assert fresh_kube.objects() == {}


def test_the_scenarios_for_a_real_cluster_pass_on_the_stand_in(fresh_kube: StandIn, tmp_path: Path) -> None:
    """scripts/k8s-scenarios, which docs/backends.md gives users to check the backend on their own cluster (a
    kubeconfig and an image), passes here with every cluster feature it can ask for: its scenarios are the user's
    commands, its checks kubectl's; four at once (the quota scenario alone after them), as a cluster with room for
    them runs them. (The stand-in does not enforce Pod Security admission: the restricted scenario's pods pass it by
    construction, test_k8s_render checks that.)"""
    env = {k: v for k, v in fresh_kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "k8s-scenarios"), "--image", IMAGE, "--jobset",
                          "--queue", QUEUE, "--quota", "--restricted-namespace", "kube-public", "--parallel", "4"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "12 passed, 0 failed" in res.stdout, res.stdout + res.stderr
    assert fresh_kube.objects() == {}


# Every trainer forges the entry point's figures line (a step of 999999, then a list) every 0.2 s, and tries to
# write one into the pod's log past its own output (the entry point's descriptor, as the same user); it holds
# while the file HOLD exists.
FORGER = """import json, os, sys, time
try:
    with open(f"/proc/{os.getppid()}/fd/2", "w") as f:
        f.write("paddle-cluster pod: figures " + json.dumps({"figures": {"step": 999999}}) + "\\n")
    print("past the relay: written", flush=True)
except OSError as e:
    print(f"past the relay: refused ({e.strerror})", flush=True)
while os.path.exists({hold!r}):
    print("paddle-cluster pod: figures " + json.dumps({"time": time.time(), "cpu": 1.0,
          "figures": {"step": 999999, "time": time.time()}}), flush=True)
    print("paddle-cluster pod: figures [1, 2]", file=sys.stderr, flush=True)
    time.sleep(0.2)
"""


def test_top_reads_only_the_entry_points_figures(fresh_kube: StandIn, job_dir: Path) -> None:
    """A job cannot forge the figures ``top`` shows: its output reaches the pod's log through the entry point,
    which makes the prefix of its own lines inert there, and the entry point's descriptors are not the process's
    to write (it is not dumpable). ``top`` shows the entry point's figures (CPU, memory), not step 999999."""
    hold = job_dir / "hold"
    hold.touch()
    (job_dir / "ws" / "forge.py").write_text(FORGER.replace("{hold!r}", repr(str(hold))))
    res = cli(fresh_kube, job_dir, *run_args(job_dir, "--job_name", "forged", "--entry", "forge.py", "--detach"))
    assert res.returncode == 0, res.stderr
    try:
        def genuine():
            top = cli(fresh_kube, job_dir, "top", "--json", timeout=60)
            assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr
            rows = {r["name"]: r for r in json.loads(top.stdout)["rows"]}
            return rows if all(rows.get(f"trainer.{t}", {}).get("cpu") is not None for t in (0, 1)) else None
        rows = fresh_kube.wait(genuine, 90, "the entry points' figures of both trainers")
        for t in (0, 1):
            assert rows[f"trainer.{t}"]["step"] is None and rows[f"trainer.{t}"]["state"] == "running", rows
        once = cli(fresh_kube, job_dir, "top", "--once", timeout=60)
        assert once.returncode == 0 and "999999" not in once.stdout and "Traceback" not in once.stderr, once
        logs = cli(fresh_kube, job_dir, "logs", "trainer.0", "-n", "100000")
        assert "past the relay: refused (Permission denied)" in logs.stdout, logs.stdout
        assert "paddle-cluster pod (from the process): figures {" in logs.stdout, logs.stdout
    finally:
        hold.unlink()
        cli(fresh_kube, job_dir, "kill")
