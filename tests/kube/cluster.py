"""The controllers of the Kubernetes stand-in (``__init__.py`` says what is modelled): one loop, every
``TICK`` s, over the objects of the store, starting and stopping the pods' real processes."""

from __future__ import annotations

import base64
import copy
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from sshstate import _netns_pids

from .admission import place, refusal
from .dns import ClusterDNS
from .store import INDEX, TICK, Store, _key, matches, now, touch
from .workloads import jobset, kueue

TERMINAL = ("Succeeded", "Failed")
PULL_BACKOFF_S = 1.0  # a kubelet's first image pull back-off is 10 s; shorter here, the same pattern
LOG_MAX = 10 * 2 ** 20  # the kubelet's containerLogMaxSize (10Mi by default)
LOG_FILES = 5  # containerLogMaxFiles: the current file and 4 rotated ones


def copy_log(pipe, log: Path) -> None:
    """The runtime writing a container's output to its log file, line by line, and the kubelet rotating the file
    once it holds LOG_MAX bytes: renamed to ``<log>.1`` (older ones shifted, LOG_FILES kept in all) and a new one
    begun. So ``kubectl logs`` returns the current file alone, as on a real node, and a follower moves on to the
    new file (apiserver.py)."""
    out = open(log, "ab")
    try:
        for line in pipe:
            out.write(line)
            out.flush()
            if out.tell() >= LOG_MAX:
                out.close()
                log.with_name(f"{log.name}.{LOG_FILES - 1}").unlink(missing_ok=True)
                for n in range(LOG_FILES - 2, 0, -1):
                    if log.with_name(f"{log.name}.{n}").exists():
                        os.replace(log.with_name(f"{log.name}.{n}"), log.with_name(f"{log.name}.{n + 1}"))
                os.replace(log, log.with_name(f"{log.name}.1"))
                out = open(log, "ab")
    finally:
        out.close()
        pipe.close()


def _give_to_group(d: Path, gid: int, write: bool = True) -> None:
    """What the kubelet does to a volume for a pod's fsGroup: every file the group's (group-writable), and every
    directory setgid, so the files the pod makes are the group's too."""
    for path in [d, *d.rglob("*")]:
        os.chown(path, -1, gid)
        mode = os.stat(path).st_mode
        if path.is_dir():
            os.chmod(path, mode | 0o2070 if write else mode | 0o2050)
        else:
            os.chmod(path, mode | (0o060 if write else 0o040))


def _as_user(uid: int, gid: int, groups: List[int]) -> str:
    """The command prefix that runs the container's process as ``uid``. It keeps CAP_DAC_READ_SEARCH: the image
    here is this machine's files (its interpreter under /root, the tests' directories 0700), which a user other
    than root could not reach, while an image's are its user's to read; writing is checked as for any user."""
    if uid == 0:
        return ""
    return (f"setpriv --reuid {uid} --regid {gid} --groups {','.join(map(str, groups))} "
            "--inh-caps +dac_read_search --ambient-caps +dac_read_search ")


class Cluster:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.cfg = store.config()
        self.nodes: List[Dict[str, Any]] = self.cfg["nodes"]
        self.procs: Dict[str, subprocess.Popen] = {}
        # No Job, JobSet, Pod or container: nothing changes with time, so an unchanged store needs no tick (a
        # tick parses and serialises the whole store, its watch history included: 40% of a core at the 2.5 MB
        # the session's stand-in holds after the k8s conformance cases, for the rest of the test session).
        self.idle = False
        self.copiers: Dict[str, threading.Thread] = {}  # each pod's copy_log
        self.term_at: Dict[str, float] = {}
        self.pulled: set = set()  # (node, image) pulled once: a node keeps its images
        self.pulling: Dict[Tuple[str, str], float] = {}  # (node, image) -> when its first pull started
        self.dns_server = ClusterDNS(self.cfg["dns"], store.root)
        # As the kubelet writes it (ndots:5: a job's names are tried under the cluster domain first).
        self.resolv = store.root / "resolv.conf"
        self.resolv.write_text(f"nameserver {self.cfg['dns']}\nsearch cluster.local\noptions ndots:5 timeout:1 "
                               "attempts:2\n")

    # -- the loop ------------------------------------------------------------------------------------------------
    def tick(self) -> None:
        if self.idle and not self.store.changed():
            return
        with self.store.edit() as doc:
            objs = doc["objects"]
            kueue(self, doc)
            for key in [k for k in objs if k.startswith("JobSet/")]:
                jobset(self, doc, key)
            for key in [k for k in objs if k.startswith("Job/")]:
                self.job(doc, key)
            for key in [k for k in objs if k.startswith("Pod/")]:
                self.pod(doc, key)
            uids = {o["metadata"]["uid"] for o in objs.values()}
            for key in [k for k in objs if k.startswith("Job/") and objs[k]["metadata"].get("ownerReferences")]:
                if not any(o["uid"] in uids for o in objs[key]["metadata"]["ownerReferences"]):
                    self._delete(doc, objs[key])  # its JobSet is gone: the Job goes, its pods first
            for key in [k for k in objs if not k.startswith(("Job/", "Pod/", "JobSet/"))]:
                owners = objs[key]["metadata"].get("ownerReferences") or []
                # The garbage collector: a dependent goes once every owner is gone.
                if objs[key]["metadata"].get("deletionTimestamp") or (
                        owners and not any(o["uid"] in uids for o in owners)):
                    touch(doc, objs.pop(key), "DELETED")
            self.dns(objs)
            self.idle = not self.procs and not any(k.startswith(("Job/", "JobSet/", "Pod/")) for k in objs)

    def event(self, doc: Dict[str, Any], obj: Dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Record an Event about ``obj``, as a controller does: the same one again only counts up."""
        meta = obj["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        for key, e in doc["objects"].items():
            if key.startswith(f"Event/{ns}/") and e["involvedObject"]["uid"] == uid and e["reason"] == reason \
                    and e["message"] == message:
                e.update(count=e["count"] + 1, lastTimestamp=now())
                touch(doc, e)
                return
        name = f"{meta['name']}.{secrets.token_hex(8)}"
        ev = {"apiVersion": "v1", "kind": "Event", "type": type_, "reason": reason, "message": message, "count": 1,
              "metadata": {"name": name, "namespace": ns, "uid": secrets.token_hex(8), "creationTimestamp": now()},
              "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                                 "namespace": ns, "uid": uid},
              "firstTimestamp": now(), "lastTimestamp": now()}
        doc["objects"][_key("Event", ns, name)] = ev
        touch(doc, ev, "ADDED")

    # -- Job controller ------------------------------------------------------------------------------------------
    def job(self, doc: Dict[str, Any], key: str) -> None:
        objs = doc["objects"]
        job = objs[key]
        meta, spec = job["metadata"], job["spec"]
        ns, uid = meta["namespace"], meta["uid"]
        pods = {k: p for k, p in objs.items()
                if k.startswith(f"Pod/{ns}/") and p["metadata"]["labels"].get("controller-uid") == uid}
        if meta.get("deletionTimestamp"):
            for p in pods.values():
                self._delete(doc, p)
            if not pods:
                touch(doc, objs.pop(key), "DELETED")
            return
        st = job.setdefault("status", {})
        before = copy.deepcopy(st)
        st.setdefault("startTime", now())
        st.setdefault("_start", time.time())
        conds = st.setdefault("conditions", [])
        done = next((c["type"] for c in conds if c["type"] in ("Complete", "Failed") and c["status"] == "True"), None)
        n = spec.get("completions", 1)
        succeeded = {int(p["metadata"]["annotations"][INDEX]) for p in pods.values()
                     if p["status"].get("phase") == "Succeeded"}
        # (Pods its suspension stopped are not failures: Kueue's eviction does not fail the Job.)
        failed = sum(p["status"].get("phase") == "Failed" and not p["metadata"].get("_suspended")
                     for p in pods.values()) + st.get("_failed_gone", 0)
        active = [p for p in pods.values() if p["status"].get("phase") not in TERMINAL
                  and not p["metadata"].get("deletionTimestamp")]
        st.update(active=len(active), succeeded=len(succeeded), failed=failed)
        if done is None:
            why = None
            if failed > spec.get("backoffLimit", 6):
                why = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            elif spec.get("activeDeadlineSeconds") is not None and \
                    time.time() - st["_start"] > spec["activeDeadlineSeconds"]:
                why = ("DeadlineExceeded", "Job was active longer than specified deadline")
            if why:
                conds.append({"type": "Failed", "status": "True", "reason": why[0], "message": why[1],
                              "lastTransitionTime": now()})
                for p in active:  # a failed Job's running pods are terminated
                    self._delete(doc, p)
                done = "Failed"
            elif len(succeeded) >= n:
                conds.append({"type": "Complete", "status": "True", "lastTransitionTime": now()})
                st["completionTime"] = now()
                done = "Complete"
        if done:
            st.setdefault("_done", time.time())
            ttl = spec.get("ttlSecondsAfterFinished")
            if ttl is not None and time.time() - st["_done"] >= ttl:
                meta["deletionTimestamp"] = now()
            if st != before:
                touch(doc, job)
            return
        suspended = next((c for c in conds if c["type"] == "Suspended"), None)
        if spec.get("suspend"):  # no pods (those running are stopped) until it is resumed
            for p in active:
                p["metadata"]["_suspended"] = True
                self._delete(doc, p)
            if suspended is None or suspended["status"] != "True":
                conds[:] = [c for c in conds if c["type"] != "Suspended"] + [{
                    "type": "Suspended", "status": "True", "reason": "JobSuspended", "message": "Job suspended",
                    "lastTransitionTime": now()}]
                self.event(doc, job, "Normal", "Suspended", "Job suspended")
            st["_start"] = time.time()  # activeDeadlineSeconds counts only while it is not suspended
            if st != before:
                touch(doc, job)
            return
        if suspended is not None and suspended["status"] == "True":
            suspended.update(status="False", reason="JobResumed", message="Job resumed", lastTransitionTime=now())
            self.event(doc, job, "Normal", "Resumed", "Job resumed")
        busy = {int(p["metadata"]["annotations"][INDEX]) for p in active}
        for i in range(n):
            if len(busy) >= spec.get("parallelism", n) or time.time() < st.get("_retry_at", 0):
                break
            if i not in busy and i not in succeeded:
                # The API server admits the pod or refuses it; the Job controller retries (with a backoff).
                why = refusal(objs, ns, spec["template"]["spec"])
                if why:
                    self.event(doc, job, "Warning", "FailedCreate",
                               f'Error creating: pods "{meta["name"]}-{i}-" is forbidden: {why}')
                    st["_retry_at"] = time.time() + 2
                    break
                pod = self._create_pod(doc, job, i)
                self.event(doc, job, "Normal", "SuccessfulCreate", f"Created pod: {pod}")
                busy.add(i)
        if st != before:
            touch(doc, job)

    def _create_pod(self, doc: Dict[str, Any], job: Dict[str, Any], index: int) -> str:
        meta, tmpl = job["metadata"], job["spec"]["template"]
        name = f"{meta['name']}-{index}-{secrets.token_hex(3)[:5]}"
        labels = {**(tmpl["metadata"].get("labels") or {}), "controller-uid": meta["uid"], "job-name": meta["name"],
                  INDEX: str(index)}
        spec = copy.deepcopy(tmpl["spec"])
        spec["hostname"] = f"{meta['name']}-{index}"
        for c in spec["containers"]:
            c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels, "uid": secrets.token_hex(8),
                            "annotations": {INDEX: str(index)}, "creationTimestamp": now(),
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                                 "uid": meta["uid"], "controller": True}]},
               "spec": spec, "status": {"phase": "Pending"}}
        doc["objects"][_key("Pod", meta["namespace"], name)] = pod
        touch(doc, pod, "ADDED")
        return name

    def _delete(self, doc: Dict[str, Any], obj: Dict[str, Any]) -> None:
        if not obj["metadata"].get("deletionTimestamp"):
            obj["metadata"]["deletionTimestamp"] = now()
            touch(doc, obj)

    # -- scheduler and kubelet -----------------------------------------------------------------------------------
    def pod(self, doc: Dict[str, Any], key: str) -> None:
        objs = doc["objects"]
        pod = objs[key]
        meta, spec, st = pod["metadata"], pod["spec"], pod["status"]
        before = copy.deepcopy(st)
        proc = self.procs.get(key)
        if meta.get("deletionTimestamp"):
            if proc is not None and proc.poll() is None:
                grace = 0 if meta.get("forceKill") else spec.get("terminationGracePeriodSeconds", 30)
                if key not in self.term_at:  # SIGTERM to the container's PID 1 only, as a runtime sends it
                    self.term_at[key] = time.time()
                    self._signal(proc, signal.SIGTERM, init_only=True) if grace else self._signal(proc, signal.SIGKILL)
                elif time.time() - self.term_at[key] >= grace:
                    self._signal(proc, signal.SIGKILL)
                return
            if proc is not None and st.get("phase") not in TERMINAL:  # the kubelet reports the end first
                if self.copiers[key].is_alive():
                    return  # its last output is still being written
                self._ended(pod, proc)
                touch(doc, pod)
                return
            self.procs.pop(key, None)
            self.copiers.pop(key, None)
            touch(doc, objs.pop(key), "DELETED")
            return
        if st.get("phase") in TERMINAL:
            return
        if not spec.get("nodeName"):
            placed, why = place(objs, self.nodes, pod)
            if placed is None:
                if (st.get("conditions") or [{}])[0].get("message") != why:
                    self.event(doc, pod, "Warning", "FailedScheduling", why)
                st["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": why}]
            else:
                node, sandbox = placed
                spec["nodeName"] = node["name"]
                st.update(conditions=[{"type": "PodScheduled", "status": "True"}], hostIP=node["ip"],
                          podIP=sandbox["ip"], startTime=now())
        elif proc is None:
            self._start(doc, key, pod)
        elif proc.poll() is not None and not self.copiers[key].is_alive():  # its output written to the end
            self._ended(pod, proc)
        if st != before:
            touch(doc, pod)

    @staticmethod
    def _ended(pod: Dict[str, Any], proc: subprocess.Popen) -> None:
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        c = pod["spec"]["containers"][0]
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        pod["status"]["containerStatuses"] = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                                               "restartCount": 0, "state": {"terminated": {
                                                   "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                                   "finishedAt": now()}}}]

    def _waiting(self, pod: Dict[str, Any], reason: str, message: str) -> None:
        c = pod["spec"]["containers"][0]
        pod["status"]["containerStatuses"] = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                                               "restartCount": 0,
                                               "state": {"waiting": {"reason": reason, "message": message}}}]

    def _pull_fails(self, doc: Dict[str, Any], pod: Dict[str, Any], image: str) -> None:
        """An image no registry has, as a kubelet retries it: a pull (ErrImagePull), then a back-off
        (ImagePullBackOff) doubling from PULL_BACKOFF_S, each with the kubelet's Events, over and over."""
        meta = pod["metadata"]
        tries, last = meta.get("_pull_tries", 0), meta.get("_pull_at", 0.0)
        if tries and time.time() - last < min(PULL_BACKOFF_S * 2 ** (tries // 2), 8 * PULL_BACKOFF_S):
            return
        meta.update(_pull_tries=tries + 1, _pull_at=time.time())
        if tries % 2 == 0:
            why = (f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": failed to resolve '
                   f'reference "{image}": {image}: not found')
            self.event(doc, pod, "Normal", "Pulling", f'Pulling image "{image}"')
            self.event(doc, pod, "Warning", "Failed", f'Failed to pull image "{image}": {why}')
            self.event(doc, pod, "Warning", "Failed", "Error: ErrImagePull")
            self._waiting(pod, "ErrImagePull", why)
        else:
            self.event(doc, pod, "Normal", "BackOff", f'Back-off pulling image "{image}"')
            self.event(doc, pod, "Warning", "Failed", "Error: ImagePullBackOff")
            self._waiting(pod, "ImagePullBackOff", f'Back-off pulling image "{image}"')

    def _start(self, doc: Dict[str, Any], key: str, pod: Dict[str, Any]) -> None:
        objs = doc["objects"]
        meta, spec = pod["metadata"], pod["spec"]
        ns = meta["namespace"]
        (c,) = spec["containers"]
        image = self.cfg["images"].get(c["image"])
        if image is None:
            return self._pull_fails(doc, pod, c["image"])
        pull = (spec["nodeName"], c["image"])
        pull_s = image.get("pull_s", 0)  # seconds, or {node: seconds}
        pull_s = pull_s.get(spec["nodeName"], 0) if isinstance(pull_s, dict) else pull_s
        if pull_s and pull not in self.pulled:  # a node's first pull of the image takes a while
            started = self.pulling.setdefault(pull, time.time())
            if not meta.get("_pulling"):
                meta["_pulling"] = True
                self.event(doc, pod, "Normal", "Pulling", f'Pulling image "{c["image"]}"')
            if time.time() - started < pull_s:
                return self._waiting(pod, "ContainerCreating", "")
            self.pulled.add(pull)
        if meta.pop("_pulling", None):
            self.event(doc, pod, "Normal", "Pulled", f'Successfully pulled image "{c["image"]}" in '
                       f'{time.time() - self.pulling[pull]:.1f}s')
        env = dict(image.get("env", {}))
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
                continue
            ref = e["valueFrom"]["secretKeyRef"]
            secret = objs.get(_key("Secret", ns, ref["name"]))
            if secret is None or ref["key"] not in (secret.get("data") or {}):
                return self._waiting(pod, "CreateContainerConfigError", f'secret "{ref["name"]}" not found')
            env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        env["HOSTNAME"] = spec["hostname"]
        # The user the process runs as: the manifest's, else the image's; its groups: runAsGroup, fsGroup and the
        # supplementalGroups, as a runtime gives them.
        pod_sc = spec.get("securityContext") or {}
        sc = {**pod_sc, **(c.get("securityContext") or {})}
        uid, gid = sc.get("runAsUser", image.get("user", 0)), sc.get("runAsGroup", image.get("group", 0))
        fs_group = pod_sc.get("fsGroup")
        groups = sorted({gid, *([fs_group] if fs_group is not None else []), *pod_sc.get("supplementalGroups", [])})
        if sc.get("runAsNonRoot") and uid == 0:
            return self._waiting(pod, "CreateContainerConfigError", "container has runAsNonRoot and image will run "
                                 "as root")
        vols = self.store.root / "volumes" / meta["name"]
        binds = []
        for v in spec.get("volumes") or []:
            d = vols / v["name"]
            d.mkdir(parents=True)
            if "persistentVolumeClaim" in v:  # (binding not modelled: a directory per claim that outlives pods)
                d.rmdir()
                claim = v["persistentVolumeClaim"]["claimName"]
                d = self.store.root / "pvcs" / ns / claim
                if not d.exists():  # a new volume's file system: its root directory is root's, 0755
                    d.mkdir(parents=True)
                    os.chmod(d, 0o755)
                # The kubelet gives the volume to fsGroup (recursively, group-writable, setgid directories) where
                # its storage lets it: not on one listed as ignoring it (cluster.json "claims", as NFS does).
                if fs_group is not None and self.cfg.get("claims", {}).get(claim, {}).get("fsGroup", True):
                    _give_to_group(d, fs_group)
            elif "secret" in v:  # the Secret's keys as files (all, or its items), defaultMode, the group fsGroup
                sec = objs.get(_key("Secret", ns, v["secret"]["secretName"]))
                if sec is None:
                    return self._waiting(pod, "CreateContainerConfigError",
                                         f'secret "{v["secret"]["secretName"]}" not found')
                data = sec.get("data") or {}
                for item in v["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    (d / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
                for f in d.iterdir():
                    os.chmod(f, v["secret"].get("defaultMode", 0o644))
                os.chmod(d, 0o755)
                if fs_group is not None:
                    _give_to_group(d, fs_group, write=False)
            elif "configMap" in v:
                cm = objs.get(_key("ConfigMap", ns, v["configMap"]["name"]))
                if cm is None:
                    return self._waiting(pod, "CreateContainerConfigError",
                                         f'configmap "{v["configMap"]["name"]}" not found')
                for k, text in (cm.get("data") or {}).items():
                    (d / k).write_text(text)
                for k, b64 in (cm.get("binaryData") or {}).items():
                    (d / k).write_bytes(base64.b64decode(b64))
                for f in d.iterdir():
                    os.chmod(f, v["configMap"].get("defaultMode", 0o644))
                os.chmod(d, 0o755)
                if fs_group is not None:
                    _give_to_group(d, fs_group, write=False)
            else:
                os.chmod(d, 0o777)  # an emptyDir is writable by any user, and fsGroup's
                if fs_group is not None:
                    _give_to_group(d, fs_group)
            for m in c.get("volumeMounts") or []:
                if m["name"] == v["name"]:
                    binds.append((d, m["mountPath"]))
        log = self.store.log(ns, meta["name"])
        log.parent.mkdir(parents=True, exist_ok=True)
        node = next(n for n in self.nodes if n["name"] == spec["nodeName"])
        sandbox = next(s for s in node["pods"] if s["ip"] == pod["status"]["podIP"])
        if _netns_pids(sandbox["netns"]):
            return None  # the sandbox's previous pod is still being killed: start on a later tick
        # The kubelet's /etc/hosts: localhost and the pod's own names.
        vols.mkdir(parents=True, exist_ok=True)
        hosts = vols / "etc-hosts"
        fq = f"{spec['hostname']}.{spec['subdomain']}.{ns}.svc.cluster.local " if spec.get("subdomain") else ""
        hosts.write_text(f"127.0.0.1 localhost\n{pod['status']['podIP']} {fq}{spec['hostname']}\n")
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        wd = c.get("workingDir", "/")
        script = " && ".join([f"hostname {shlex.quote(spec['hostname'])}", f"mount --bind {hosts} /etc/hosts",
                              f"mount --bind {self.resolv} /etc/resolv.conf",
                              *(f"mkdir -p {shlex.quote(t)} && mount --bind {s} {shlex.quote(t)}" for s, t in binds),
                              f"mkdir -p {shlex.quote(wd)}", f"cd {shlex.quote(wd)}",
                              f"exec {_as_user(uid, gid, groups)}env -i {envs} "
                              f"{shlex.join([*c['command'], *c.get('args', [])])}"])
        self.procs[key] = proc = subprocess.Popen(
            # A PID namespace of its own, as a container runtime gives: its first process is PID 1, so the
            # kernel ends every process of the pod with it (a setsid grandchild too), and a SIGTERM reaches it
            # only if it handles SIGTERM; unshare waits for it (ignoring SIGTERM) and exits with its status.
            # Its own /proc too, as in a container: the pod's pids are the ones /proc shows there.
            ["nsenter", f"--net=/run/netns/{sandbox['netns']}", "--", "unshare", "--mount", "--uts", "--pid",
             "--fork", "--mount-proc", "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.copiers[key] = threading.Thread(target=copy_log, args=(proc.stdout, log), daemon=True)
        self.copiers[key].start()
        pod["status"]["phase"] = "Running"
        pod["status"]["containerStatuses"] = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                                               "restartCount": 0, "state": {"running": {"startedAt": now()}}}]

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int, init_only: bool = False) -> None:
        """``sig`` to the pod's processes, or (``init_only``) to its PID 1 alone: unshare's child."""
        try:
            if init_only:
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                if children:
                    os.kill(int(children[0]), sig)
                    return
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, FileNotFoundError):
            pass

    # -- DNS -----------------------------------------------------------------------------------------------------
    def dns(self, objs: Dict[str, Any]) -> None:
        """The cluster DNS's records: the stable names of the pods a headless Service of their subdomain selects
        (publishNotReadyAddresses: from scheduling on, until the pod ends)."""
        records = {}
        for k, p in sorted(objs.items()):
            if not k.startswith("Pod/") or p["status"].get("phase") in TERMINAL or not p["status"].get("podIP"):
                continue
            spec, ns, ip = p["spec"], p["metadata"]["namespace"], p["status"]["podIP"]
            svc = objs.get(_key("Service", ns, spec.get("subdomain", "")))
            if svc is not None and svc["spec"].get("clusterIP") == "None" and \
                    matches(p["metadata"]["labels"], ",".join(f"{a}={b}" for a, b in svc["spec"]["selector"].items())):
                fq = f"{spec['hostname']}.{spec['subdomain']}.{ns}.svc"
                records[fq] = records[f"{fq}.cluster.local"] = ip
        self.dns_server.records = records

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._signal(proc, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        self.dns_server.close()


def controller_main(root: Path) -> int:
    cluster = Cluster(Store(root))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop:
            cluster.tick()
            time.sleep(TICK)
    finally:
        cluster.shutdown()
    return 0
