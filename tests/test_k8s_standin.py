"""The stand-in API server refuses what a real one refuses (tests/kube/apivalidation.py), through the real
kubectl: each manifest or command here is one a real cluster rejects, and must fail here too -- so a backend
that wrote it would fail these tests rather than a user's first run. And what it stores behaves as a real
server's: a server dry-run stores nothing, status is a subresource, set-based selectors select."""

from __future__ import annotations

import json
from typing import Any, Dict

import pytest
import yaml

JOB = {"apiVersion": "batch/v1", "kind": "Job",
       "metadata": {"name": "standin-check", "labels": {"paddle-cluster/job": "standin-check"}},
       "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "suspend": True,
                "template": {"spec": {"restartPolicy": "Never",
                                      "containers": [{"name": "c", "image": "registry.example/paddle/fit:1",
                                                      "command": ["true"]}]}}}}


def job(**spec: Any) -> Dict[str, Any]:
    doc = json.loads(json.dumps(JOB))
    doc["spec"].update(spec)
    return doc


def create(kube, doc: Dict[str, Any], *args: str):
    return kube.kubectl("create", "--filename", "-", *args, stdin=yaml.safe_dump(doc))


@pytest.fixture
def kube(kube_cluster):
    yield kube_cluster
    kube_cluster.kubectl("delete", "jobs.batch,secrets", "--selector", "paddle-cluster/job=standin-check",
                         "--ignore-not-found", "--wait=true")


@pytest.mark.parametrize("doc, says", [
    (job(completionMode="Sideways"), "spec.completionMode = 'Sideways' is not one of"),
    (job(completions="three"), "completions"),
    (job(sideways=True), "strict decoding error"),
    ({**JOB, "metadata": {**JOB["metadata"], "name": "Fit_Job"}}, "metadata.name is not a DNS label"),
    ({**JOB, "metadata": {**JOB["metadata"], "namespace": "nosuch"}}, 'namespaces "nosuch" not found'),
    ({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "standin-check", "labels": {"x": "bad value"}},
      "stringData": {"k": "v"}}, "label"),
])
def test_a_manifest_an_api_server_refuses_is_refused(kube, doc: Dict[str, Any], says: str) -> None:
    res = create(kube, doc)
    assert res.returncode != 0 and says in res.stderr, res.stderr
    assert kube.objects() == {}


def test_a_server_dry_run_stores_nothing_and_still_validates(kube) -> None:
    res = create(kube, job(), "--dry-run=server")
    assert res.returncode == 0 and "created (server dry run)" in res.stdout, res.stdout + res.stderr
    assert kube.objects() == {}
    res = create(kube, job(completionMode="Sideways"), "--dry-run=server")
    assert res.returncode != 0 and "completionMode" in res.stderr, res.stderr


def test_status_is_a_subresource(kube) -> None:
    assert create(kube, job()).returncode == 0
    patched = kube.kubectl("patch", "job.batch/standin-check", "--type", "merge", "--patch",
                           '{"metadata": {"labels": {"seen": "yes"}}, "status": {"ready": 7}}')
    assert patched.returncode == 0, patched.stderr
    (obj,) = kube.objects(kind="Job").values()
    assert obj["metadata"]["labels"]["seen"] == "yes" and obj["status"].get("ready") != 7, obj["status"]
    sub = kube.kubectl("patch", "job.batch/standin-check", "--subresource=status", "--type", "merge", "--patch",
                       '{"status": {"ready": 7}, "metadata": {"labels": {"other": "no"}}}')
    assert sub.returncode == 0, sub.stderr
    (obj,) = kube.objects(kind="Job").values()
    assert obj["status"]["ready"] == 7 and "other" not in obj["metadata"]["labels"], obj


def test_selectors_are_parsed_as_an_api_server_does(kube) -> None:
    for name, role in (("standin-check-a", "pserver"), ("standin-check-b", "trainer")):
        doc = {"apiVersion": "v1", "kind": "Secret", "stringData": {"k": "v"},
               "metadata": {"name": name, "labels": {"paddle-cluster/job": "standin-check", "role": role}}}
        assert create(kube, doc).returncode == 0

    def names(*args: str) -> list:
        res = kube.kubectl("get", "secrets", *args, "--output", "jsonpath={.items[*].metadata.name}")
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert names("--selector", "paddle-cluster/job=standin-check,role in (trainer, chief)") == ["standin-check-b"]
    assert names("--selector", "paddle-cluster/job=standin-check,role notin (trainer)") == ["standin-check-a"]
    assert names("--selector", "paddle-cluster/job=standin-check,!role") == []
    assert names("--selector", "paddle-cluster/job=standin-check", "--field-selector",
                 "metadata.name=standin-check-a") == ["standin-check-a"]
    bad = kube.kubectl("get", "secrets", "--field-selector", "spec.nodeName=worker-0")
    assert bad.returncode != 0 and "field label not supported: spec.nodeName" in bad.stderr, bad.stderr
    bad = kube.kubectl("get", "pods", "--field-selector", "spec.sideways=1")
    assert bad.returncode != 0 and "field label not supported: spec.sideways" in bad.stderr, bad.stderr
    assert kube.kubectl("get", "pods", "--field-selector", "spec.nodeName=worker-0").returncode == 0
