"""A stand-in for a Kubernetes cluster, for tests (no real cluster runs here: docs/backends.md says what a real
one adds): the real ``kubectl`` talks to it through a kubeconfig.

``python -m kube apiserver DIR PORTFILE`` (from tests/) is its API server (apiserver.py: the REST API the
backend's kubectl commands use, over the objects in ``DIR/objects.json``); ``python -m kube controller
DIR`` is the rest of the control plane and the nodes, in one loop (cluster.py): the Job controller
for Indexed Jobs (one pod per index named ``<job>-<index>-<suffix>``, hostname ``<job>-<index>``, the completion
index as annotation, label and ``JOB_COMPLETION_INDEX``; ``completions``, ``parallelism``, ``backoffLimit``,
``activeDeadlineSeconds``, ``ttlSecondsAfterFinished``, ``suspend``; conditions ``Complete``/``Failed``/``Suspended``,
the remaining pods terminated when the Job fails; Events), admission of its pods (ServiceAccount, PriorityClass,
ResourceQuota: admission.py), the scheduler (requests, GPUs, taints, node selectors, pod slots),
JobSet and Kueue (workloads.py), the garbage collector, the kubelet (each pod a real process,
PID 1 of a PID namespace of its own, in a network namespace of its own with its own IP: the container's
command, args, workingDir and env -- Secret references resolved -- its hostname, emptyDir/configMap volumes
bind-mounted, its output the pod's log, terminationGracePeriodSeconds between SIGTERM and SIGKILL, a slow first
pull of an image on a node, the image a name for this checkout) and the cluster DNS (dns.py).
Deletion is foreground: a Job goes once its pods are gone.

The objects live in one JSON file (store.py); standin.py starts both processes over a tests/sshcluster.py
cluster for the ``kube`` fixtures; validate.py checks rendered manifests offline, with no stand-in at all.
"""
