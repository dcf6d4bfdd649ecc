"""The pods' logs read through one ``kubectl proxy`` per command, which authenticates as kubectl does: each pod's
log is a request to the API server (``GET .../pods/NAME/log``, what ``kubectl logs`` asks for; with
``?follow=true``, what ``kubectl logs -f`` asks for), a thread and a connection per pod, not a ``kubectl logs``
process per pod (~48 MB each). ``run`` follows the job's pods with one; ``logs``, ``status``, ``top`` and the
saving of the logs at a job's end read them with one.

A stream ends when the pod's container has ended and its log was read out (the API server closes it), or when the
proxy is stopped; each pod is asked for once, from its start, so a pod that starts late or comes again (a new pod
for the same index) is read whole, and one that ended before it was followed is read whole at once. (The API
server's follow goes on across the kubelet's rotations of the log file, as ``kubectl logs -f`` does.)
"""

from __future__ import annotations

import ctypes
import json
import re
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Iterator, List, Optional

from ...errors import ClusterError

_SERVING = re.compile(r"Starting to serve on 127\.0\.0\.1:(\d+)")


class LogProxy:
    """One ``kubectl proxy`` on a free local port, serving only this machine."""

    def __init__(self, binary: str) -> None:
        self.proc = subprocess.Popen([binary, "proxy", "--port=0", "--address=127.0.0.1",
                                      "--accept-hosts=^127\\.0\\.0\\.1$"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     # Its own session: a terminal's Ctrl+C (to the whole foreground group) stops
                                     # the launcher, which still reads the pods' last lines and saves their logs.
                                     start_new_session=True, preexec_fn=_dies_with_launcher)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        found = _SERVING.search(line)
        if found is None:
            self.proc.kill()
            err = self.proc.stderr.read().strip()
            self.proc.wait()
            why = (err or line).strip().splitlines()
            raise ClusterError(f"kubectl proxy, which follows the pods' logs, did not start: "
                               f"{why[-1] if why else 'it ended'}")
        self.base = f"http://127.0.0.1:{found.group(1)}"

    def __enter__(self) -> LogProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def items(self, namespace: str, api: str, kind: str, selector: str) -> List[Dict[str, Any]]:
        """The namespace's objects of ``kind`` (in API group/version ``api``: ``api/v1``, ``apis/batch/v1``) with the
        label ``selector``; ``ClusterError`` as ``follow``."""
        url = (f"{self.base}/{api}/namespaces/{urllib.parse.quote(namespace)}/{kind}?"
               + urllib.parse.urlencode({"labelSelector": selector}))
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - our own proxy on 127.0.0.1
                return list(json.loads(resp.read().decode("utf-8", "replace")).get("items") or [])
        except urllib.error.HTTPError as e:
            raise ClusterError(_message(e)) from None
        except (OSError, ValueError) as e:
            raise ClusterError(f"listing {kind} through kubectl proxy: {e}") from None

    def read(self, namespace: str, pod: str, tail: Optional[int] = None, timeout: float = 120.0) -> str:
        """``pod``'s log as the kubelet has it now (its current file: what it rotated away is not in it), or its
        last ``tail`` lines; ``ClusterError`` as ``follow``."""
        return "".join(self.follow(namespace, pod, tail, follow=False, timeout=timeout))

    def follow(self, namespace: str, pod: str, tail: Optional[int] = None, follow: bool = True,
               timeout: Optional[float] = None) -> Iterator[str]:
        """``pod``'s log from its start (or its last ``tail`` lines), line by line, until its container ended and
        the log is read out (or the proxy stops); ``ClusterError`` with the API server's message when it refuses
        (a container not started)."""
        query = urllib.parse.urlencode({**({"follow": "true"} if follow else {}),
                                        **({"tailLines": str(tail)} if tail is not None else {})})
        url = (f"{self.base}/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(pod)}/log"
               + (f"?{query}" if query else ""))
        try:
            resp = urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 - our own proxy on 127.0.0.1
        except urllib.error.HTTPError as e:
            raise ClusterError(_message(e)) from None
        except OSError as e:
            raise ClusterError(f"cannot reach kubectl proxy: {e}") from None
        with resp:
            try:
                for raw in resp:
                    yield raw.decode("utf-8", "replace")
            except OSError as e:  # (the proxy stopped)
                if not follow:  # a read that did not end is not the log
                    raise ClusterError(f"reading the log of pod/{pod}: {e}") from None
                return

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _dies_with_launcher() -> None:
    """Pre-exec: SIGTERM to the proxy once the launcher thread that started it ends, even by SIGKILL (a proxy
    serves for ever, where a log follower ended with its pod)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read().decode("utf-8", "replace")).get("message") or str(e)
    except (ValueError, OSError):
        return str(e)

