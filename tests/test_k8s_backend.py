"""``run --backend k8s``: the kubectl command lines it runs (as data), how it reads what kubectl prints (pod
documents shaped and validated as the API server returns them), the plan it supervises, and -- with the real
kubectl of this machine and no cluster -- that it fails cleanly. What needs a real cluster is in
docs/backends.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from kube.validate import env_of
from kubernetes.client import models as M
from rt_helpers import free_port_range

from paddle_cluster.contract import PSERVER, TRAINER, JobEnv
from paddle_cluster.launch import preflight
from paddle_cluster.launch.backends.base import JobRefused, NodeLost, Requeued
from paddle_cluster.launch.backends.k8s import jobwatch
from paddle_cluster.launch.backends.k8s import manifests as k8s
from paddle_cluster.launch.backends.k8s.backend import K8sOptions, PodWatch, log_events
from paddle_cluster.launch.backends.k8s.jobwatch import JobWatch
from paddle_cluster.launch.backends.k8s.kubectl import (
    INDEX_ANNOTATION,
    KILLED,
    KILLED_ANNOTATION,
    Kubectl,
    PodState,
    pod_states,
    pod_summary,
    states_of,
    watch_events,
)
from paddle_cluster.launch.backends.k8s.pods import pod_row
from paddle_cluster.launch.config import parse_config
from paddle_cluster.launch.plan import JobSpec, build_plan
from paddle_cluster.node import messages as m

REPO = Path(__file__).resolve().parent.parent
CFG = parse_config({"HOSTS": ["a", "b"], "PADDLE_PORT": 9000}, "test")


def test_every_command_names_the_namespace_and_only_this_jobs_objects() -> None:
    k = Kubectl("ml", "paddle-cluster/job=fit")
    ns = ["kubectl", "--namespace", "ml"]
    sel = ["--selector", "paddle-cluster/job=fit"]
    assert k.create() == [*ns, "create", "--filename", "-"]
    assert k.get_named(["secret/fit-secret", "service/fit"]) == [*ns, "get", "secret/fit-secret", "service/fit",
                                                                 "--ignore-not-found", "--output", "json"]
    assert k.get_pods() == [*ns, "get", "pods", *sel, "--output", "json"]
    assert k.get() == [*ns, "get", "jobs.batch,pods", *sel, "--output", "wide"]
    assert k.watch_pods() == [*ns, "get", "pods", *sel, "--watch", "--output-watch-events", "--output", "json"]
    assert k.delete(wait=True) == [*ns, "delete", "jobs.batch,services,secrets,configmaps", *sel, "--ignore-not-found",
                                   "--cascade=foreground", "--wait=true"]
    assert k.kill_pods() == [*ns, "delete", "pods", *sel, "--ignore-not-found", "--grace-period=0", "--force",
                             "--wait=false"]
    assert k.can_i("create", "jobs.batch") == [*ns, "auth", "can-i", "create", "jobs.batch"]
    # A subresource by its flag: kubectl reads "pods/log" as the pod named "log".
    assert k.can_i("get", "pods/log") == [*ns, "auth", "can-i", "get", "pods", "--subresource=log"]


def test_the_plan_has_one_node_per_pod_and_the_manifests_contract() -> None:
    opts = K8sOptions("img:1", "ml", 2, 3)
    spec = JobSpec(CFG, "fit", trainer_args=("--passes", "3"))
    name, topology = opts.topology(spec, False, False)
    plan = build_plan(spec, topology)
    job = opts.job(plan, name, b"", False)
    assert [(n.node, [p.name for p in n.procs]) for n in plan.nodes] == [
        (0, ["pserver.0"]), (1, ["pserver.1"]), (2, ["trainer.0"]), (3, ["trainer.1"]), (4, ["trainer.2"])]
    assert plan.env == job.env and len(plan.env.pservers) == 2 and plan.env.trainers == 3
    assert plan.addresses[0] == "fit-pserver-0.fit.ml.svc" and plan.addresses[2] == "fit-trainer-0.fit.ml.svc"
    assert plan.nodes[3].procs[0].cmd == "python3 train.py --passes 3"
    assert plan.nodes[3].procs[0].env["PADDLE_TRAINER_ID"] == "1"
    # The job-wide part is exactly what each pod's container carries (the secret is there by reference).
    (c,) = k8s.manifests(job)[3]["spec"]["template"]["spec"]["containers"]
    assert {**plan.nodes[2].environ, "PADDLE_TRAINING_ROLE": TRAINER, "TRAINING_ROLE": TRAINER} == env_of(c)
    assert JobEnv.from_environ(env_of(c)).pservers == plan.env.pservers


# -- reading kubectl's output ---------------------------------------------------------------------------------

def pod(role: str, index: int, phase: str, state: Optional[Dict[str, Any]] = None,
        conditions: Optional[List[Dict[str, Any]]] = None, **status: Any) -> Dict[str, Any]:
    """A pod of the job as the API server returns it, checked against the official V1Pod model."""
    name = f"fit-{role}-{index}"
    doc: Dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-x7k2p", "namespace": "ml",
                     "labels": {k8s.LABEL_JOB: "fit", k8s.LABEL_ROLE: role, INDEX_ANNOTATION: str(index)},
                     "annotations": {INDEX_ANNOTATION: str(index)}},
        "spec": {"hostname": name, "subdomain": "fit", "nodeName": "worker-3",
                 "containers": [{"name": role, "image": "img:1"}]},
        "status": {"phase": phase, **status},
    }
    if state is not None:
        doc["status"]["containerStatuses"] = [{"name": role, "image": "img:1", "imageID": "", "ready": False,
                                               "restartCount": 0, "state": state}]
        doc["status"]["podIP"] = f"10.1.0.{index + 10}"
    if conditions is not None:
        doc["status"]["conditions"] = conditions
    M.V1Pod.model_validate(doc)  # the field names and types are the API's
    return doc


def listing(*pods: Dict[str, Any]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(pods)})


UNSCHEDULABLE = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                  "message": "0/3 nodes are available: 3 Insufficient cpu."}]


def test_pod_states_from_kubectl_json() -> None:
    got = pod_states(listing(
        pod("pserver", 0, "Pending", conditions=UNSCHEDULABLE),
        pod("pserver", 1, "Pending", {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}),
        pod("trainer", 0, "Running", {"running": {"startedAt": "2026-11-23T09:00:00Z"}}),
        pod("trainer", 1, "Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
        pod("trainer", 2, "Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}}),
        pod("trainer", 3, "Failed", reason="Evicted", message="The node was low on resource: memory."),
    ))
    assert [(p.hostname, p.role, p.index, p.state, p.exit_code) for p in got] == [
        ("fit-pserver-0", PSERVER, 0, "", None), ("fit-pserver-1", PSERVER, 1, "waiting", None),
        ("fit-trainer-0", TRAINER, 0, "running", None), ("fit-trainer-1", TRAINER, 1, "terminated", 137),
        ("fit-trainer-2", TRAINER, 2, "terminated", 0), ("fit-trainer-3", TRAINER, 3, "terminated", None)]
    assert [pod_summary(p) for p in got] == [
        "pending: Unschedulable: 0/3 nodes are available: 3 Insufficient cpu.",
        "pending: ImagePullBackOff: Back-off pulling image", "running", "exited 137 (OOMKilled)", "exited 0",
        "exited ? (Evicted: The node was low on resource: memory.)"]
    assert got[2].pod_ip == "10.1.0.10" and got[2].node_name == "worker-3" and got[2].name == "fit-trainer-0-x7k2p"


def test_status_names_each_pod_where_a_pid_would_be() -> None:
    (p,) = pod_states(listing(pod("trainer", 1, "Running", {"running": {}})))
    row = pod_row(p, "Pass 0: loss 3.2")
    assert (row.node, row.host, row.address, row.name, row.state) == (
        "fit-trainer-1", "worker-3", "10.1.0.11", "trainer.1", "running")
    assert row.pid is None and row.pid_text == "pod/fit-trainer-1-x7k2p"  # no pid of ours: the process is the pod
    assert json.loads(preflight.as_json([row]))[0]["process"] == "pod/fit-trainer-1-x7k2p"

def _watch() -> PodWatch:
    return PodWatch({(PSERVER, 0): 0, (TRAINER, 0): 1, (TRAINER, 1): 2})


def test_pod_watch_reports_each_change_once() -> None:
    w = _watch()
    pending = [pod("pserver", 0, "Pending", conditions=UNSCHEDULABLE)]
    first = w.update(pod_states(listing(*pending)))
    assert first == [m.Note(0, "pod fit-pserver-0-x7k2p: Unschedulable: 0/3 nodes are available: 3 Insufficient "
                               "cpu.")]
    assert w.update(pod_states(listing(*pending))) == []  # unchanged: nothing new
    running = pod("pserver", 0, "Running", {"running": {}})
    tr = pod("trainer", 0, "Running", {"running": {}})
    assert w.update(pod_states(listing(running, tr))) == [m.Started(0, "pserver.0", 0), m.Started(1, "trainer.0", 0)]
    done = pod("trainer", 0, "Failed", {"terminated": {"exitCode": 2, "reason": "Error"}})
    assert w.update(pod_states(listing(running, done))) == [m.Exited(1, "trainer.0", 2, None, "")]
    assert w.update(pod_states(listing(running, done))) == []
    # A pod whose process ran and then vanished (deleted by someone else) is a lost node.
    assert w.update(pod_states(listing(done))) == [NodeLost(0, "pod fit-pserver-0-x7k2p was deleted while its "
                                                             "process ran")]


def test_pods_marked_by_kill_stop_the_job_as_killed_not_lost() -> None:
    """``kill`` annotates the pods before deleting them: the run following them ends "stopped by paddle-cluster
    kill", whatever exit code or disappearance follows."""
    w = _watch()
    running = [pod("pserver", 0, "Running", {"running": {}}), pod("trainer", 0, "Running", {"running": {}})]
    w.update(pod_states(listing(*running)))
    for p in running:
        p["metadata"]["annotations"][KILLED_ANNOTATION] = KILLED
    assert w.update(pod_states(listing(*running))) == [m.Stopping(0, "stopped by paddle-cluster kill", by_kill=True)]
    assert w.update(pod_states(listing(*running))) == []  # once for the job


def test_a_pod_that_cannot_start_fails_the_job_at_once() -> None:
    w = _watch()
    bad = pod("trainer", 1, "Pending", {"waiting": {"reason": "CreateContainerConfigError",
                                                    "message": 'secret "fit-secret" not found'}})
    assert w.update(pod_states(listing(bad))) == [
        m.NotReady(2, 'pod fit-trainer-1-x7k2p: CreateContainerConfigError: secret "fit-secret" not found')]
    oom = pod("trainer", 0, "Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}})
    assert w.update(pod_states(listing(oom))) == [m.Started(1, "trainer.0", 0),
                                                  m.Exited(1, "trainer.0", 137, None, "OOMKilled")]


def test_log_lines_become_events() -> None:
    assert log_events(1, "trainer.0", "Pass 0: loss 3.2") == [m.Log(1, "trainer.0", "Pass 0: loss 3.2")]
    ready = "paddle-cluster pod: ready: trainer 0: every pserver listens; starting python3 train.py"
    assert log_events(1, "trainer.0", ready) == [m.Log(1, "trainer.0", ready), m.Ready(1)]
    err = "paddle-cluster pod: error: no pserver listening on fit-pserver-0.fit.ml.svc:9000 within the start timeout"
    assert log_events(1, "trainer.0", err)[1] == m.NotReady(1, err[len("paddle-cluster pod: error: "):])


def test_states_of_unknown_pods_are_ignored() -> None:
    other = pod("trainer", 0, "Running", {"running": {}})
    other["metadata"]["labels"][k8s.LABEL_ROLE] = "sidecar"
    assert pod_states(listing(other)) == []
    assert PodWatch({}).update([PodState("x", "x", TRAINER, 7, "Running", "running")]) == []


# -- the real kubectl, no cluster ------------------------------------------------------------------------------

def _cli(tmp: Path, *args: str, path: Optional[str] = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "KUBE"))}
    port = free_port_range(1)  # nothing listens there: the API server is unreachable
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'https://127.0.0.1:{port}', insecure-skip-tls-verify: true}}}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {token: x}}]\n")
    env.update(PYTHONPATH=str(REPO), KUBECONFIG=str(kubeconfig), HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "paddle_cluster", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=120)


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on this machine")


@needs_kubectl
def test_run_without_a_reachable_cluster_fails_in_one_line(tmp_path: Path) -> None:
    res = _cli(tmp_path, "run", "--backend", "k8s", "--image", "img:1", "--job_name", "fit")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert "kubectl --namespace default auth can-i" in line and "127.0.0.1" in line, line
    assert not list((tmp_path / "state").glob("**/*.json"))  # nothing started, so nothing remembered


@needs_kubectl
def test_kill_and_status_of_a_k8s_job_without_a_cluster_fail_cleanly(tmp_path: Path) -> None:
    (tmp_path / "conf.py").write_text('HOSTS = ["a"]\nBACKEND = "k8s"\nK8S_NAMESPACE = "ml"\n')
    for args in (("kill", "--job_name", "fit"), ("status", "--job_name", "fit"),
                 ("logs", "trainer.0", "--job_name", "fit")):
        res = _cli(tmp_path, *args)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert "kubectl --namespace ml" in res.stderr and "127.0.0.1" in res.stderr, res.stderr


def test_without_kubectl_the_error_says_so(tmp_path: Path) -> None:
    for args in (["run", "--backend", "k8s", "--image", "img:1"], ["check", "--backend", "k8s"]):
        res = _cli(tmp_path, *args, path=str(tmp_path / "empty"))
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert "kubectl not found on PATH: install kubectl (https://kubernetes.io/docs/tasks/tools/)" in res.stderr, \
            res.stderr


def test_check_namespace_is_refused_for_another_backend(tmp_path: Path) -> None:
    res = _cli(tmp_path, "check", "--namespace", "ml", path=str(tmp_path / "empty"))
    assert res.returncode == 2 and "--namespace: for --backend k8s only (backend ssh is checked here)" in \
        res.stderr, res.stderr


@needs_kubectl
def test_check_without_a_reachable_cluster_says_so_once(tmp_path: Path) -> None:
    res = _cli(tmp_path, "check", "--backend", "k8s")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert "check --backend k8s: kubectl's current context did not answer" in line and "127.0.0.1" in line, line
    assert "KUBECONFIG" in line, line


# -- check --backend k8s against the Kubernetes stand-in --------------------------------------------------------

def _user(kube, tmp: Path, deny: str = "") -> dict:
    """A user's directory (conf.py as the README has it, and K8S_NAMESPACE) and shell, whose kubeconfig names the
    stand-in's API server and a user it denies what ``deny`` lists."""
    (tmp / "conf.py").write_text('HOSTS = ["a", "b"]\nROOT_DIR = "/tmp/paddle"\nK8S_NAMESPACE = "ml"\n')
    env = {k: v for k, v in kube.env.items() if not k.startswith("PADDLE_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"),
               KUBECONFIG=str(kube.kubeconfig(deny)))
    return env


def _check(kube, tmp: Path, *args: str, deny: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paddle_cluster", "check", "--backend", "k8s", *args], cwd=tmp,
                          env=_user(kube, tmp, deny), capture_output=True, text=True, timeout=120)


def test_check_k8s_asks_for_every_permission_the_backend_uses(kube_cluster, tmp_path: Path) -> None:
    res = _check(kube_cluster, tmp_path, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout)
    asked = {(r["verb"], r["resource"]) for r in rows}
    kinds = ("jobs.batch", "services", "secrets", "configmaps")
    assert asked == {(v, k) for k in kinds for v in ("create", "get", "list", "delete")} | {
        ("watch", "jobs.batch"), ("patch", "services"), ("patch", "secrets"), ("patch", "configmaps"),
        ("get", "pods"), ("list", "pods"), ("watch", "pods"), ("patch", "pods"), ("delete", "pods"),
        ("get", "pods/log"), ("list", "events"), ("watch", "events")} and len(rows) == len(asked), rows
    assert all(r["ok"] and r["kind"] == "permission" and r["namespace"] == "ml" and r["needed_by"] for r in rows), rows
    table = _check(kube_cluster, tmp_path, "--namespace", "team-a")  # the option over the config's K8S_NAMESPACE
    assert table.returncode == 0 and "team-a" in table.stdout and " NO " not in table.stdout, table.stdout


def test_check_k8s_names_each_missing_permission_and_fails(kube_cluster, tmp_path: Path) -> None:
    res = _check(kube_cluster, tmp_path, deny="create jobs.batch,get pods/log")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    lines = [ln.strip() for ln in res.stderr.splitlines()]
    assert "paddle-cluster: error: 2 of 28 permission(s) failed the check:" in lines, res.stderr
    missing = [ln for ln in lines if ln.startswith("may not")]
    assert [ln.split(" (")[0] for ln in missing] == ["may not create jobs.batch in namespace ml",
                                                      "may not get pods/log in namespace ml"], res.stderr
    assert "'kubectl --namespace ml auth can-i get pods --subresource=log' says no" in missing[1], missing
    assert len([ln for ln in res.stdout.splitlines() if " NO " in ln]) == 2, res.stdout


def test_check_k8s_with_a_queue_asks_for_the_jobset_rights_too(kube_cluster, tmp_path: Path) -> None:
    """--queue (or --jobset) makes the job one JobSet: check then asks for what run and kill do to JobSets, and
    --queue for what run reads of Kueue's verdict (the Workload)."""
    res = _check(kube_cluster, tmp_path, "--queue", "q", deny="delete jobsets.jobset.x-k8s.io")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "paddle-cluster: error: 1 of 33 permission(s) failed the check:" in res.stderr, res.stderr
    assert "may not delete jobsets.jobset.x-k8s.io in namespace ml ('kubectl --namespace ml auth can-i delete " \
           "jobsets.jobset.x-k8s.io' says no; run and kill delete the job's JobSet)" in res.stderr, res.stderr
    rows = json.loads(_check(kube_cluster, tmp_path, "--queue", "q", "--json").stdout)
    assert [r["verb"] for r in rows if r["resource"] == "workloads.kueue.x-k8s.io"] == ["list"], rows  # its verdict
    rows = json.loads(_check(kube_cluster, tmp_path, "--jobset", "--json").stdout)
    assert not [r for r in rows if "kueue" in r["resource"]], rows
    assert {(r["verb"], r["resource"]) for r in rows if "jobset" in r["resource"]} == {
        (v, "jobsets.jobset.x-k8s.io") for v in ("create", "get", "list", "delete")}, rows
    assert all(r["ok"] for r in rows), rows


def test_run_refuses_before_creating_anything_when_a_permission_is_missing(kube_cluster, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "run", "--backend", "k8s", "--image", "img:1",
                          "--job_name", "denied"], cwd=tmp_path,
                         env=_user(kube_cluster, tmp_path, deny="create secrets"), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "kubectl says you may not create secrets in namespace ml" in res.stderr, res.stderr
    assert not [k for k in kube_cluster.objects() if "/ml/" in k], kube_cluster.objects()


@pytest.mark.parametrize("args,named", [
    (["--max_restarts", "2"], "--max_restarts"),
    (["--elastic"], "--elastic"),
    (["--resume_from", "old"], "--resume_from"),
])
def test_what_k8s_cannot_do_is_refused_before_anything_starts(tmp_path: Path, args: List[str], named: str) -> None:
    (tmp_path / "ws").mkdir(exist_ok=True)
    (tmp_path / "ws" / "train.py").write_text("print('x')\n")  # past the entry-script preflight
    res = _cli(tmp_path, "run", "--backend", "k8s", "--image", "img:1", *args, path=str(tmp_path / "empty"))
    assert res.returncode != 0 and named in res.stderr and "kubectl not found" not in res.stderr, res.stderr


def test_run_k8s_needs_an_image(tmp_path: Path) -> None:
    res = _cli(tmp_path, "run", "--backend", "k8s")
    assert res.returncode != 0 and "--image" in res.stderr and "K8S_IMAGE" in res.stderr, res.stderr


@pytest.mark.parametrize("indent", [None, 4])
def test_watch_events_are_read_as_kubectl_prints_them(indent: Optional[int]) -> None:
    """``get --watch -o json`` prints each event as one line (kubectl 1.32, as test_k8s_run's real kubectl
    shows) or, as older ones did, as an indented document, one after another."""
    docs = [{"type": "ADDED", "object": pod("trainer", 0, "Pending")},
            {"type": "MODIFIED", "object": pod("trainer", 0, "Running", {"running": {}})},
            {"type": "DELETED", "object": pod("trainer", 0, "Running", {"running": {}})}]
    text = "".join(json.dumps(d, indent=indent) + "\n" for d in docs)
    assert list(watch_events(text.splitlines(keepends=True))) == docs


# -- the Jobs' conditions and the namespace's Events ----------------------------------------------------------------

def job_doc(role: str, *conditions: Dict[str, Any], queue: str = "") -> Dict[str, Any]:
    """A Job of the job as the API server returns it, checked against the official V1Job model."""
    doc = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": f"fit-{role}", "namespace": "ml", "uid": f"uid-{role}",
                        "labels": {k8s.LABEL_JOB: "fit", **({k8s.QUEUE_LABEL: queue} if queue else {})}},
           "spec": {"template": {"spec": {"containers": [{"name": role, "image": "img:1"}]}}},
           "status": {"conditions": [{"status": "True", "lastTransitionTime": "2026-11-23T09:00:00Z", **c}
                                     for c in conditions]}}
    M.V1Job.model_validate(doc)
    return doc


def event_doc(kind: str, name: str, uid: str, reason: str, message: str, type_: str = "Normal") -> Dict[str, Any]:
    doc = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{name}.{uid}.{reason}", "namespace": "ml"},
           "involvedObject": {"kind": kind, "name": name, "namespace": "ml", "uid": uid},
           "reason": reason, "message": message, "type": type_, "count": 1}
    M.CoreV1Event.model_validate(doc)
    return doc


def _jobwatch() -> JobWatch:
    nodes = {(PSERVER, 0): 0, (TRAINER, 0): 1, (TRAINER, 1): 2}
    return JobWatch({"fit-pserver": [0], "fit-trainer": [1, 2]}, lambda p: nodes.get((p.role, p.index)))


def test_a_suspended_job_holds_the_start_timeout_until_admitted() -> None:
    w = _jobwatch()
    suspended = {"type": "Suspended", "reason": "JobSuspended", "message": "Job suspended"}
    assert w.jobs([job_doc("trainer", suspended, queue="q")]) == [m.Note(1, "job.batch/fit-trainer is suspended "
                                                                    "(waiting for Kueue queue q to admit it); the "
                                                                    "start timeout waits meanwhile")]
    assert w.holding() and w.jobs([job_doc("trainer", suspended, queue="q")]) == []
    assert w.jobs([job_doc("trainer")]) == [m.Note(1, "job.batch/fit-trainer was admitted (resumed): its pods are "
                                                      "created")]
    assert not w.holding()


def test_a_failed_job_says_its_reason_and_a_failed_pod_leaves_it_to_the_pod() -> None:
    w = _jobwatch()
    deadline = {"type": "FailureTarget", "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline"}
    assert w.jobs([job_doc("pserver", deadline)]) == [JobRefused(
        "job.batch/fit-pserver failed: DeadlineExceeded: Job was active longer than specified deadline")]
    assert w.jobs([job_doc("pserver", deadline, {**deadline, "type": "Failed"})]) == []  # once
    backoff = {"type": "Failed", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified "
               "backoff limit"}
    assert w.jobs([job_doc("trainer", backoff)]) == [m.Note(1, "job.batch/fit-trainer failed: BackoffLimitExceeded: "
                                                               "Job has reached the specified backoff limit")]


def test_events_name_the_object_and_the_reason_once_its_uid_is_known() -> None:
    w = _jobwatch()
    refused = event_doc("Job", "fit-trainer", "uid-trainer", "FailedCreate", 'Error creating: pods "fit-trainer-0-" '
                        'is forbidden: failed quota: compute: must specify limits.memory for: trainer', "Warning")
    stale = event_doc("Job", "fit-trainer", "uid-of-an-earlier-run", "FailedCreate", "Error creating: old")
    assert w.events([refused, stale]) == []  # no Job of this run seen yet
    assert w.jobs([job_doc("trainer")]) == [JobRefused(
        'job.batch/fit-trainer cannot create its pods: pods "fit-trainer-0-" is forbidden: failed quota: compute: '
        'must specify limits.memory for: trainer')]
    assert w.events([refused, stale]) == []  # each once; another run's never
    full = event_doc("Job", "fit-trainer", "uid-trainer", "FailedCreate", 'Error creating: pods "fit-trainer-1-" is '
                     "forbidden: exceeded quota: compute, requested: requests.cpu=1, used: requests.cpu=4, limited: "
                     "requests.cpu=4", "Warning")
    assert w.events([full])[0].line.startswith("job.batch/fit-trainer waits for room in the namespace's quota: ")
    assert w.holding()
    assert w.events([event_doc("Job", "fit-trainer", "uid-trainer", "SuccessfulCreate", "Created pod: x")]) == []
    assert not w.holding()


def test_an_image_pull_holds_the_start_timeout_and_is_said_again_while_it_lasts(monkeypatch) -> None:
    w = _jobwatch()
    p = pod("trainer", 1, "Pending", {"waiting": {"reason": "ContainerCreating"}})
    p["metadata"]["uid"] = "uid-pod"
    w.pods([p])
    assert w.events([event_doc("Pod", "fit-trainer-1-x7k2p", "uid-pod", "Pulling", 'Pulling image "img:1"')]) == [
        m.Note(2, "pod/fit-trainer-1-x7k2p: pulling image img:1; the start timeout waits meanwhile")]
    assert w.holding() and w.due() == []
    clock = time.monotonic() + 125
    monkeypatch.setattr(jobwatch.time, "monotonic", lambda: clock)
    assert w.due() == [m.Note(2, "pod/fit-trainer-1-x7k2p: pulling image img:1 for 2m")]
    pulled = 'Successfully pulled image "img:1" in 2m5.1s (2m5.1s including waiting)'
    assert w.events([event_doc("Pod", "fit-trainer-1-x7k2p", "uid-pod", "Pulled", pulled)]) == [
        m.Note(2, f"pod/fit-trainer-1-x7k2p: {pulled}")]
    assert not w.holding()


def test_a_pull_that_failed_is_no_progress_whatever_order_its_events_come_in() -> None:
    w = _jobwatch()
    p = pod("trainer", 1, "Pending", {"waiting": {"reason": "ErrImagePull", "message": "not found"}})
    p["metadata"]["uid"] = "uid-pod"
    w.pods([p])
    # A listing gives the Events by name: the kubelet's retry's Pulling after the Failed that ended the pull.
    w.events([event_doc("Pod", "fit-trainer-1-x7k2p", "uid-pod", "Failed", "Error: ErrImagePull", "Warning"),
              event_doc("Pod", "fit-trainer-1-x7k2p", "uid-pod", "Pulling", 'Pulling image "img:1"')])
    assert not w.holding()  # the start timeout runs: the error names the pull


def test_an_unschedulable_pod_holds_the_start_timeout_and_a_pending_timeout_names_why(monkeypatch) -> None:
    nodes = {(PSERVER, 0): 0, (TRAINER, 0): 1, (TRAINER, 1): 2}
    w = JobWatch({"fit-pserver": [0], "fit-trainer": [1, 2]}, lambda p: nodes.get((p.role, p.index)),
                 pending_timeout=300)
    why = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
    p = pod("trainer", 1, "Pending", conditions=[{"type": "PodScheduled", "status": "False",
                                                   "reason": "Unschedulable", "message": why}])
    p["metadata"]["uid"] = "uid-pod"
    w.pods([p])
    assert w.holding() and w.due() == []  # the autoscaler may add a node: the start timeout waits
    clock = time.monotonic() + 301
    monkeypatch.setattr(jobwatch.time, "monotonic", lambda: clock)
    assert w.due() == [JobRefused(f"the cluster held the job for 300 s (--pending-timeout): "
                                  f"pod/fit-trainer-1-x7k2p: Unschedulable: {why}")]
    assert w.due() == []  # once
    placed = pod("trainer", 1, "Pending", {"waiting": {"reason": "ContainerCreating"}})
    placed["metadata"]["uid"] = "uid-pod"
    w.pods([placed])
    assert not w.holding()


def workload_doc(*conditions: Dict[str, Any]) -> Dict[str, Any]:
    """The job's Workload as Kueue keeps it (kueue.x-k8s.io/v1beta1: no official model here)."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": "jobset-fit-1a2b3", "namespace": "ml", "uid": "uid-wl",
                         "ownerReferences": [{"kind": "JobSet", "name": "fit", "uid": "uid-js"}]},
            "spec": {"queueName": "q"}, "status": {"conditions": list(conditions)}}


def test_an_eviction_takes_the_job_back_once_and_a_pending_timeout_bounds_the_wait_for_admission(
        monkeypatch) -> None:
    nodes = {(PSERVER, 0): 0, (TRAINER, 0): 1, (TRAINER, 1): 2}
    w = JobWatch({"fit-pserver": [0], "fit-trainer": [1, 2]}, lambda p: nodes.get((p.role, p.index)), "q",
                 pending_timeout=300)
    why = "Preempted to accommodate a workload (UID: u1, JobUID: u2) due to prioritization in the ClusterQueue"
    admitted = [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved"},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "admitted"}]
    assert w.workloads([workload_doc(*admitted)], ["fit"]) == [] and not w.holding()
    assert w.jobs([job_doc("trainer")]) == []  # it ran
    evicted = [{"type": "Evicted", "status": "True", "reason": "Preempted", "message": why},
               {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": why},
               {"type": "Admitted", "status": "False", "reason": "NoReservation", "message": "none"}]
    assert w.workloads([workload_doc(*evicted)], ["fit"]) == [
        m.Note(0, f"Kueue evicted the job (workload.kueue.x-k8s.io/jobset-fit-1a2b3): Preempted: {why}; its pods are "
                  "stopped, and it waits to be admitted again to queue q"), Requeued(f"Preempted: {why}")]
    assert w.workloads([workload_doc(*evicted)], ["fit"]) == [] and w.holding()  # once
    suspended = {"type": "Suspended", "reason": "JobSuspended", "message": "Job suspended"}
    assert w.jobs([job_doc("trainer", suspended, queue="q")]) == []  # the eviction's line says it
    clock = time.monotonic() + 301
    assert w.due() == []
    monkeypatch.setattr(jobwatch.time, "monotonic", lambda: clock)
    (refused,) = w.due()
    assert refused == JobRefused("the cluster held the job for 300 s (--pending-timeout): Kueue evicted the job "
                                 f"(workload.kueue.x-k8s.io/jobset-fit-1a2b3) and has not admitted it again: {why}")
    again = [*admitted, {"type": "Evicted", "status": "False", "reason": "QuotaReserved",
                         "message": f"Previously: {why}"}]
    assert w.workloads([workload_doc(*again)], ["fit"]) == [
        m.Note(0, "Kueue admitted the job again (workload.kueue.x-k8s.io/jobset-fit-1a2b3): its pods are created")]
    assert w.jobs([job_doc("trainer")]) == [] and not w.holding()


def test_pods_an_eviction_stopped_are_forgotten_and_the_next_ones_followed() -> None:
    w = _watch()
    running = [pod("pserver", 0, "Running", {"running": {}}), pod("trainer", 0, "Running", {"running": {}})]
    assert len(w.update(pod_states(listing(*running)))) == 2
    w.forget()
    stopped = [pod("pserver", 0, "Failed", {"terminated": {"exitCode": 143, "reason": "Error"}})]
    assert w.update(pod_states(listing(*stopped))) == []  # neither its exit nor the trainer's pod gone
    again = pod("pserver", 0, "Running", {"running": {}})
    again["metadata"]["name"] = "fit-pserver-0-b9d4q"
    assert w.update(pod_states(listing(again))) == [m.Started(0, "pserver.0", 0)]
    assert w.started == {0: "fit-pserver-0-b9d4q"}


def test_pods_waiting_for_the_same_reason_say_it_once_and_the_error_names_them_all() -> None:
    watch = PodWatch({(PSERVER, 0): 0, (TRAINER, 0): 1, (TRAINER, 1): 2})
    pull = {"reason": "ErrImagePull", "message": 'rpc error: code = NotFound desc = "reg/typo:1": not found'}
    backoff = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "reg/typo:1"'}
    said = []
    for state in (pull, backoff, pull, backoff):  # a kubelet's retries
        said += watch.update(states_of([pod(r, i, "Pending", {"waiting": state}) for r, i in
                                        (("pserver", 0), ("trainer", 0), ("trainer", 1))]))
    assert said == [m.Note(0, f"pod fit-pserver-0-x7k2p: ErrImagePull: {pull['message']}")]
    assert watch.why_waiting() == (f"ErrImagePull: {pull['message']} (pods fit-pserver-0-x7k2p, fit-trainer-0-x7k2p, "
                                   "fit-trainer-1-x7k2p)")
