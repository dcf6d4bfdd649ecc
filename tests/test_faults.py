"""Fault injection on the SSH test cluster (tests/sshcluster.py), one test per fault.

Each test ends with the outcome (recovered / failed cleanly), the final parameters where it recovered, and
zero processes left in every namespace. The workspace's train.py (helpers.TRAIN_PY) pushes a gradient of
ones with SGD lr=0.5 every step, so in sync mode the final parameters are exactly ``-0.5 * TOTAL`` whatever
was rolled back and replayed; trainer 0 checkpoints every EVERY steps. Timings are printed (``pytest -s``) for
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    EVERY,
    ROOT,
    TOTAL,
    Launch,
    assert_nothing_left,
    cli,
    conf,
    final_w,
    local_conf,
    proc_pid,
    wait_for,
    workspace,
)

# A pserver that, when SLOW_SAVE_STEP is its checkpoint's step, writes half the shard file and then stalls,
# so a test can SIGKILL it in the middle of the write.
SLOW_PS_PY = r'''
import os, sys, time
from paddle_cluster.ps import atomic
from paddle_cluster.ps import __main__ as pserver
real = atomic.write_atomic
def write_atomic(path, write):
    stall = os.environ.get("SLOW_SAVE_STEP")
    if stall and f"step-{int(stall):08d}" in path and path.endswith("shard.npz"):
        def slow(f):
            write(f)
            f.flush()
            f.truncate(f.tell() // 2)
            print(f"WRITING {path}", flush=True)
            time.sleep(3600)
        return real(path, slow)
    return real(path, write)
atomic.write_atomic = write_atomic
sys.exit(pserver.main())
'''


def report(row: str, outcome: str, **facts) -> None:
    print(f"\nFAULT {row}: {outcome}; " + ", ".join(f"{k}={v}" for k, v in facts.items()))


def _run_args(ws: Path, job: str, *extra: str, mode: str = "sync", total: int = TOTAL, every: int = EVERY):
    return ("--job_dispatch_package", str(ws), "--job_name", job, *extra, "--", str(total), str(every), mode)


@pytest.mark.timeout(120)
def test_sigkill_pserver_restarts_from_checkpoint(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_kill_ps", "--max_restarts", "2"))
    run.wait_line(r"checkpoint step=20")
    pid = proc_pid(cluster, 1, "f_kill_ps", "pserver.1")
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    t_det, line = run.wait_line(r"restarting the job from", 30)
    assert re.search(rf"pserver\.1 on node1 \({cluster.hosts[1]}\) killed by SIGKILL; restarting the job from "
                     r"checkpoint step (20|30) \(restart 1 of 2\)", line), line
    step = int(re.search(r"step (\d+)", line).group(1))
    t_back, _ = run.wait_line(rf"\[trainer\.0@node0\] start step={step} w0={-0.5 * step:g}$", 60, after=t_det)
    assert run.finish(120) == 0, run.text()[-3000:]
    assert "finished: all 3 trainer(s) exited 0 after 1 restart(s)" in run.stderr
    w = final_w(run)
    assert w == -0.5 * TOTAL
    run.assert_no_launcher_traceback()
    assert_nothing_left(cluster)
    report("SIGKILL pserver", "recovered", resumed_step=step, detect_s=f"{t_det - t_kill:.1f}",
           recover_s=f"{t_back - t_kill:.1f}", final_w=w)


@pytest.mark.timeout(120)
def test_sigkill_pserver_without_restarts_fails_fast(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_kill_ps0"))
    run.wait_line(r"checkpoint step=10")
    os.kill(proc_pid(cluster, 2, "f_kill_ps0", "pserver.2"), signal.SIGKILL)
    t_kill = time.monotonic()
    assert run.finish(60) == 1
    took = time.monotonic() - t_kill
    assert f"pserver.2 on node2 ({cluster.hosts[2]}) killed by SIGKILL while trainers were still running" \
        in run.stderr, run.stderr
    assert_nothing_left(cluster)
    report("SIGKILL pserver, no --max_restarts", "failed cleanly", exit_s=f"{took:.1f}")


@pytest.mark.timeout(120)
def test_sigkill_trainer_restarts_from_checkpoint(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_kill_tr", "--max_restarts", "1"))
    run.wait_line(r"checkpoint step=20")
    os.kill(proc_pid(cluster, 2, "f_kill_tr", "trainer.2"), signal.SIGKILL)
    t_kill = time.monotonic()
    t_det, line = run.wait_line(r"restarting the job from", 30)
    assert f"trainer.2 on node2 ({cluster.hosts[2]}) killed by SIGKILL; restarting the job from checkpoint" in line
    step = int(re.search(r"checkpoint step (\d+)", line).group(1))
    t_back, _ = run.wait_line(rf"\[trainer\.2@node2\] start step={step} ", 60, after=t_det)
    assert run.finish(120) == 0, run.text()[-3000:]
    w = final_w(run)
    assert w == -0.5 * TOTAL
    assert_nothing_left(cluster)
    report("SIGKILL trainer", "recovered", resumed_step=step, detect_s=f"{t_det - t_kill:.1f}",
           recover_s=f"{t_back - t_kill:.1f}", final_w=w)


@pytest.mark.timeout(120)
def test_sigkill_trainer_elastic_async_continues(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_elastic", "--elastic", mode="async"))
    run.wait_line(r"\[trainer\.0@node0\] checkpoint step=20")
    os.kill(proc_pid(cluster, 1, "f_elastic", "trainer.1"), signal.SIGKILL)
    t_kill = time.monotonic()
    t_det, line = run.wait_line(r"--elastic: continuing", 30)
    assert f"trainer.1 on node1 ({cluster.hosts[1]}) killed by SIGKILL; --elastic: continuing with the other 2 " \
        "trainer(s)" in line
    assert run.finish(120) == 0, run.text()[-3000:]
    assert "finished: all 2 remaining trainer(s) exited 0" in run.stderr
    ends = sorted((run.find(rf"\[trainer\.{t}@node{t}\] end step={TOTAL} ") for t in (0, 2)), key=lambda e: e[0])
    w = float(re.search(r"w0=(\S+)", ends[-1][1]).group(1))
    # Async: every push is applied; the last trainer to finish sees both survivors' pushes and some of the dead one's.
    assert -0.5 * 3 * TOTAL < w <= -0.5 * 2 * TOTAL, w
    assert_nothing_left(cluster)
    report("SIGKILL trainer, async --elastic", "continued with 2 trainers", detect_s=f"{t_det - t_kill:.1f}",
           final_w=w)


@pytest.mark.timeout(150)
def test_sigstop_pserver_is_a_hang_that_times_out_and_restarts(cluster, tmp_path):
    run = Launch(conf(tmp_path, cluster), *_run_args(workspace(tmp_path), "f_stop_ps", "--max_restarts", "1"))
    run.wait_line(r"checkpoint step=20")
    pid = proc_pid(cluster, 1, "f_stop_ps", "pserver.1")
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        t_det, line = run.wait_line(r"restarting the job from", 60)
        # The client's reply timeout: BARRIER_TIMEOUT 5 + 10 s margin (or the sync barrier on another pserver).
        assert "restarting the job from checkpoint step" in line, line
        assert re.search(r"ConnectionLost|BarrierTimeout|no answer", run.stderr + run.stdout)
        step = int(re.search(r"checkpoint step (\d+)", line).group(1))
        t_back, _ = run.wait_line(rf"\[trainer\.0@node0\] start step={step} ", 60, after=t_det)
        assert run.finish(120) == 0, run.text()[-3000:]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    w = final_w(run)
    assert w == -0.5 * TOTAL
    assert_nothing_left(cluster)
    report("SIGSTOP pserver", "recovered", resumed_step=step, detect_s=f"{t_det - t_stop:.1f}",
           recover_s=f"{t_back - t_stop:.1f}", final_w=w)


@pytest.mark.timeout(150)
def test_link_down_fails_cleanly_and_leaves_nothing(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(3)
    conf_path = conf(tmp_path, c)
    run = Launch(conf_path, *_run_args(workspace(tmp_path), "f_link", total=100000))
    run.wait_line(r"checkpoint step=10")
    c.link_down(2)
    t_down = time.monotonic()
    try:
        rc = run.finish(5 + 10)  # ORPHAN_TIMEOUT + teardown
        t_exit = time.monotonic()
        assert rc == 4, run.text()[-3000:]  # lost contact: its own exit status
        assert f"lost contact with node2 ({c.hosts[2]})" in run.stderr, run.stderr
        assert not c.pids(0) and not c.pids(1), "processes left on the reachable nodes"
        # Cut off, node2's agent stops its processes after ORPHAN_TIMEOUT of silence.
        wait_for(lambda: not c.pids(2), 5 + 1 + 10, "node2's processes to stop while cut off")
        t_clean = time.monotonic()
    finally:
        c.link_up(2)
    # The launcher has exited and every node is empty, so nothing is left that the network's return could wake.
    assert_nothing_left(c, within=5)
    run.assert_no_launcher_traceback()
    said = re.search(r"^paddle-cluster: error: (lost contact with node2 .*)$", run.stderr, re.M).group(1)
    st = cli(conf_path, "status", "--job_name", "f_link")  # shows the outcome run printed
    assert st.returncode == 0 and st.stdout.startswith("job f_link: lost contact with a node (exit 4)"), st.stdout
    assert said in st.stdout, (said, st.stdout)
    report("link down on node2, then up", "failed cleanly", launcher_exit_s=f"{t_exit - t_down:.1f}",
           node2_clean_s=f"{t_clean - t_down:.1f}")


@pytest.mark.timeout(150)
def test_sigkill_launcher_then_resume(cluster, tmp_path):
    cfg = conf(tmp_path, cluster)
    ws = workspace(tmp_path)
    run = Launch(cfg, *_run_args(ws, "f_launcher", total=100000))
    run.wait_line(r"checkpoint step=20")
    run.proc.kill()
    t_kill = time.monotonic()
    run.finish(10)
    assert_nothing_left(cluster, within=5 + 1 + 10)
    t_clean = time.monotonic()
    # Every node's agent stopped the job; its checkpoints remain, and a new job continues from them.
    again = Launch(cfg, *_run_args(ws, "f_launcher2", "--resume_from", "f_launcher"))
    assert again.finish(120) == 0, again.text()[-3000:]
    start = again.find(r"\[trainer\.0@node0\] start step=(\d+)")
    resumed = int(re.search(r"step=(\d+)", start[1]).group(1))
    assert resumed >= 20 and resumed % EVERY == 0
    w = final_w(again)
    assert w == -0.5 * TOTAL
    assert_nothing_left(cluster)
    report("SIGKILL launcher", "failed cleanly; resumed by a second run", clean_s=f"{t_clean - t_kill:.1f}",
           resumed_step=resumed, final_w=w)


@pytest.mark.timeout(150)
def test_kill_during_checkpoint_write_uses_previous_checkpoint(cluster, tmp_path):
    # PSERVER_COMMAND: a pserver whose checkpoint write at step 30 is slow, so the kill lands mid-write.
    cfg = conf(tmp_path, cluster, PSERVER_COMMAND="{python} slow_ps.py", ENV={"SLOW_SAVE_STEP": "30"})
    ws = workspace(tmp_path)
    (ws / "slow_ps.py").write_text(SLOW_PS_PY.replace('stall = os.environ.get("SLOW_SAVE_STEP")',
                                                      'stall = os.environ.get("SLOW_SAVE_STEP") if os.environ['
                                                      '"PADDLE_PSERVER_ID"] == "1" and not os.environ.get('
                                                      '"PADDLE_RESUME") else None'))
    run = Launch(cfg, *_run_args(ws, "f_ckpt", "--max_restarts", "1"))
    run.wait_line(r"\[pserver\.1@node1\] WRITING .*step-00000030", 60)
    os.kill(proc_pid(cluster, 1, "f_ckpt", "pserver.1"), signal.SIGKILL)
    t_kill = time.monotonic()
    t_det, line = run.wait_line(r"restarting the job from", 30)
    # The other pservers finished step 30; pserver 1 did not: every shard rolls back to step 20.
    assert "restarting the job from checkpoint step 20 (restart 1 of 1)" in line, line
    shard = cluster.root_dir(1) / "f_ckpt/checkpoints/step-00000030/pserver-1"
    assert not (shard / "manifest.json").exists()
    assert (cluster.root_dir(0) / "f_ckpt/checkpoints/step-00000030/pserver-0/manifest.json").exists()
    t_back, _ = run.wait_line(r"\[trainer\.0@node0\] start step=20 w0=-10$", 60, after=t_det)
    assert run.finish(120) == 0, run.text()[-3000:]
    w = final_w(run)
    assert w == -0.5 * TOTAL
    assert (shard / "manifest.json").exists()  # step 30 written again, completely, after the restart
    assert_nothing_left(cluster)
    report("SIGKILL pserver mid checkpoint write", "recovered from the previous checkpoint", resumed_step=20,
           detect_s=f"{t_det - t_kill:.1f}", recover_s=f"{t_back - t_kill:.1f}", final_w=w)


@pytest.mark.timeout(180)
def test_disk_full_on_one_node(make_ssh_cluster, tmp_path):
    c = make_ssh_cluster(2)
    c.exec(1, ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", ROOT])
    try:
        cfg = conf(tmp_path, c, ENV={"STEP_DELAY": "0.2", "PARAM_SIZE": "400000"})
        ws = workspace(tmp_path)
        (ws / "data.bin").write_bytes(os.urandom(2 << 20))  # cached on the nodes by the first job
        run = Launch(cfg, *_run_args(ws, "f_disk", "--max_restarts", "1", total=40))
        run.wait_line(r"checkpoint step=10", 60)
        free = int(c.exec(1, ["df", "-B1", "--output=avail", ROOT]).stdout.split()[-1])
        c.exec(1, ["dd", "if=/dev/zero", f"of={ROOT}/filler", "bs=4096", f"count={(free - 256 * 1024) // 4096}"],
               check=False)
        t_fill = time.monotonic()
        t_det, line = run.wait_line(r"restarting the job from", 60)
        assert "restarting the job from checkpoint step 10" in line, line
        assert "No space left on device" in line, line  # trainer 0's last words: pserver 1's CheckpointError
        c.exec(1, ["rm", "-f", f"{ROOT}/filler"])
        t_back, _ = run.wait_line(r"\[trainer\.0@node0\] start step=10 ", 60, after=t_det)
        assert run.finish(120) == 0, run.text()[-3000:]
        w = final_w(run, trainers=2)
        assert w == -0.5 * 40
        assert_nothing_left(c)

        # The cached workspace on a full disk: its job directory is hard links into the node's cache and needs
        # no space, so the job starts; the first checkpoint then fails there, named.
        free = int(c.exec(1, ["df", "-B1", "--output=avail", ROOT]).stdout.split()[-1])
        c.exec(1, ["dd", "if=/dev/zero", f"of={ROOT}/filler", "bs=4096", f"count={(free - 64 * 1024) // 4096}"],
               check=False)
        full = Launch(cfg, *_run_args(ws, "f_disk2"))
        assert full.finish(60) == 1
        assert "node0, node1 already held this package: not sent again" in full.stderr, full.stderr
        assert "No space left on device" in full.stderr, full.stderr
        full.assert_no_launcher_traceback()
        # A new workspace that does not fit: the preflight refuses before it is sent, naming host and fix.
        (ws / "more.bin").write_bytes(os.urandom(1 << 20))
        new = Launch(cfg, *_run_args(ws, "f_disk2b"))
        assert new.finish(60) == 1
        assert re.search(rf"node1 \({re.escape(c.hosts[1])}\): ROOT_DIR {ROOT} has 0\.\d MB free, the workspace "
                         r"needs \d+\.\d MB \(unpacked\); free space there or set ROOT_DIR", new.stderr), \
            new.stderr
        assert c.exec(1, ["test", "-e", f"{ROOT}/f_disk2b"], check=False).returncode != 0  # nothing started there
        new.assert_no_launcher_traceback()
        # Completely full: the preflight already refuses, naming the host and the cause.
        c.exec(1, ["dd", "if=/dev/zero", f"of={ROOT}/filler2", "bs=4096"], check=False)
        fuller = Launch(cfg, *_run_args(ws, "f_disk3"))
        assert fuller.finish(60) == 1
        assert f"node1 ({c.hosts[1]}): ROOT_DIR {ROOT} is not writable: No space left on device" in fuller.stderr
        assert_nothing_left(c)
    finally:
        c.exec(1, ["umount", "-l", ROOT], check=False)
    report("disk full on node1's ROOT_DIR", "recovered after space returned; unpack refused with ENOSPC, a new "
           "workspace by the preflight",
           detect_s=f"{t_det - t_fill:.1f} (from the fill; the next checkpoint is 2 s later)",
           recover_s=f"{t_back - t_fill:.1f}", final_w=w)


@pytest.mark.timeout(150)
def test_second_job_on_the_same_ports_is_refused(cluster, tmp_path):
    hold = tmp_path / "hold"  # the first job waits at step 10 until the second was refused, however slow
    hold.touch()
    cfg = conf(tmp_path, cluster, ENV={"HOLD_FILE": str(hold)})
    ws = workspace(tmp_path)
    first = Launch(cfg, *_run_args(ws, "f_ports1"))
    first.wait_line(r"checkpoint step=10", 60)
    second = Launch(cfg, *_run_args(ws, "f_ports2"))
    assert second.finish(60) == 1
    hold.unlink()
    for i in range(3):
        assert f"node{i} ({cluster.hosts[i]}): port(s) 7164 on {cluster.ips[i]} are already in use" in second.stderr
    assert not (cluster.root_dir(0) / "f_ports2" / "log").exists()  # refused before anything started
    assert first.finish(120) == 0, first.text()[-3000:]
    w = final_w(first)
    assert w == -0.5 * TOTAL
    assert_nothing_left(cluster)
    report("second job on the same ports", "refused by the preflight; first job unaffected", final_w=w)


LOAD_PY = r'''
import json, sys
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
steps, vocab = int(sys.argv[1]), int(sys.argv[2])
ps = connect(mode="async", optimizer=OptimizerSpec("sgd", lr=0.5))
tid = ps.trainer_id
ps.register_dense({"w": np.zeros((256, 64), np.float32)})
ps.register_sparse("emb", 16, vocab_size=vocab, init_scale=0.0)
g = {"w": np.ones((256, 64), np.float32)}
rows = np.full((4, 16), -2.0, np.float32)  # lr 0.5: +1 per push of an id
for s in range(steps):
    ids = np.array([s, s + 1, 7 * s + tid, 13 * s + 3 * tid]) % vocab
    ps.pull_sparse("emb", ids)
    ps.push_sparse("emb", ids, rows)
    ps.pull()
    ps.push(g)
    if s % (steps // 4) == 0:
        print(f"progress {s}", flush=True)
ps.wait()
if tid == 0:
    assert ps.wait_others_closed(60), "the other trainers did not close"
    w = ps.pull()["w"]
    emb = ps.pull_sparse("emb", np.arange(vocab))
    print("FINAL " + json.dumps({"w": float(w[0, 0]), "w_equal": bool((w == w[0, 0]).all()),
                                 "rows_equal": bool((emb == emb[:, :1]).all()),
                                 "counts": emb[:, 0].astype(int).tolist()}), flush=True)
ps.close()
'''


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.timeout(120)
def test_load_8_trainers_4_pservers_sparse(tmp_path):
    steps, vocab = 2000, 5000
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(LOAD_PY)
    root = tmp_path / "root"
    cfg = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=4,
                     TRAINERS_PER_NODE=8, KILL_GRACE=1.0, BARRIER_TIMEOUT=20.0)
    t0 = time.monotonic()
    run = Launch(cfg, "--job_dispatch_package", str(ws), "--job_name", "load", "--", str(steps), str(vocab))
    procs = root / "load" / ".paddle_cluster" / "procs.json"
    run.wait_line(rf"\[trainer\.0@node0\] progress {steps // 4}$", 90)
    pids = [p["pid"] for p in json.loads(procs.read_text())["procs"] if p["role"] == "PSERVER"]
    early = [_rss_kb(p) for p in pids]
    run.wait_line(rf"\[trainer\.0@node0\] progress {3 * steps // 4}$", 90)
    late = [_rss_kb(p) for p in pids]
    assert run.finish(90) == 0, run.text()[-3000:]
    took = time.monotonic() - t0
    final = json.loads(run.find(r"\[trainer\.0@node0\] FINAL ")[1].split("FINAL ", 1)[1])
    # No request lost: every dense push (8 x steps, lr 0.5) and every sparse row push is in the values.
    assert final["w"] == -0.5 * 8 * steps and final["w_equal"] and final["rows_equal"]
    want = [0] * vocab
    for tid in range(8):
        for s in range(steps):
            for i in (s, s + 1, 7 * s + tid, 13 * s + 3 * tid):
                want[i % vocab] += 1
    assert final["counts"] == want
    growth = [b - a for a, b in zip(early, late)]
    assert max(growth) < 8 * 1024, f"pserver RSS grew by {growth} kB between 25% and 75% of the run"
    report("load 8 trainers x 4 pservers, sparse", "ok", steps=steps, seconds=f"{took:.1f}",
           pserver_rss_kb=early, rss_growth_kb=growth, requests=8 * steps * 4)


FILL_THEN_PRINT = r'''
import os
fd = os.open("filler", os.O_WRONLY | os.O_CREAT)
for chunk in (1 << 16, 1 << 12):
    try:
        while True:
            os.write(fd, b"x" * chunk)
    except OSError:
        pass
for i in range(20000):
    print(f"line {i} " + "x" * 100)
print("DONE")
'''


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs as ROOT_DIR")
def test_logs_on_a_full_disk_do_not_hang_the_job(tmp_path):
    """Found by the disk-full row: a log write failing with ENOSPC used to kill the agent's output pump, so the
    trainer blocked on a full pipe and its exit was never reported: the job hung forever."""
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], check=True)
    try:
        ws = tmp_path / "ws"
        ws.mkdir()
        # The trainer fills ROOT_DIR itself (whatever the node library and workspace took), then talks.
        (ws / "train.py").write_text(FILL_THEN_PRINT)
        cfg = local_conf(tmp_path, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=0, PSERVERS_PER_NODE=1,
                         TRAINERS_PER_NODE=1, KILL_GRACE=1.0)
        run = Launch(cfg, "--job_dispatch_package", str(ws), "--job_name", "full")
        assert run.finish(60) == 0, run.text()[-2000:]
        assert run.find(r"\[trainer\.0@node0\] DONE$")
        assert run.find(r"\[agent@node0\] cannot write .*train\.log \(No space left on device\)")
        assert "finished: all 1 trainer(s) exited 0" in run.stderr
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
    report("disk full under the logs", "job finished; output streamed, log file given up")
