"""``paddle-cluster render k8s``: every rendered document validated offline against the official Kubernetes
models plus our own enum/name/cross-reference checks (tests/kube/validate.py), the env contract the pods get, and
negative tests showing the checks catch what they claim to."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml
from click.testing import CliRunner, Result
from k8s_job import k8s_job
from kube.validate import env_of, jobset_problems, problems, restricted_problems
from kubernetes.client import models as M

from paddle_cluster.cli import main
from paddle_cluster.contract import JobEnv
from paddle_cluster.launch.backends.k8s import manifests as k8s
from paddle_cluster.launch.config import builtin_default, parse_config


def cli(*args: str, cwd: Path) -> Result:
    """The real CLI, in this process (rendering is pure; a subprocess per case would only add start-up time)."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner(env={k: None for k in os.environ if k.startswith("PADDLE_")}).invoke(main, list(args))
    finally:
        os.chdir(old)


def render(tmp_path: Path, *args: str, conf: str = "") -> List[Dict[str, Any]]:
    if conf:
        (tmp_path / "conf.py").write_text(conf)
    res = cli("render", "k8s", *args, cwd=tmp_path)
    assert res.exit_code == 0, res.stderr
    return list(yaml.safe_load_all(res.stdout))


def by_kind(docs: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for d in docs:
        key = d["kind"] if d["kind"] != "Job" else d["metadata"]["labels"][k8s.LABEL_ROLE]
        out[key] = d
    return out


def container(job: Dict[str, Any]) -> Dict[str, Any]:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


THREE_HOSTS = ('HOSTS = ["a", "b", "c"]\nPSERVERS_PER_NODE = 1\nTRAINERS_PER_NODE = 2\nPADDLE_PORT = 9000\n'
               'PADDLE_PORTS_NUM = 2\nPADDLE_PORTS_NUM_FOR_SPARSE = 1\nROOT_DIR = "/data/jobs"\n'
               'ENV = {"OMP_NUM_THREADS": "1"}\n')


@pytest.mark.parametrize("conf,args,counts", [
    ("", ["--job_name", "fit"], (2, 2)),  # the built-in default's counts
    (THREE_HOSTS, ["--job_name", "fit"], (3, 6)),  # HOSTS x per-node counts
    (THREE_HOSTS, ["--job_name", "Big_Job.v2", "--pservers", "4", "--trainers", "11", "--namespace", "ml-team",
                   "--pserver-requests", "cpu=2,memory=4Gi", "--trainer-requests", "cpu=500m,nvidia.com/gpu=1",
                   "--job_workspace", "/opt/ws", "--", "--passes", "3", "--mode", "async"], (4, 11)),
])
def test_every_document_validates_and_fits(tmp_path: Path, conf: str, args: List[str], counts) -> None:
    docs = render(tmp_path, "--image", "registry.example/ml/fit:1", *args, conf=conf)
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Job", "Job"]
    assert problems(docs) == []
    k = by_kind(docs)
    assert (k["pserver"]["spec"]["completions"], k["trainer"]["spec"]["completions"]) == counts
    for role in ("pserver", "trainer"):
        spec = k[role]["spec"]
        assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimit"] == 0
        assert container(k[role])["command"][:4] == ["python3", "-m", "paddle_cluster.node", "pod"]
    assert k["Service"]["spec"]["clusterIP"] == "None"


def test_pods_find_pservers_by_the_names_kubernetes_gives_them(tmp_path: Path) -> None:
    """Each endpoint is <Job name>-<index> (an Indexed Job's pod hostname) . <subdomain> . <namespace> .svc,
    on the pserver container's ports; the rest of the contract (Fluid and v2 names) matches the counts."""
    docs = render(tmp_path, "--image", "img:1", "--job_name", "fit", "--namespace", "ml", "--", "--passes", "3",
                  conf=THREE_HOSTS)
    k = by_kind(docs)
    ps_job, tr_job = k["pserver"], k["trainer"]
    sub = ps_job["spec"]["template"]["spec"]["subdomain"]
    assert sub == tr_job["spec"]["template"]["spec"]["subdomain"] == k["Service"]["metadata"]["name"]
    for job, role in ((ps_job, "PSERVER"), (tr_job, "TRAINER")):
        environ = env_of(container(job))
        env = JobEnv.from_environ(environ)
        assert env is not None and env.role == role and env.trainers == tr_job["spec"]["completions"]
        assert [e.host for e in env.pservers] == [f"{ps_job['metadata']['name']}-{i}.{sub}.ml.svc"
                                                  for i in range(ps_job["spec"]["completions"])]
        ports = [p["containerPort"] for p in container(ps_job)["ports"]]
        assert [list(env.all_ports(i)) for i in range(len(env.pservers))] == [ports] * 3 == [[9000, 9001, 9002]] * 3
        assert (env.ports_num, env.ports_num_for_sparse) == (2, 1)
        hosts = ",".join(e.host for e in env.pservers)
        assert environ["PADDLE_PSERVER_IPS"] == environ["PADDLE_INIT_PSERVERS"] == hosts
        assert environ["PADDLE_PSERVER_PORT"] == environ["PADDLE_INIT_PORT"] == "9000"
        assert environ["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == "6" and environ["OMP_NUM_THREADS"] == "1"
        # Per-pod values come from the completion index at run time, never from the manifest.
        assert not {"PADDLE_TRAINER_ID", "PADDLE_PSERVER_ID", "PADDLE_CURRENT_IP"} & set(environ)
        mount = container(job)["volumeMounts"][0]["mountPath"]
        assert env.job_dir == mount == "/data/jobs/fit" and env.workspace == container(job)["workingDir"]
    assert container(tr_job)["args"] == ["python3", "train.py", "--passes", "3"]
    assert container(ps_job)["args"] == ["python3", "-m", "paddle_cluster.ps"]


def test_the_secret_is_only_in_the_secret(tmp_path: Path) -> None:
    (tmp_path / "conf.py").write_text(THREE_HOSTS)
    out = cli("render", "k8s", "--image", "img:1", "--job_name", "fit", cwd=tmp_path).stdout
    docs = list(yaml.safe_load_all(out))
    secret = docs[0]["stringData"][k8s.SECRET_KEY]
    assert len(secret) == 64 and out.count(secret) == 1
    for job in docs[2:]:
        # Not in the environment (PID 1's /proc/1/environ would show it to the pod's every process): a file of the
        # Secret's volume, read once by the entry point.
        assert not [e for e in container(job)["env"] if e["name"] == "PADDLE_JOB_SECRET"]
        (vol,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        assert vol["secret"] == {"secretName": docs[0]["metadata"]["name"], "defaultMode": 0o440,
                                 "items": [{"key": k8s.SECRET_KEY, "path": k8s.SECRET_KEY}]}
        (m,) = [m for m in container(job)["volumeMounts"] if m["name"] == vol["name"]]
        assert m == {"name": vol["name"], "mountPath": k8s.SECRET_DIR, "readOnly": True}
        command = container(job)["command"]
        assert command[command.index("--secret-file") + 1] == f"{k8s.SECRET_DIR}/{k8s.SECRET_KEY}"
    # Two renders are two jobs: their secrets differ.
    assert yaml.safe_load_all(cli("render", "k8s", "--image", "img:1", cwd=tmp_path).stdout).__next__()[
        "stringData"][k8s.SECRET_KEY] != secret


def test_every_object_carries_the_job_label(tmp_path: Path) -> None:
    (tmp_path / "conf.py").write_text(THREE_HOSTS)
    out = cli("render", "k8s", "--image", "img:1", "--job_name", "fit", "--namespace", "ml", cwd=tmp_path).stdout
    for d in yaml.safe_load_all(out):
        assert d["metadata"]["labels"][k8s.LABEL_JOB] == "fit" and d["metadata"]["namespace"] == "ml"
        if d["kind"] == "Job":
            assert d["spec"]["template"]["metadata"]["labels"][k8s.LABEL_JOB] == "fit"
    job_id = yaml.safe_load_all(out).__next__()["metadata"]["labels"][k8s.LABEL_ID]
    assert job_id.startswith("fit-")
    assert f"kubectl delete -n ml jobs.batch,services,secrets,configmaps -l {k8s.LABEL_ID}={job_id}" in out


# -- the checks catch what they claim to ----------------------------------------------------------------------

def _docs() -> List[Dict[str, Any]]:
    cfg = parse_config({"HOSTS": ["a", "b"]}, "test")
    return k8s.manifests(k8s_job(cfg, job_name="fit", image="img:1"))


def _job(docs, role="trainer"):
    return next(d for d in docs if d["kind"] == "Job" and d["metadata"]["labels"][k8s.LABEL_ROLE] == role)


MUTATIONS = {
    "misspelled field": (lambda d: _job(d)["spec"].__setitem__("completionMod", "Indexed"), "completionMod"),
    "misspelled nested field": (lambda d: container(_job(d)).__setitem__("workDir", "/w"), "workDir"),
    "wrong type": (lambda d: _job(d)["spec"].__setitem__("completions", "2"), "completions"),
    "missing required field": (lambda d: container(_job(d)).pop("name"), "name"),
    "unknown kind": (lambda d: d[1].__setitem__("kind", "Servce"), "Servce"),
    "wrong apiVersion": (lambda d: _job(d).__setitem__("apiVersion", "v1"), "'v1'"),
    "bad completionMode": (lambda d: _job(d)["spec"].__setitem__("completionMode", "Indexd"), "completionMode"),
    "restartPolicy a Job may not use": (lambda d: _job(d)["spec"]["template"]["spec"].__setitem__(
        "restartPolicy", "Always"), "restartPolicy"),
    "bad protocol": (lambda d: d[1]["spec"]["ports"][0].__setitem__("protocol", "tcp"), "protocol"),
    "bad quantity": (lambda d: container(_job(d))["resources"]["requests"].__setitem__("cpu", "lots"), "cpu"),
    "upper-case name": (lambda d: _job(d)["metadata"].__setitem__("name", "Fit-trainer"), "metadata.name"),
    "bad label value": (lambda d: _job(d)["metadata"]["labels"].__setitem__("x", "a b"), "label"),
    "secret key nobody holds": (lambda d: d[0]["stringData"].update({"other": d[0]["stringData"].pop(
        k8s.SECRET_KEY)}), "volume job-secret refers to"),
    "subdomain of no Service": (lambda d: _job(d)["spec"]["template"]["spec"].__setitem__("subdomain", "other"),
                                "subdomain"),
    "Service not headless": (lambda d: d[1]["spec"].__setitem__("clusterIP", "10.0.0.1"), "headless"),
    "Service selecting nothing": (lambda d: d[1]["spec"]["selector"].__setitem__(k8s.LABEL_JOB, "x"), "select"),
    "mount of no volume": (lambda d: container(_job(d))["volumeMounts"][0].__setitem__("name", "v"), "volume"),
}


def test_unmutated_documents_pass() -> None:
    assert problems(_docs()) == []


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_a_broken_document_is_caught(what: str) -> None:
    docs = copy.deepcopy(_docs())
    mutate, named = MUTATIONS[what]
    mutate(docs)
    found = problems(docs)
    assert found and any(named in p for p in found), found


def test_from_dict_would_not_catch_a_misspelling() -> None:
    """Why the checks use model_validate: the client's from_dict drops an unknown field without a word."""
    doc = copy.deepcopy(_job(_docs()))
    doc["spec"]["completionMod"] = "Indexed"
    assert M.V1Job.from_dict(doc).spec.completions == doc["spec"]["completions"]
    assert problems([doc])


# -- bad input ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,named", [
    (["--image", "img:1", "--job_name", "9lives"], "--job_name"),
    (["--image", "img:1", "--job_name", "x" * 60], "--job_name"),
    (["--image", "img:1", "--namespace", "Team_A"], "--namespace"),
    (["--image", "has space"], "--image"),
    (["--image", "img:1", "--pserver-requests", "cpu=lots"], "--pserver-requests"),
    (["--image", "img:1", "--trainer-requests", "gpu"], "--trainer-requests"),
    (["--image", "img:1", "--job_workspace", "ws"], "--job_workspace"),
])
def test_bad_input_is_one_clear_line(tmp_path: Path, args: List[str], named: str) -> None:
    res = cli("render", "k8s", *args, cwd=tmp_path)
    assert res.exit_code != 0 and res.stdout == "" and isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.stderr and named in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_collective_job_is_the_trainer_job_alone(tmp_path: Path) -> None:
    docs = render(tmp_path, "--image", "img:1", "--job_name", "ddp", "--collective", conf=THREE_HOSTS)
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Job"] and problems(docs) == []
    assert restricted_problems(docs) == []
    k = by_kind(docs)
    assert k["trainer"]["spec"]["completions"] == 6
    # Every trainer pod has its own address: MASTER_PORT is PADDLE_PORT, each takes the next; the pods resolve
    # the names (node/pod.py), so the manifests hold them.
    env = JobEnv.from_environ(env_of(container(k["trainer"])))
    assert env.pservers == () and env.master_port == 9000 and env.local_world_size == 1
    assert [str(e) for e in env.trainer_endpoints] == [f"ddp-trainer-{j}.ddp.default.svc:9001" for j in range(6)]
    assert [p["port"] for p in k["Service"]["spec"]["ports"]] == [9000, 9001]
    js = render(tmp_path, "--image", "img:1", "--job_name", "ddp", "--collective", "--jobset", conf=THREE_HOSTS)
    assert [rj["name"] for rj in js[1]["spec"]["replicatedJobs"]] == ["trainer"] and jobset_problems(js[1]) == []


def test_collective_pods_bind_their_own_address_unless_told_an_interface(tmp_path: Path) -> None:
    """gloo and NCCL in a pod bind the address of its hostname (its own) unless --pod-nic names an interface of
    the pods: neither the built-in local cluster's lo nor a conf.py's PADDLE_NIC (an interface of its HOSTS)."""
    for conf in ("", THREE_HOSTS + 'PADDLE_NIC = "ens5"\n'):
        (tmp_path / "conf.py").unlink(missing_ok=True)
        k = by_kind(render(tmp_path, "--image", "img:1", "--collective", conf=conf))
        env = env_of(container(k["trainer"]))
        assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(env), env
        proc = JobEnv.from_environ(env).for_process("TRAINER", 1, "10.0.0.7").to_environ()
        assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(proc), proc  # what node/pod.py gives it
    k = by_kind(render(tmp_path, "--image", "img:1", "--collective", "--pod-nic", "net1"))
    env = env_of(container(k["trainer"]))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "net1"


@pytest.mark.parametrize("args,named", [
    (["--collective", "--pservers", "2"], "--pservers"),
    (["--collective", "--pserver", "builtin"], "--pserver"),
])
def test_a_collective_job_refuses_pserver_options(tmp_path: Path, args: List[str], named: str) -> None:
    res = cli("render", "k8s", "--image", "img:1", *args, cwd=tmp_path)
    assert res.exit_code != 0 and res.stdout == "" and "this job has no pservers" in res.stderr, res.stderr
    assert named in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_build_from_the_builtin_default_uses_a_pod_path_not_this_machines() -> None:
    job = k8s_job(builtin_default(), job_name="fit", image="img:1")
    assert job.env.job_dir == "/home/paddle/fit" and (job.pservers, job.trainers) == (2, 2)


# -- pods a cluster admits: the pod options, and the restricted Pod Security Standard ---------------------------

POD_OPTIONS = ["--pserver-requests", "cpu=2,memory=4Gi", "--trainer-requests", "cpu=4", "--gpus", "2",
               "--trainer-limits", "memory=16Gi", "--pserver-limits", "memory=8Gi", "--node-selector",
               "pool=gpu,kubernetes.io/arch=amd64", "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration",
               "dedicated=ml:NoExecute", "--priority-class", "ml-high", "--service-account", "trainer-sa",
               "--image-pull-secret", "regcred", "--run-as-user", "2000", "--ttl", "600", "--deadline", "7200",
               "--checkpoint-pvc", "ckpt"]


def test_the_pod_options_reach_every_pod_and_validate(tmp_path: Path) -> None:
    docs = render(tmp_path, "--image", "img:1", "--job_name", "fit", *POD_OPTIONS, conf=THREE_HOSTS)
    assert problems(docs) == [] and restricted_problems(docs) == []
    k = by_kind(docs)
    assert container(k["pserver"])["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"},
                                                    "limits": {"memory": "8Gi"}}
    assert container(k["trainer"])["resources"] == {
        "requests": {"cpu": "4", "memory": "1Gi", "nvidia.com/gpu": "2"},
        "limits": {"nvidia.com/gpu": "2", "memory": "16Gi"}}
    for role in ("pserver", "trainer"):
        job = k[role]
        pod = job["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "gpu", "kubernetes.io/arch": "amd64"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]
        assert (pod["priorityClassName"], pod["serviceAccountName"], pod["imagePullSecrets"]) == (
            "ml-high", "trainer-sa", [{"name": "regcred"}])
        assert pod["securityContext"]["runAsUser"] == 2000 and pod["securityContext"]["runAsNonRoot"] is True
        assert (job["spec"]["ttlSecondsAfterFinished"], job["spec"]["activeDeadlineSeconds"]) == (600, 7200)
        assert env_of(container(job))["PADDLE_CHECKPOINT_DIR"] == "/checkpoints/fit"
    # Only the pservers keep checkpoints: only they mount the claim.
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in k["pserver"]["spec"][
        "template"]["spec"]["volumes"]
    assert "checkpoints" not in {v["name"] for v in k["trainer"]["spec"]["template"]["spec"]["volumes"]}


def test_by_default_the_pods_pass_the_restricted_standard(tmp_path: Path) -> None:
    docs = render(tmp_path, "--image", "img:1", "--job_name", "fit", conf=THREE_HOSTS)
    assert restricted_problems(docs) == []
    for job in docs[2:]:
        sc = container(job)["securityContext"]
        assert sc == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                      "seccompProfile": {"type": "RuntimeDefault"}}
        assert job["spec"]["ttlSecondsAfterFinished"] == 86400 and "activeDeadlineSeconds" not in job["spec"]


RESTRICTED_MUTATIONS = {
    "no runAsNonRoot": (lambda p, c: (p["securityContext"].pop("runAsNonRoot"), c["securityContext"].pop(
        "runAsNonRoot")), "runAsNonRoot"),
    "root user": (lambda p, c: p["securityContext"].__setitem__("runAsUser", 0), "runAsUser 0"),
    "privilege escalation": (lambda p, c: c["securityContext"].pop("allowPrivilegeEscalation"),
                             "allowPrivilegeEscalation"),
    "capabilities kept": (lambda p, c: c["securityContext"]["capabilities"].__setitem__("drop", ["NET_RAW"]),
                          "drop ALL"),
    "capability added": (lambda p, c: c["securityContext"]["capabilities"].__setitem__("add", ["SYS_ADMIN"]),
                         "NET_BIND_SERVICE"),
    "no seccomp": (lambda p, c: (p["securityContext"].pop("seccompProfile"), c["securityContext"].pop(
        "seccompProfile")), "seccompProfile"),
    "privileged": (lambda p, c: c["securityContext"].__setitem__("privileged", True), "privileged"),
    "host network": (lambda p, c: p.__setitem__("hostNetwork", True), "hostNetwork"),
    "hostPath volume": (lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
    "host port": (lambda p, c: c["ports"][0].__setitem__("hostPort", 9000), "hostPort"),
}


@pytest.mark.parametrize("what", sorted(RESTRICTED_MUTATIONS))
def test_the_restricted_checks_catch_what_they_claim_to(what: str) -> None:
    docs = copy.deepcopy(_docs())
    pod = _job(docs, "pserver")["spec"]["template"]["spec"]
    mutate, named = RESTRICTED_MUTATIONS[what]
    mutate(pod, pod["containers"][0])
    assert problems(docs) == []  # still a valid object: only the policy rejects it
    found = restricted_problems(docs)
    assert found and any(named in p for p in found), found


@pytest.mark.parametrize("args,named", [
    (["--toleration", "gpu"], "--toleration"),
    (["--toleration", "a=b:Sometimes"], "--toleration"),
    (["--node-selector", "pool"], "--node-selector"),
    (["--pserver-limits", "memory=lots"], "--pserver-limits"),
    (["--priority-class", "High_Prio"], "--priority-class"),
    (["--image-pull-secret", "Reg Cred"], "--image-pull-secret"),
    (["--run-as-user", "0"], "--run-as-user"),
    (["--ttl", "-5"], "--ttl"),
    (["--pod-nic", "eth 0"], "--pod-nic"),
])
def test_bad_pod_options_are_one_clear_line(tmp_path: Path, args: List[str], named: str) -> None:
    res = cli("render", "k8s", "--image", "img:1", *args, cwd=tmp_path)
    assert res.exit_code != 0 and res.stdout == "" and named in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_dispatched_workspace_is_a_configmap_the_pods_mount() -> None:
    cfg = parse_config({"HOSTS": ["a", "b"], "ROOT_DIR": "/data"}, "test")
    docs = k8s.manifests(k8s_job(cfg, job_name="fit", image="img:1", workspace_pack=b"\x1f\x8b packed"))
    assert [d["kind"] for d in docs] == ["Secret", "Service", "ConfigMap", "Job", "Job"]
    assert problems(docs) == [] and restricted_problems(docs) == []
    assert docs[2]["binaryData"] == {"workspace.tar.gz": "H4sgcGFja2Vk"}
    for job in docs[3:]:
        c = container(job)
        assert c["command"][-5:-2] == ["--unpack", f"{k8s.PACK_DIR}/workspace.tar.gz", "--secret-file"]
        assert c["workingDir"] == "/data/fit/workspace"
        assert {"name": "workspace", "configMap": {"name": "fit-workspace"}} in job["spec"]["template"]["spec"][
            "volumes"]


# -- JobSet ---------------------------------------------------------------------------------------------------

def test_the_jobset_form_validates_against_jobsets_schema(tmp_path: Path) -> None:
    # --queue alone implies the JobSet: Kueue admits two Jobs as two workloads.
    docs = render(tmp_path, "--image", "img:1", "--job_name", "fit", "--namespace", "ml", "--queue",
                  "team-a", "--ttl", "600", "--deadline", "3600", "--", "--passes", "3", conf=THREE_HOSTS)
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]
    secret, js = docs
    assert problems([secret]) == [] and jobset_problems(js) == [] and restricted_problems(docs) == []
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # one workload for Kueue
    spec = js["spec"]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    assert spec["failurePolicy"] == {"maxRestarts": 0} and spec["ttlSecondsAfterFinished"] == 600
    assert spec["network"]["enableDNSHostnames"] is True
    ps, tr = (rj["template"] for rj in spec["replicatedJobs"])
    assert (ps["spec"]["completions"], tr["spec"]["completions"]) == (3, 6)
    assert ps["spec"]["activeDeadlineSeconds"] == 3600 and ps["spec"]["completionMode"] == "Indexed"
    # A JobSet's pods are named <JobSet>-<replicated Job>-<Job index>-<pod index>, in the JobSet's subdomain.
    env = JobEnv.from_environ(env_of(container(tr)))
    assert [e.host for e in env.pservers] == [f"fit-pserver-0-{i}.fit.ml.svc" for i in range(3)]
    assert "fit-trainer-0-{}.fit.ml.svc" in container(ps)["command"]
    # The references between the Secret and the pods hold (the JobSet's Jobs checked as Jobs).
    jobs = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"fit-{rj['name']}", "namespace": "ml"},
             "spec": rj["template"]["spec"]} for rj in spec["replicatedJobs"]]
    assert [p for p in problems([secret, *jobs]) if "subdomain" not in p] == []


JOBSET_MUTATIONS = {
    "unknown field": (lambda s: s.__setitem__("sucessPolicy", {}), "sucessPolicy: unknown field"),
    "bad operator": (lambda s: s["successPolicy"].__setitem__("operator", "Most"), "successPolicy.operator"),
    "missing replicated Job name": (lambda s: s["replicatedJobs"][0].pop("name"), "name is required"),
    "wrong type": (lambda s: s["failurePolicy"].__setitem__("maxRestarts", "0"), "maxRestarts"),
    "bad restart strategy": (lambda s: s["failurePolicy"].__setitem__("restartStrategy", "Now"), "restartStrategy"),
    "misspelled Job template field": (lambda s: s["replicatedJobs"][1]["template"]["spec"].__setitem__(
        "completionMod", "Indexed"), "completionMod"),
}


@pytest.mark.parametrize("what", sorted(JOBSET_MUTATIONS))
def test_the_jobset_checks_catch_what_they_claim_to(what: str) -> None:
    cfg = parse_config({"HOSTS": ["a", "b"]}, "test")
    js = copy.deepcopy(k8s.manifests(k8s_job(cfg, job_name="fit", image="img:1", jobset=True))[-1])
    assert jobset_problems(js) == []
    mutate, named = JOBSET_MUTATIONS[what]
    mutate(js["spec"])
    found = jobset_problems(js)
    assert found and any(named in p for p in found), found


def test_pod_options_on_another_backend_are_refused(tmp_path: Path) -> None:
    res = cli("run", "--job_workspace", str(tmp_path), "--gpus", "1", "--image-pull-secret", "regcred", cwd=tmp_path)
    assert res.exit_code == 2 and "--gpus, --image-pull-secret: for --backend k8s only" in res.stderr, res.stderr
