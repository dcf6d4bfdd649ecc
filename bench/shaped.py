"""Across the test cluster's bridge: raw TCP (the bridge's limit) and dense push+pull on 1 Gbit/s links.

Needs root (``tests/sshcluster.py`` builds the hosts). Trainer 0 runs on node 0, the pservers on the
other nodes; with ``tbf`` on every link the trainer's own link (1 Gbit/s each way) is the bottleneck, and
one push+pull step moves ``2 * size`` bytes over it, one direction after the other.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Dict, Iterator, Optional

from . import dense, rawtcp
from .common import sshcluster_module

LINE_RATE = 1e9 / 8  # bytes/s of a 1 Gbit/s link


def unavailable() -> Optional[str]:
    return sshcluster_module().unavailable_reason()


@contextlib.contextmanager
def shaped_cluster(n: int, rate: str = "1gbit") -> Iterator[Any]:
    """``n`` hosts of the test cluster, every link shaped to ``rate`` both ways; torn down on leaving."""
    sc = sshcluster_module()
    with sc.SSHCluster(n, tempfile.mkdtemp(prefix="bench-cluster-")) as cl:
        for i in range(cl.n):
            cl.shape(i, rate)
        yield cl


def run(size: int, warmup: int, reps: int, raw_reps: int, node_counts=(2, 3), peer_size: int = 0,
        peer_workers=(2, 4), peer_pservers=(2, 4)) -> Dict[str, Any]:
    """The figures above; with ``peer_size``, also PS vs gloo all-reduce on the same shaped links
    (``peers[("gloo", n)]``, ``peers[("ps", n, p)]``: (Stats, check))."""
    sc = sshcluster_module()
    out: Dict[str, Any] = {}
    work = tempfile.mkdtemp(prefix="bench-cluster-")
    nodes = max(*node_counts, *(peer_workers if peer_size else ()), *(peer_pservers if peer_size else ()))
    with sc.SSHCluster(nodes, work) as cl:
        ns = [cl.netns(i) for i in range(cl.n)]
        # the bridge, unshaped
        for streams in (1, 2):
            st, ok, _ = rawtcp.measure(streams, size, raw_reps, host=cl.ips[1], recv_ns=ns[1], send_ns=ns[0])
            out[f"raw_bridge_{streams}"] = (st, ok)
        for i in range(cl.n):
            cl.shape(i, "1gbit")
        st, ok, _ = rawtcp.measure(1, size, raw_reps, host=cl.ips[1], recv_ns=ns[1], send_ns=ns[0])
        out["raw_shaped_1"] = (st, ok)
        for n in node_counts:
            hosts = [cl.ips[k] for k in range(1, n)]
            res = dense.run(size, 1, max_block=4 << 20, warmup=warmup, reps=reps, hosts=hosts,
                            prefix_ps=lambda k: cl._enter(k + 1), prefix_tr=lambda i: cl._enter(0),
                            trainer_ip=cl.ips[0], workdir=tempfile.mkdtemp(prefix="bench-shaped-"))
            out[f"shaped_{n}"] = res
        if peer_size:
            out["peers"] = _peers(cl, ns, peer_size, warmup, reps, peer_workers, peer_pservers)
    return out


def _peers(cl: Any, ns, size: int, warmup: int, reps: int, workers, pservers) -> Dict[Any, Any]:
    """gloo ring all-reduce on nodes 0..n-1 and our sync PS with trainer i and pserver k on nodes i and k."""
    from . import peers

    out: Dict[Any, Any] = {}
    for n in workers:
        out[("gloo", n)] = peers.gloo_allreduce(size, warmup, reps, world=n, ips=cl.ips[:n], netns=ns[:n])
        for p in pservers:
            out[("ps", n, p)] = peers.ps_sync(size, warmup, reps, n, p, cluster=cl)
    return out
