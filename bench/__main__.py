"""``python -m bench``: the paddle-cluster benchmark suite. See docs/benchmarks.md.

Prints a table and the issue's targets, writes ``bench/results/latest.json`` (and the block-size plot).
Sections: raw, dense, sparse, peers, torch, torchnet (the torch rows across 3 shaped hosts), shaped,
launcher, dispatch (the launcher's dispatch rows alone) (``--only a,b``); ``--quick`` for small sizes,
``--smoke`` for tiny ones (the test suite's check that the suite runs). ``torchnet``, ``shaped`` and
``launcher`` need root and are skipped with a note otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from . import targets as goals
from .common import MB, REPO, Row, loadavg
from .cpu import Cpu

SECTIONS = ("raw", "dense", "sparse", "peers", "torch", "torchnet", "shaped", "launcher", "dispatch")
COMPRESSION = "fp16"  # the pservers' rows with gradient compression use pct.Compression.<this>

PRESETS: Dict[str, Dict[str, Any]] = {
    "full": {"size": 64 * MB, "warmup": 2, "reps": 7, "raw_reps": 5,
             "blocks": [256 << 10, MB, 4 * MB, 16 * MB, 32 * MB],
             "tiny": 4096, "tiny_reps": 500, "sparse": (1_000_000, 64, 100_000), "sparse_reps": 5,
             "shaped_size": 64 * MB, "shaped_reps": 4, "launch_counts": (1, 2, 4, 8, 16, 32), "launch_reps": 3,
             "dispatch_mb": 200, "dispatch_counts": (1, 3, 8), "dispatch_reps": 2,
             "torch_size": 64 * MB, "torch_rows": 1_000_000, "torch_reps": 5},
    "quick": {"size": 16 * MB, "warmup": 1, "reps": 4, "raw_reps": 3, "blocks": [256 << 10, 4 * MB, 16 * MB],
              "tiny": 4096, "tiny_reps": 200, "sparse": (200_000, 64, 20_000), "sparse_reps": 3,
              "shaped_size": 16 * MB, "shaped_reps": 3, "launch_counts": (1, 2), "launch_reps": 2,
              "dispatch_mb": 20, "dispatch_counts": (1, 3), "dispatch_reps": 1,
              "torch_size": 16 * MB, "torch_rows": 1_000_000, "torch_reps": 3},
    "smoke": {"size": 2 * MB, "warmup": 1, "reps": 2, "raw_reps": 2, "blocks": [MB],
              "tiny": 4096, "tiny_reps": 20, "sparse": (20_000, 16, 2_000), "sparse_reps": 2,
              "shaped_size": 2 * MB, "shaped_reps": 2, "launch_counts": (1,), "launch_reps": 1,
              "dispatch_mb": 2, "dispatch_counts": (1, 3), "dispatch_reps": 1,
              "torch_size": 1 * MB, "torch_rows": 20_000, "torch_reps": 2},
}


def gbs(x: float) -> float:
    return x / 1e9


class Suite:
    def __init__(self, cfg: Dict[str, Any], only: List[str], outdir: str) -> None:
        self.cfg = cfg
        self.only = only
        self.outdir = outdir
        self.rows: List[Row] = []
        self.m: Dict[str, Any] = {"size": cfg["size"], "cpu": {}}  # what the targets are computed from
        self.skipped: Dict[str, str] = {}

    def add(self, row: Row, cpu: Optional[Cpu] = None, key: str = "") -> None:
        """Record (and print) ``row``; ``cpu``: what its processes spent, in its note, JSON and ``m["cpu"][key]``."""
        if cpu is not None:
            row.note = f"{row.note}; {cpu.note()}" if row.note else cpu.note()
            row.extra["cpu"] = cpu.to_dict()
            if key:
                self.m["cpu"][key] = cpu
        self.rows.append(row)
        v = "-" if row.value is None else f"{row.value:.4g}"
        sp = "" if row.spread is None else f" ±{100 * row.spread / 2:.0f}%"
        print(f"  {row.section:<8} {row.name:<44} {v:>10} {row.unit:<7}{sp:<6} check={row.check} {row.note}",
              flush=True)

    # -- sections ------------------------------------------------------------------------------------------

    def raw(self) -> None:
        from . import rawtcp

        c = self.cfg
        for streams in (1, 2):
            st, ok, cpu = rawtcp.measure(streams, c["size"], c["raw_reps"])
            self.m[f"raw{streams}"] = st.median
            self.add(Row("raw", f"loopback TCP, {streams} stream(s), {c['size'] // MB} MB msgs", gbs(st.median),
                         "GB/s", st.spread(), check="ok" if ok else "FAILED: payload mismatch",
                         extra=st.to_dict()), cpu, f"raw{streams}")

    def dense(self) -> None:
        """Integrity on (the default) and off (``INTEGRITY = False``) in the same run: the peer and raw-TCP
        ratios use the integrity-off figures (the same work: no frame MACs), the integrity targets both."""
        from paddle_cluster.ps.wire.auth import SUITES

        from . import dense

        c = self.cfg
        size, w, r = c["size"], c["warmup"], c["reps"]
        mac = SUITES[max(SUITES)].__name__.replace("Mac", "")  # what trainers and pservers here negotiate
        for integrity, tag in ((True, ""), (False, "_off")):
            label = f"integrity on ({mac})" if integrity else "integrity off"
            res = dense.run(size, 1, warmup=w, reps=r, phases=("push", "pull", "pushpull"), integrity=integrity)
            chk = dense.check(res)
            for ph, nbytes in (("push", size), ("pull", size), ("pushpull", 2 * size)):
                st = dense.step_stats(res, ph)
                self.m[f"dense1_{ph}{tag}"] = nbytes / st.median
                self.add(Row("dense", f"1 trainer {ph} {size // MB} MB, 2 pservers, {label}", gbs(nbytes / st.median),
                             "GB/s", st.spread(), check=chk, extra=st.to_dict()), dense.cpu_stats(res, ph),
                         f"dense1{tag}" if ph == "pushpull" else "")
            if integrity:
                self._memory("1 trainer sync", res)
        if mac != "HmacSha256":  # what a node with only the standard library gets
            res = dense.run(size, 1, warmup=w, reps=r, integrity=True, stdlib_mac=True)
            st = dense.step_stats(res, "pushpull")
            rate = 2 * size / st.median
            self.add(Row("dense", f"1 trainer pushpull {size // MB} MB, integrity on (HmacSha256, stdlib only)",
                         gbs(rate), "GB/s", st.spread(), check=dense.check(res), extra=st.to_dict(),
                         note=f"= {rate / self.m['dense1_pushpull_off']:.2f} of integrity off"),
                     dense.cpu_stats(res, "pushpull"))
        for mode, integrity in (("sync", True), ("sync", False), ("async", True)):
            tag = "" if integrity else "_off"
            res = dense.run(size, 2, mode=mode, warmup=w, reps=r, integrity=integrity)
            st = dense.step_stats(res, "pushpull")
            self.m[f"dense2_{mode}{tag}"] = 4 * size / st.median
            self.m[f"dense2_{mode}_step{tag}"] = st.median
            label = f"integrity on ({mac})" if integrity else "integrity off"
            self.add(Row("dense", f"2 trainers {mode} push+pull, aggregate, {label}",
                         gbs(4 * size / st.median), "GB/s", st.spread(), note=f"step {1e3 * st.median:.1f} ms",
                         check=dense.check(res), extra=st.to_dict()), dense.cpu_stats(res, "pushpull"),
                     f"dense2{tag}" if mode == "sync" else "")
            if mode == "sync" and integrity:
                self._memory("2 trainers sync", res)
        for trainers, integrity in ((1, False), (1, True), (2, False)):
            self._lane(trainers, integrity, mac)
        sweep = []
        for n in (1, 2):
            self._sgd(n)
            self._frames(n, 2)
            self._frames(n, 2, shm=True)
        for mb in c["blocks"]:
            res = dense.run(size, 1, max_block=mb, warmup=w, reps=max(3, r - 2))
            st = dense.step_stats(res, "pushpull")
            sweep.append((mb, 2 * size / st.median, st.spread()))
            self.add(Row("dense", f"block size {mb >> 10} KB: 1 trainer push+pull", gbs(2 * size / st.median), "GB/s",
                         st.spread(), check=dense.check(res), extra=st.to_dict()), dense.cpu_stats(res, "pushpull"))
        self.m["sweep"] = sweep
        self._plot_sweep(sweep)
        for trainers in (1, 2):
            res = dense.run(c["tiny"], trainers, warmup=20, reps=c["tiny_reps"])
            st = dense.step_stats(res, "pushpull")
            self.m[f"barrier{trainers}_p99"] = st.pct(99)
            self.add(Row("dense", f"barrier round trip, {c['tiny']} B model, {trainers} trainer(s)",
                         1e3 * st.median, "ms p50", None, note=f"p99 {1e3 * st.pct(99):.3f} ms",
                         check=dense.check(res), extra={"p50": st.median, "p99": st.pct(99), "max": st.hi}))

    def _lane(self, trainers: int, integrity: bool, mac: str) -> None:
        """Sync push+pull through same-host lanes (docs/architecture.md), against the TCP row of the same run."""
        from . import dense

        c = self.cfg
        size = c["size"]
        res = dense.run(size, trainers, warmup=c["warmup"], reps=c["reps"], integrity=integrity, lane=True)
        st = dense.step_stats(res, "pushpull")
        moved, tag = 2 * trainers * size, "" if integrity else "_off"
        tcp = self.m[f"dense{trainers}_{'pushpull' if trainers == 1 else 'sync'}{tag}"]
        self.m[f"lane{trainers}{tag}"], self.m[f"lane{trainers}_step{tag}"] = moved / st.median, st.median
        label = f"integrity on ({mac})" if integrity else "integrity off"
        self.add(Row("dense", f"{trainers} trainer(s) sync push+pull, same-host lane, {label}", gbs(moved / st.median),
                     "GB/s", st.spread(), check=dense.check(res), extra=st.to_dict(),
                     note=f"step {1e3 * st.median:.1f} ms, {moved / st.median / tcp:.2f}x TCP"),
                 dense.cpu_stats(res, "pushpull"), f"lane{trainers}{tag}")

    def _sgd(self, trainers: int) -> None:
        """The pserver's SGD path alone for ``trainers`` sync trainers (bench.cpu.sgd_alone), and for 1 and 2 the
        same loop without the update (what the fold's Python and locks cost), once per run."""
        from . import cpu as cpumod

        c = self.cfg
        size = c["size"]
        for no_sgd in (False, True) if trainers <= 2 else (False,):
            key = f"{'fold' if no_sgd else 'sgd'}{trainers}"
            if key in self.m["cpu"]:
                continue
            cpu, chk = cpumod.sgd_alone(size, trainers, c["reps"], no_sgd=no_sgd)
            what = ("the same fold loop, SGD removed (bench only)" if no_sgd
                    else "pserver SGD path alone (push_segments)")
            self.add(Row("cpu", f"{what}, {trainers} trainer(s), {size // MB} MB", 1e3 * cpu.per_step, "ms CPU",
                         None, check=chk, extra={"cpu": cpu.to_dict()}))
            self.m["cpu"][key] = cpu

    def _frames(self, trainers: int, servers: int, shm: bool = False) -> None:
        """Plain sockets sending our frames with our SGD (bench.frames), once per run: what the PS's traffic
        pattern costs with nothing of ours, for the CPU bounds; ``shm``: the arrays through shared memory, what a
        same-host lane costs at least (its own row, never read as TCP)."""
        from . import frames

        c = self.cfg
        key = f"{'shm' if shm else 'frames'}{trainers}_{servers}"
        if key in self.m["cpu"]:
            return
        st, ok, cpu = frames.measure(trainers, c["size"], c["reps"], servers=servers, warmup=c["warmup"], shm=shm)
        what = "the same pattern through shared memory (a same-host lane)" if shm else "plain sockets in our frames"
        self.add(Row("cpu", f"{what}, {trainers} trainer(s), {servers} servers, "
                            f"{c['size'] // MB} MB", 1e3 * cpu.per_step, "ms CPU", None,
                     check="ok" if ok else "FAILED: values", note=f"step {1e3 * st.median:.1f} ms",
                     extra={"cpu": cpu.to_dict(), **st.to_dict()}))
        self.m["cpu"][key] = cpu

    def _memory(self, what: str, res: Dict[str, Any]) -> None:
        """A row per pserver holding a block: its memory over what the design says it holds (``dense.Holds``),
        the raw growth over the model's part in the note."""
        from .dense import Memory

        for k, (idle, end, h) in enumerate(zip(res["idle_mem"], res["end_mem"], res["holds"])):
            if not h.held:  # a model too small to reach this pserver (the smoke size): nothing to judge
                continue
            mem = Memory(what, k, end["VmHWM"] - idle["VmRSS"], end["VmHWM"], idle["VmRSS"], h)
            self.m.setdefault("mem", []).append(mem)
            self.add(Row("memory", f"pserver {k} peak RSS growth / design, {what}", mem.ratio, "x", None,
                         note=mem.note(), check="-",
                         extra={"peak": mem.peak, "idle": mem.idle, "growth": mem.growth, "raw": mem.raw,
                                "holds": asdict(h), "design": h.total}))

    def _plot_sweep(self, sweep) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([s[0] / MB for s in sweep], [gbs(s[1]) for s in sweep], "o-", label="push+pull, 1 trainer")
        if "raw2" in self.m:
            ax.axhline(gbs(self.m["raw2"]), color="gray", ls="--", label="raw TCP, 2 streams")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max block size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{self.cfg['size'] // MB} MB float32 over 2 pservers")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(self.outdir, "block_sweep.png"), dpi=100)
        plt.close(fig)

    def sparse(self) -> None:
        from . import sparse

        rows, width, batch = self.cfg["sparse"]
        r = self.cfg["sparse_reps"]
        runs = {tag: sparse.run(rows, width, batch, reps=r, integrity=not tag) for tag in ("", "_off")}
        npr = sparse.numpy_inprocess(rows, width, batch, reps=r)
        for op in ("pull", "push"):
            nrate = batch / npr[op].median
            for tag, ps in runs.items():
                rate = batch / ps[op].median
                self.m[f"sparse_{op}{tag}"] = rate / nrate
                self.add(Row("sparse", f"{op} {batch} unique ids of {rows}x{width}, 2 pservers, integrity "
                             f"{'off' if tag else 'on'}", rate / 1e6, "Mrows/s", ps[op].spread(),
                             note=f"= {100 * rate / nrate:.0f}% of numpy", check=ps["check"], extra=ps[op].to_dict()))
            self.add(Row("sparse", f"{op}: numpy in-process {'gather' if op == 'pull' else 'scatter-add'}",
                         nrate / 1e6, "Mrows/s", npr[op].spread(), check=npr["check"], extra=npr[op].to_dict()))

    def peers(self) -> None:
        from . import peers

        c = self.cfg
        size = c["size"]
        for name, fn in (("pyzmq PS", peers.zmq_ps), ("Ray-actor PS (actors on a Ray node of their own)",
                                                       peers.ray_ps)):
            st, chk, cpu = fn(size, c["warmup"], c["reps"])
            key = "zmq" if "zmq" in name else "ray"
            if st is None:
                self.skipped[key] = chk
                self.add(Row("peers", f"{name}: 1 trainer push+pull", None, "GB/s", note=f"skipped: {chk}",
                             check="-"))
                continue
            self.m[key] = 2 * size / st.median
            ours = self.m.get("dense1_pushpull_off")
            self.add(Row("peers", f"{name}: 1 trainer push+pull {size // MB} MB", gbs(2 * size / st.median), "GB/s",
                         st.spread(), note="" if ours is None else f"ours = {ours / self.m[key]:.2f}x",
                         check=chk, extra=st.to_dict()), cpu, key)
        self.m["ps_vs_ring"] = self._ps_vs_ring("peers", "loopback", size, c["warmup"], c["reps"],
                                               peers.gloo_allreduce, peers.ps_sync)
        if ("gloo", 2) in self.m["ps_vs_ring"]:
            self.m["gloo"] = self.m["ps_vs_ring"][("gloo", 2)]

    def torch(self) -> None:
        """PyTorch models on the pservers against DDP with gloo on one machine (bench/frameworks.py): the MLP and
        the embedding table at 2 and 4 trainers, each with the defaults a user gets (the same-host lane), over
        TCP and with gradient compression."""
        from . import frameworks

        self._frameworks("one machine", lambda n, **kw: frameworks.Setup(n, **kw), transports=True)

    def torchnet(self) -> None:
        """The same across 3 hosts on 1 Gbit/s links (the shaped network namespaces): a pserver per node,
        trainer ``i`` on node ``i % 3``, DDP's rank ``i`` likewise."""
        from . import frameworks, shaped

        if self._no_cluster("torchnet"):
            return
        with shaped.shaped_cluster(3) as cl:
            self._frameworks("3 hosts, 1 Gbit/s", lambda n, **kw: frameworks.Setup(n, cluster=cl, **kw),
                             transports=False)

    def _frameworks(self, where: str, setup, transports: bool) -> None:
        """One DDP row per model and trainer count, then the pservers' rows against it: with the defaults
        (the lane on), over TCP where ``transports``, and with compression (the MLP); ``m`` keeps every
        ratio under ``("torch", model, where, trainers, variant)``."""
        from . import frameworks

        c = self.cfg
        why = frameworks._missing()
        if why:
            self.skipped["torch"] = why
            self.add(Row("torch", f"PyTorch models, {where}", None, "ms", note=f"skipped: {why}", check="-"))
            return
        rows, dim = c["torch_rows"], 32
        zip_ = frameworks.no_compression(COMPRESSION)
        for model in ("dense", "embedding"):
            what = frameworks.describe(model, c["torch_size"], rows, dim)
            args = frameworks.args_for(model, c["torch_size"], c["warmup"], c["torch_reps"], rows, dim)
            for n in (2, 4):
                ddp = frameworks.ddp(args, setup(n))
                self.m[("torch", model, where, n, "ddp")] = ddp.step.median
                self.add(Row("torch", f"DDP gloo: {what}, {n} trainers, {where}", 1e3 * ddp.step.median, "ms",
                             ddp.step.spread(), check="-", extra=ddp.step.to_dict(),
                             note=f"global batch {frameworks.GLOBAL_BATCH}{self._target(model, ddp)}"), ddp.cpu)
                variants = [("defaults", "defaults (lane on)", {})]
                if transports:
                    variants.append(("tcp", "over TCP", {"lane": False}))
                if model == "dense":
                    variants.append(("fp16", f"defaults, {COMPRESSION} compression", {"compression": COMPRESSION}))
                for key, label, kw in variants:
                    name = f"pservers, {label}: {what}, {n} trainers, {where}"
                    if kw.get("compression") and zip_:
                        self.add(Row("torch", name, None, "ms", note=f"skipped: {zip_}", check="-"))
                        continue
                    ps, chk = frameworks.pservers(args, setup(n, **kw), ddp)
                    ratio = ps.step.median / ddp.step.median
                    self.m[("torch", model, where, n, key)] = ratio
                    self.add(Row("torch", name, 1e3 * ps.step.median, "ms", ps.step.spread(), check=chk,
                                 extra={**ps.step.to_dict(), "losses": ps.losses, "ends": ps.ends},
                                 note=f"{ratio:.2f}x DDP's step, {ps.cpu.per_step / ddp.cpu.per_step:.2f}x its CPU"
                                      f"{self._target(model, ps, ddp)}"), ps.cpu)

    @staticmethod
    def _target(model: str, side, ddp=None) -> str:
        """The MLP's time to the target loss (``frameworks.TARGET`` of its first step's), against DDP's."""
        from . import frameworks

        if model != "dense":
            return ""
        first = (ddp or side).losses[0]
        got = side.to_target(frameworks.TARGET * first)
        if got is None:
            return f"; loss never at {frameworks.TARGET} of its first in {len(side.losses)} steps"
        out = f"; to loss <= {frameworks.TARGET} x first: {got[1]:.2f} s ({got[0]} steps)"
        theirs = ddp.to_target(frameworks.TARGET * first) if ddp is not None else None
        return out + (f", {got[1] / theirs[1]:.2f}x DDP's" if theirs else "")

    def _ps_vs_ring(self, section: str, where: str, size: int, warmup: int, reps: int, gloo, ps,
                    workers=(2, 4), pservers=(2, 4)) -> Dict[Any, float]:
        """gloo ring all-reduce and our sync PS (integrity off) at each worker count, one row each; the note gives
        the bytes a worker sends (and receives as many) per step, and all the bytes sent by anyone (the
        pservers' too). Returns the median step times."""
        from . import peers

        out: Dict[Any, float] = {}
        loop = section == "peers"  # loopback: CPU recorded for the bounds
        for n in workers:
            if loop:
                self._sgd(n)
            st, chk, cpu = gloo(size, warmup, reps, n)
            ring = peers.ring_bytes(size, n)
            if st is None:
                self.skipped["gloo"] = chk
                self.add(Row(section, f"torch gloo all-reduce, {n} workers, {where}", None, "ms",
                             note=f"skipped: {chk}", check="-"))
            else:
                out[("gloo", n)] = st.median
                self.add(Row(section, f"gloo ring all-reduce {size // MB} MB, {n} workers, {where}", 1e3 * st.median,
                             "ms", st.spread(), check=chk, extra=st.to_dict(),
                             note=f"per worker {ring / MB:.0f} MB out + in, all {n * ring / MB:.0f} MB"),
                         cpu if loop else None, f"gloo{n}")
            for p in pservers:
                if loop:
                    self._frames(n, p)
                st, chk, cpu = ps(size, warmup, reps, n, p)
                out[("ps", n, p)] = st.median
                vs = f", {st.median / out[('gloo', n)]:.2f}x gloo" if ("gloo", n) in out else ""
                default = ", default placement" if not loop and p == n * goals.DEFAULT_PER_NODE else ""
                self.add(Row(section, f"our sync PS push+pull {size // MB} MB, {n} workers, {p} pservers{default}, "
                                      f"{where}",
                             1e3 * st.median, "ms", st.spread(), check=chk, extra=st.to_dict(),
                             note=f"per worker {size / MB:.0f} MB out + in, all {2 * n * size / MB:.0f} MB{vs}"),
                         cpu if loop else None, f"ps{n}_{p}")
        return out

    def _no_cluster(self, section: str) -> bool:
        """True, with a skipped row, when the SSH test cluster ``section`` runs on cannot be built here."""
        from . import shaped

        why = shaped.unavailable()
        if why:
            self.skipped[section] = why
            self.add(Row(section, "SSH test cluster", None, "", note=f"skipped: {why}", check="-"))
        return bool(why)

    def shaped(self) -> None:
        from . import dense, shaped

        if self._no_cluster("shaped"):
            return
        c = self.cfg
        size = c["shaped_size"]
        out = shaped.run(size, c["warmup"], c["shaped_reps"], c["raw_reps"], peer_size=size)
        for key, label in (("raw_bridge_1", "raw TCP across the bridge, 1 stream"),
                           ("raw_bridge_2", "raw TCP across the bridge, 2 streams"),
                           ("raw_shaped_1", "raw TCP on a 1 Gbit/s link, 1 stream")):
            st, ok = out[key]
            self.m[key] = st.median
            self.add(Row("shaped", label, gbs(st.median), "GB/s", st.spread(), check="ok" if ok else "FAILED",
                         note=f"{100 * st.median / shaped.LINE_RATE:.1f}% of 1 Gbit/s" if "shaped" in key else "",
                         extra=st.to_dict()))
        for n in (2, 3):
            res = out[f"shaped_{n}"]
            st = dense.step_stats(res, "pushpull")
            frac = 2 * size / st.median / shaped.LINE_RATE
            self.m[f"shaped_{n}"] = frac
            self.add(Row("shaped", f"{n} nodes, 1 Gbit/s links: push+pull goodput", 100 * frac, "% line", st.spread(),
                         note=f"{2 * size / st.median / 1e6:.1f} MB/s", check=dense.check(res), extra=st.to_dict()))
        done = out["peers"]  # measured in the cluster above; rows and notes as on loopback
        self.m["ps_vs_ring_shaped"] = self._ps_vs_ring(
            "shaped", "1 Gbit/s links", size, c["warmup"], c["shaped_reps"],
            lambda size, w, r, n: done[("gloo", n)], lambda size, w, r, n, p: done[("ps", n, p)])

    def launcher(self, parts=("launch", "dispatch")) -> None:
        from . import launcher

        if self._no_cluster("launcher"):
            return
        c = self.cfg
        out = launcher.run(counts=tuple(c["launch_counts"]), reps=c["launch_reps"], dispatch_mb=c["dispatch_mb"],
                           dispatch_counts=tuple(c["dispatch_counts"]), dispatch_reps=c["dispatch_reps"], parts=parts)
        launcher.report(out, c, self.add, self.m)

    def dispatch(self) -> None:
        """The launcher section's dispatch rows alone (``--only dispatch``; ``launcher`` has them too)."""
        if "launcher" not in self.only:
            self.launcher(parts=("dispatch",))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite's smoke test)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "latest.json"))
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        ap.error(f"unknown sections {bad}: choose from {', '.join(SECTIONS)}")
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    cfg = PRESETS[preset]
    outdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(outdir, exist_ok=True)
    suite = Suite(cfg, only, outdir)
    load0 = loadavg()
    started = time.time()
    print(f"paddle-cluster bench ({preset}): {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, load {load0}", flush=True)
    failed = []
    for sec in SECTIONS:
        if sec not in only:
            continue
        print(f"[{sec}]", flush=True)
        try:
            getattr(suite, sec)()
        except Exception as e:  # one broken section must not lose the others' results
            traceback.print_exc()
            failed.append(f"{sec}: {e!r}")
            suite.add(Row(sec, "section failed", None, "", note=repr(e)[:200], check=f"FAILED: {e!r}"[:200]))
    targets = goals.targets(suite.m, suite.skipped, cfg)
    print("\ntargets:")
    for tg in targets:
        v = "-" if tg.value is None else f"{tg.value:.3g}"
        print(f"  {tg.name:<52} {v:>8}  goal {tg.goal:<8} {tg.verdict}" + (f"\n      {tg.detail}" if tg.detail else ""))
    doc = {
        "preset": preset, "sections": only, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1), "load_before": load0, "load_after": loadavg(),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release(), "mem_gb": round(os.sysconf("SC_PAGE_SIZE")
                                                                   * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "config": {k: v for k, v in cfg.items()}, "cpu_bound": goals.CPU_BOUND,
        "rows": [r.to_dict() for r in suite.rows], "targets": [t.to_dict() for t in targets],
        "failed_sections": failed,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"\n{len(suite.rows)} rows in {doc['seconds']} s, load {doc['load_after']}; wrote {args.out}")
    checks_failed = [r for r in suite.rows if r.check.startswith("FAILED")]
    return 1 if checks_failed or failed else 0


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
