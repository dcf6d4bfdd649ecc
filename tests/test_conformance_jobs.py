"""The conformance suite, part two (tests/test_conformance.py is part one; tests/conformance_cases.py declares
both): what happens around a job's whole life on every backend, through the real CLI and the README's conf.py
-- the launcher's stop signals (a second Ctrl+C, SIGTERM, SIGHUP), the launcher killed, and several jobs
launched at once from one machine, one of them seed 003's dual-role ``dist_train.py``. The engines are
tests/engines/'s."""

from __future__ import annotations

import json
import re
import signal
import statistics
from pathlib import Path
from typing import Dict, List

import pytest
from conformance_cases import cases
from engines import ENGINES
from helpers import HOUSING, SEEDS, ported, wait_for
from userengine import DUAL_HOLD_PY, Engine, Running, job_processes, seed_cache, workspace

from paddle_cluster.launch.top import STALL_S

GRACE = 120  # KILL_GRACE of the signals scenario: a stop that waits it out fails the test's wait of 60 s


def status(engine: Engine, job: str) -> dict:
    st = engine.cli("status", "--json", "--job_name", job)
    assert st.returncode == 0, st.stdout + st.stderr
    return json.loads(st.stdout)


def processes(engine: Engine) -> List[str]:
    return sorted([f"pserver.{i}" for i in range(engine.pservers)] + [f"trainer.{t}" for t in range(engine.trainers)])


def assert_running(engine: Engine, job: str) -> None:
    """``status`` of a job whose trainers hold: no outcome yet, and exactly its own processes, every one running,
    each trainer's row with its own last line (k8s reads the pods' logs at once, and puts each in its row)."""
    doc = status(engine, job)
    assert doc["outcome"] is None, doc
    assert sorted(p["name"] for p in doc["processes"]) == processes(engine), doc
    assert {p["state"] for p in doc["processes"]} == {"running"}, doc
    said = {p["name"]: p["last_line"] for p in doc["processes"] if p["name"].startswith("trainer.")}
    assert said == {f"trainer.{t}": f"holding {t}" for t in range(engine.trainers)}, doc


def assert_ended(engine: Engine, job: str, code: int, outcome: str) -> None:
    doc = status(engine, job)
    assert doc["exit_code"] == code and outcome in (doc["outcome"] or ""), doc
    assert "running" not in {p["state"] for p in doc["processes"]}, doc


ROW_FIELDS = {"node", "host", "name", "role", "state", "step", "steps_per_s", "loss", "metrics", "samples_per_s", "cpu",
              "rss", "sent_per_s", "received_per_s", "ps_share", "rows", "held", "budget", "wait_p50", "wait_p99",
              "still_s", "mode", "bad", "stalled", "malformed"}


def assert_top(engine: Engine, job: str) -> None:
    """``top --json`` of a running trainer-only job whose trainers registered one dense block and hold (the
    built-in pservers serve), field by field: every process running, with the CPU % and RSS of its node's agent
    (a pod's entry point on Kubernetes), its own counters (a trainer's traffic and time in pserver calls; a
    pserver's rows and bytes against its budget), no trainer behind the others, no note, no outcome yet."""
    res = engine.cli("top", "--json", "--job_name", job, timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    snap = json.loads(res.stdout)
    assert set(snap) == {"job", "age_s", "steps_per_s", "samples_per_s", "slowest", "outcome", "rows", "notes",
                         "rate"}, snap
    assert snap["job"] == job and snap["outcome"] is None and snap["notes"] == [], snap
    assert snap["age_s"] > 0 and snap["steps_per_s"] == 0 and snap["samples_per_s"] is None, snap
    assert snap["slowest"] is None, snap  # every trainer holds at step 0: none is behind
    rows = {r["name"]: r for r in snap["rows"]}
    assert sorted(rows) == processes(engine), snap
    for name, r in rows.items():
        assert set(r) == ROW_FIELDS, r
        assert r["role"] == name.split(".")[0] and r["state"] == "running" and r["node"], r
        assert not r["bad"], r
        assert r["cpu"] is not None and r["cpu"] >= 0 and r["rss"] > 10 << 20, r  # a Python with numpy
        assert r["loss"] is None and r["metrics"] == {} and r["samples_per_s"] is None, r  # no metrics records
        assert r["sent_per_s"] is not None and r["received_per_s"] is not None, r  # it writes its counters
    for t in (r for r in rows.values() if r["role"] == "trainer"):
        assert t["step"] == 0 and t["steps_per_s"] == 0 and 0 <= t["ps_share"] <= 1, t
        assert t["stalled"] == (t["still_s"] > STALL_S), t  # holding: yellow once it has not stepped for a while
        assert t["rows"] is None and t["held"] is None and t["budget"] is None and t["mode"] in ("sync", "async"), t
        assert t["malformed"] == [], t
    pservers = [r for r in rows.values() if r["role"] == "pserver"]
    for p in pservers:
        assert p["rows"] == 0 and 0 <= p["held"] < p["budget"] and p["ps_share"] is None, p  # no sparse table
    assert sum(p["held"] for p in pservers) > 0, pservers  # the block of 10 floats is held by one of them


def stop_all(runs: Dict[str, Running]) -> None:
    """What a failed test leaves: every run still going is killed (the engine's finalizers clean the nodes)."""
    for r in runs.values():
        if r.p.poll() is None:
            r.p.kill()
            r.p.wait()


# -- the launcher's stop signals ---------------------------------------------------------------------------------


def job_roles(job: str) -> List[str]:
    """PADDLE_TRAINING_ROLE of each process of ``job`` running on this machine's hosts and pods."""
    roles = []
    for line in job_processes([job]):
        pid = int(line.split(":")[0])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        roles += [v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"PADDLE_TRAINING_ROLE=")]
    return roles


@pytest.mark.parametrize("engine", cases("signals"), indirect=True)
def test_second_ctrl_c_and_sigterm(engine: Engine):
    engine.add_conf(KILL_GRACE=GRACE)  # the scenario is about the grace period: long, so skipping it shows
    ws = workspace(engine.tmp, {"train.py": DUAL_HOLD_PY})
    twice, term = engine.job("twice"), engine.job("term")
    runs = {twice: engine.start(twice, "--job_dispatch_package", str(ws), "--", "ignore-term"),
            term: engine.start(term, "--job_dispatch_package", str(ws), "--", *engine.own_ports(1))}
    try:
        for r in runs.values():
            r.wait_lines(r"\] holding \d", engine.trainers)
        runs[term].p.send_signal(signal.SIGTERM)
        r = runs[twice]
        r.p.send_signal(signal.SIGINT)
        # The stop is under way: the pservers are gone (SIGTERM ends them), the trainers ignore it and stay.
        wait_for(lambda: r.p.poll() is not None or ("PSERVER" not in job_roles(twice) and any(
            "interrupted: stopping job" in x for x in r.err)), 60, "the pservers of the first stop to end")
        r.p.send_signal(signal.SIGINT)
        assert r.wait(60) == 130, r.text()
        assert runs[term].wait(60) == 130, runs[term].text()
    finally:
        stop_all(runs)
    for r in runs.values():
        err = "".join(r.err)
        assert "interrupted" in err and "Traceback" not in err, r.text()
    engine.assert_nothing_left()
    for job in runs:
        assert_ended(engine, job, 130, "interrupted")


# -- the launcher hung up on, or killed --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", cases("launcher_gone"), indirect=True)
def test_sighup_and_sigkill_to_the_launcher(engine: Engine):
    ws = workspace(engine.tmp, {"train.py": DUAL_HOLD_PY})
    hup, dead = engine.job("hup"), engine.job("sigkill")
    runs = {hup: engine.start(hup, "--job_dispatch_package", str(ws)),
            dead: engine.start(dead, "--job_dispatch_package", str(ws), "--", *engine.own_ports(1))}
    try:
        for r in runs.values():
            r.wait_lines(r"\] holding \d", engine.trainers)
        runs[dead].p.kill()
        runs[hup].p.send_signal(signal.SIGHUP)
        assert runs[hup].wait(120) == 130, runs[hup].text()
        runs[dead].wait(10)
    finally:
        stop_all(runs)
    assert "interrupted" in "".join(runs[hup].err), runs[hup].text()
    wait_for(lambda: not job_processes([hup]), 60, f"no process of {hup} left")
    assert_ended(engine, hup, 130, "interrupted")
    if ENGINES[engine.name].runs_on_without_launcher:  # the engine runs it on its own (docs/backends.md)
        assert_running(engine, dead)
    else:  # every node's agent notices its launcher gone and stops the job on its own, before any kill
        wait_for(lambda: not job_processes([dead]), 90, f"the agents to stop {dead} on their own")
        doc = status(engine, dead)
        assert "running" not in {p["state"] for p in doc["processes"]}, doc
    k = engine.cli("kill", "--job_name", dead)
    assert k.returncode == 0 and "Traceback" not in k.stderr, k.stdout + k.stderr
    engine.assert_nothing_left()


# -- several jobs launched at once -------------------------------------------------------------------------------

# A trainer-only script (the built-in pserver serves): each trainer joins the job, holds while the file named by
# its last argument exists, then pushes once and ends.
HOLD_UNTIL_PY = r"""
import os, sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
hold = sys.argv[-1]
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.5))
ps.register_dense({"w": np.zeros(10, np.float32)})
print("holding", ps.trainer_id, flush=True)
while os.path.exists(hold):
    time.sleep(0.1)
ps.push({"w": np.ones(10, np.float32)})
print(f"done w0={ps.pull()['w'][0]:g}", flush=True)
ps.close()
"""
LOSS = re.compile(r"^\[trainer\.(\d+)@[^\]]+\] Epoch: (\d+), Batch: \d+, loss: (\S+)$")


def assert_loss_falls(lines: List[str], trainers: int) -> None:
    """Every trainer's loss, as in the seed's quick start: in the hundreds in epoch 0, under a quarter of that
    by its last 5 epochs (the median of their batches: one batch of a shuffled reader may be far off; epoch 29's
    mean of 6 batches once came to 163 where epoch 0's was 646)."""
    got: Dict[int, Dict[int, List[float]]] = {}
    for line in lines:
        m = LOSS.match(line.strip())
        if m:
            got.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), []).append(float(m.group(3)))
    assert sorted(got) == list(range(trainers)), sorted(got)
    for t, epochs in got.items():
        assert sorted(epochs) == list(range(30)), (t, sorted(epochs))
        first = sum(epochs[0]) / len(epochs[0])
        last = statistics.median(v for e in range(25, 30) for v in epochs[e])
        assert first > 300 and last < first / 4, (t, first, last)


@pytest.mark.parametrize("engine", cases("concurrent"), indirect=True)
def test_jobs_launched_at_once(engine: Engine):
    seed_cache(engine, "uci_housing", HOUSING)  # the repository ships the UCI housing data (examples/fit_a_line)
    engine.add_conf(**engine.cache_keys)  # where the nodes' cache is not their ~/.cache/paddle/dataset
    ws = workspace(engine.tmp, {"hold.py": HOLD_UNTIL_PY})
    ported(SEEDS / "dist_train.py", ws / "dist_train.py")
    hold = engine.tmp / "hold"  # outside /home/paddle: every host and pod sees it
    hold.touch()
    seed, held, killed = engine.job("seed"), engine.job("held"), engine.job("killed")
    trainer_only = ("--job_dispatch_package", str(ws), "--entry", "hold.py", "--pserver", "builtin")
    runs = {seed: engine.start(seed, "--job_dispatch_package", str(ws), "--entry", "dist_train.py"),
            held: engine.start(held, *trainer_only, "--", *engine.own_ports(1), str(hold)),
            killed: engine.start(killed, *trainer_only, "--", *engine.own_ports(2), str(hold))}
    try:
        for job in (held, killed):  # on Slurm one of three may wait for a slot: two fit on its nodes
            runs[job].wait_lines(r"\] holding \d", engine.trainers, timeout=240)
            assert_running(engine, job)
        lg = engine.cli("logs", engine.log_node(1), "--role", "trainer", "--job_name", killed)
        assert lg.returncode == 0 and "holding 1" in lg.stdout and "Epoch" not in lg.stdout, lg.stdout + lg.stderr
        k = engine.cli("kill", "--job_name", killed)
        assert k.returncode == 0, k.stdout + k.stderr
        rc = runs[killed].wait(120)
        assert rc == 3, runs[killed].text()
        assert runs[held].p.poll() is None, runs[held].text()  # the kill left the other jobs alone
        assert_running(engine, held)
        assert_top(engine, held)
        assert runs[seed].wait(300) == 0, runs[seed].text()
        hold.unlink()
        assert runs[held].wait(120) == 0, runs[held].text()
    finally:
        stop_all(runs)
    engine.assert_nothing_left()
    for r in runs.values():
        assert "Traceback" not in "".join(r.err), r.text()
    assert_loss_falls(runs[seed].out, engine.trainers)
    assert not [x for x in runs[seed].out if "holding" in x], "another job's lines in the seed job's output"
    done = [x for x in runs[held].out if "] done w0=" in x]
    assert len(done) == engine.trainers and all("done w0=-0.5" in x for x in done), done  # one step of its own
    assert_ended(engine, seed, 0, "finished")
    assert_ended(engine, held, 0, "finished")
    assert_ended(engine, killed, 3, "stopped by paddle-cluster kill")
    lg = engine.cli("logs", engine.log_node(0), "--role", "trainer", "--job_name", seed)
    assert lg.returncode == 0 and "Epoch: 29" in lg.stdout and "holding" not in lg.stdout, lg.stdout + lg.stderr
    lg = engine.cli("logs", engine.log_node(0), "--role", "trainer", "--job_name", held)
    assert lg.returncode == 0 and "done w0=-0.5" in lg.stdout and "Epoch" not in lg.stdout, lg.stdout + lg.stderr


# -- a collective job ---------------------------------------------------------------------------------------------

# A torch.distributed script as torchrun starts it, unchanged: env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
# WORLD_SIZE) over gloo; one DDP step (its gradient is the mean of every rank's) and an all_reduce. With "fail",
# rank 1 exits after the step while the others wait for it in a collective.
DDP_PY = r"""
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1, bias=False))
w0 = model.module.weight.detach().clone()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.full((2, 4), float(rank + 1))).sum().backward()  # d/dw = 2 * (rank + 1) per element
opt.step()
step = (w0 - model.module.weight.detach()).sum().item()  # 0.1 * 4 elements * the mean of 2 * (rank + 1)
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(f"rank {rank} world {world} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} "
      f"group {os.environ['GROUP_RANK']} sum {t.item():g} step {step:.5f}", flush=True)
if "fail" in sys.argv[1:] and rank == 1:
    sys.exit("rank 1: out of data")
dist.barrier()  # with "fail", waits for rank 1 until the launcher stops this process, or gloo notices it gone
# torch 2.13's gloo teardown (destroy_process_group, or the interpreter's exit) aborts now and then, barrier or not
# (SIGABRT, "terminate called without an active exception"; with torchrun too): this test is about the launcher,
# so the rank leaves without it.
sys.stdout.flush()
os._exit(0)
"""
RANK_LINE = re.compile(r"\] rank (\d+) world (\d+) local (\d+)/(\d+) group (\d+) sum (\S+) step (\S+)$")


@pytest.mark.parametrize("engine", cases("collective"), indirect=True)
def test_collective_job(engine: Engine):
    ws = workspace(engine.tmp, {"train.py": DDP_PY})
    n, per = engine.trainers, engine.trainers_per_node
    res = engine.run(engine.job("ddp"), "--collective", "--job_dispatch_package", str(ws), timeout=240)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = {}
    for line in res.stdout.splitlines():
        m = RANK_LINE.search(line)
        if m:
            ranks[int(m.group(1))] = m.groups()[1:]
    assert sorted(ranks) == list(range(n)), res.stdout
    for r, (world, local, lws, group, total, step) in ranks.items():
        assert (int(world), int(local), int(lws), int(group)) == (n, r % per, per, r // per), (r, ranks[r])
        assert float(total) == n * (n - 1) / 2, ranks[r]  # every rank's number, all-reduced
        assert abs(float(step) - 0.4 * (n + 1)) < 1e-5, ranks[r]  # the mean of 2 * (rank + 1) over n ranks
    engine.assert_nothing_left()
    res = engine.run(engine.job("ddpfail"), "--collective", "--job_dispatch_package", str(ws), "--", "fail",
                     timeout=240)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "trainer.1" in res.stderr and "rank 1: out of data" in res.stderr, res.stderr[-3000:]
    engine.assert_nothing_left()
