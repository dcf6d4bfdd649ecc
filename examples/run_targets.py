"""Measure every example's full target: 1 trainer, 2 trainers x 2 pservers sync, and 2 x 2 async.

Runs the real launcher on this machine (``localhost``, loopback) and prints one table: final metric, whether
it meets the target, the 1x1/2x2 agreement, and the wall time of each ``paddle-cluster run``.

    python examples/run_targets.py --movielens /data/ml-100k --ptb /data/ptb [--only fit_a_line,word2vec]

torch_recommendation needs torch (``pip install torch==2.13.0``); fit_a_line_paddle, fit_a_line written in Paddle 3
dygraph (``examples/fit_a_line/train_paddle.py``), needs paddlepaddle (``pip install paddlepaddle==3.3.1``).

The data are not shipped (licences); give their paths. For fit_a_line(_paddle) and word2vec the single trainer
gets the global batch of the two trainers together, so the 1x1 and 2x2 sync runs are the same optimisation; the
recommender scales its gradients by the trainer count instead (see its README), so it keeps its default batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Example:
    name: str
    metric: str
    target: float  # the final metric must be at most this
    args: Tuple[str, ...]  # for every run
    one_trainer: Tuple[str, ...]  # extra, for the 1x1 run: the global batch of the 2x2 run
    package: str = ""  # its directory under examples/ (default: its name)
    entry: str = "train.py"


def examples(movielens: str, ptb_shards: str) -> Dict[str, Example]:
    return {
        "fit_a_line": Example("fit_a_line", "test_mse", 30.0, (), ("--batch-size", "16")),
        "fit_a_line_paddle": Example("fit_a_line_paddle", "test_mse", 30.0, (), ("--batch-size", "16"),
                                     package="fit_a_line", entry="train_paddle.py"),
        "recommendation": Example("recommendation", "test_rmse", 0.90, ("--data", movielens), ()),
        # PyTorch, user and movie rows only (no side features): its global batch is split over the trainers.
        "torch_recommendation": Example("torch_recommendation", "test_rmse", 0.91, ("--data", movielens), ()),
        "word2vec": Example("word2vec", "valid_ppl", 250.0, ("--data", ptb_shards), ("--batch-size", "1024")),
    }


def free_base(n: int, lo: int = 20000, hi: int = 32000) -> int:
    """First of ``n`` consecutive ports free on 127.0.0.1, picked at random in [lo, hi) (below Linux's ephemeral
    range, 32768 up) so that two runs at once, or a test run, rarely try the same ones."""
    rng = random.Random()  # seeded from os.urandom: two processes started together still differ
    for _ in range(200):
        base = rng.randrange(lo, hi - n + 1)  # every port in [lo, hi)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in [{lo}, {hi})")


def run(ex: Example, work: Path, trainers: int, mode: str) -> Dict[str, object]:
    name = f"{ex.name}-{trainers}x{trainers}-{mode}"
    conf = work / f"{name}.py"
    conf.write_text("\n".join([
        'HOSTS = ["localhost"]', f"ROOT_DIR = {str(work / 'jobs')!r}", 'PADDLE_NIC = "lo"',
        f"PADDLE_PORT = {free_base(4 * trainers)}", "PADDLE_PORTS_NUM = 1", "PADDLE_PORTS_NUM_FOR_SPARSE = 1",
        f"PSERVERS_PER_NODE = {trainers}", f"TRAINERS_PER_NODE = {trainers}", f"PYTHON = {sys.executable!r}",
        'ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}', ""]))
    args = list(ex.args) + (list(ex.one_trainer) if trainers == 1 else []) + ["--mode", mode]
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "paddle_cluster", "--conf", str(conf), "run", "--job_dispatch_package",
                          str(HERE / (ex.package or ex.name)), "--entry", ex.entry, "--job_name", name, "--",
                          *args],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    found = re.findall(rf"final {ex.metric}=([0-9.eE+-]+|nan|inf)", res.stdout)
    value = float(found[-1]) if found else float("nan")
    if res.returncode != 0:
        print(f"{name}: exit {res.returncode}\n{res.stderr[-2000:]}", file=sys.stderr)
    return {"run": name, "example": ex.name, "trainers": trainers, "mode": mode, "metric": ex.metric,
            "value": value, "target": ex.target, "met": value <= ex.target, "wall_s": round(wall, 1),
            "exit": res.returncode}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--movielens", default=os.environ.get("MOVIELENS_DIR"), help="ml-1m or ml-100k directory")
    ap.add_argument("--ptb", default=os.environ.get("PTB_DIR"), help="directory with ptb.{train,valid,test}.txt")
    ap.add_argument("--only", default="fit_a_line,fit_a_line_paddle,recommendation,torch_recommendation,word2vec")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    chosen = [n for n in a.only.split(",") if n]
    missing = [flag for flag, needs in (("--movielens", ("recommendation", "torch_recommendation")),
                                        ("--ptb", ("word2vec",)))
               if set(needs) & set(chosen) and not getattr(a, flag[2:])]
    if missing:
        ap.error(f"{' and '.join(missing)} needed for the chosen examples (or drop them with --only)")
    work = Path(tempfile.mkdtemp(prefix="paddle-targets-"))
    shards = ""
    if "word2vec" in chosen:
        shards = str(work / "ptb-shards")
        subprocess.run([sys.executable, str(HERE / "word2vec" / "prepare.py"), "--data", a.ptb, "--out", shards,
                        "--split-count", "2"], check=True, capture_output=True)
    table = examples(a.movielens or "", shards)
    rows = []
    for name in chosen:
        for trainers, mode in ((1, "sync"), (2, "sync"), (2, "async")):
            rows.append(run(table[name], work, trainers, mode))
            r = rows[-1]
            print(f"{r['run']:<32} {r['metric']}={r['value']:.5g} target<={r['target']:g} "
                  f"{'met' if r['met'] else 'MISSED'}  {r['wall_s']:.0f} s", flush=True)
    print()
    for name in chosen:
        one = next(r for r in rows if r["example"] == name and r["trainers"] == 1)
        two = next(r for r in rows if r["example"] == name and r["trainers"] == 2 and r["mode"] == "sync")
        gap = abs(two["value"] - one["value"]) / one["value"] * 100
        print(f"{name}: 1x1 vs 2x2 sync differ by {gap:.2f} % ({'within' if gap <= 2 else 'OVER'} 2 %)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["met"] and r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
