"""``paddle-cluster top`` against real jobs: ``--json`` field by field on a local job, and the full-screen view
through a pseudo-terminal (pexpect) on the 3-host SSH cluster, as a person uses it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pexpect
import pytest
from helpers import OMIT, Launch, checkout_env, cli, conf, local_conf, no_traceback, wait_for

# Sync SGD on a dense vector and a sparse table, a metrics record per step; trainer SLOW (argv[2]) sleeps
# 0.1 s per step, so it is the one the others wait for. Ends after argv[1] steps, and not while the file named
# by argv[3], if given, exists.
TRAIN_PY = r'''
import os, sys, time
import numpy as np
from paddle_cluster.ps import OptimizerSpec, connect
from paddle_cluster.train.metrics import MetricsWriter
steps, slow, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1))
w = ps.register_dense({"w": np.zeros(20000, np.float32)})["w"]
ps.register_sparse("emb", 8, vocab_size=1000)
metrics = MetricsWriter()
print("training", flush=True)
while ps.step < steps or (hold and os.path.exists(hold[0])):
    ids = np.arange(ps.step % 50 * 20, ps.step % 50 * 20 + 20)
    rows = ps.pull_sparse("emb", ids)
    ps.push_sparse("emb", ids, np.ones_like(rows))
    w = ps.push_pull({"w": w - 1.0})["w"]
    if ps.trainer_id == slow:
        time.sleep(0.1)
    metrics.log(0, ps.step, loss=float(np.mean(w ** 2)), samples=32, accuracy=0.5)
ps.close()
print("done", flush=True)
'''


def _workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(TRAIN_PY)
    return ws


def _snapshot(conf_path: Path, env=None) -> dict:
    res = cli(conf_path, "top", "--json", timeout=60, env=env)
    no_traceback(res)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _trainers_moving(snap: dict) -> bool:
    """Both trainers stepping, and every process's CPU % known: the agent says it from its second look at a
    process, a second after the first, which may come after the trainers' first steps."""
    rows = [r for r in snap["rows"] if r["role"] == "trainer"]
    return (bool(rows) and all(r["state"] == "running" and r["steps_per_s"] for r in rows) and bool(snap["slowest"])
            and all(r["cpu"] is not None for r in snap["rows"]))


def test_top_json_on_a_local_job(tmp_path):
    """Every process with the figures of its kind, from where they are true: a pserver's rows and bytes held
    against its budget and its barrier waits, a trainer's step, loss, metrics and traffic, each one's CPU and
    RSS; the slowed trainer named the slowest; ``--once`` the same as a frame; the job untouched by it."""
    env = checkout_env()
    # PSERVERS/TRAINERS_PER_NODE: the built-in local cluster's two and two, with a conf so the job is this test's.
    cfg = local_conf(tmp_path, PSERVERS_PER_NODE=2, TRAINERS_PER_NODE=2)
    run = Launch(cfg, "--job_dispatch_package", str(_workspace(tmp_path)), "--", "100000", "1")
    try:
        run.wait_line(r"\[trainer\.1@node0\] training", 60)
        snap = wait_for(lambda: (lambda s: s if _trainers_moving(s) else None)(_snapshot(cfg, env)), 60,
                        "both trainers moving in top --json")
        assert snap["job"].startswith("JOB") and snap["outcome"] is None and snap["notes"] == []
        assert snap["age_s"] > 0 and snap["steps_per_s"] > 0 and snap["samples_per_s"] > 0
        assert snap["slowest"] == "trainer.1"
        rows = {r["name"]: r for r in snap["rows"]}
        assert sorted(rows) == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"]
        for r in rows.values():
            assert r["node"] == "node0" and r["host"] == "localhost" and r["state"] == "running"
            assert r["step"] > 0 and r["cpu"] is not None and r["rss"] > 10 << 20
            assert r["sent_per_s"] > 0 and r["received_per_s"] > 0 and not r["bad"] and not r["stalled"]
        for name in ("pserver.0", "pserver.1"):
            p = rows[name]
            assert p["rows"] > 0 and 0 < p["held"] < p["budget"]  # 1000 rows of 8 floats over 2 pservers
            assert p["wait_p50"] is not None and p["wait_p99"] >= p["wait_p50"] >= 0
        for name in ("trainer.0", "trainer.1"):
            t = rows[name]
            assert t["loss"] >= 0 and t["metrics"] == {"accuracy": 0.5} and t["samples_per_s"] > 0
            assert 0 <= t["ps_share"] <= 1 and t["held"] is None
        assert rows["trainer.1"]["ps_share"] < rows["trainer.0"]["ps_share"]  # the others wait for trainer 1

        # Sync: the job's rate is the one every trainer shares (their median), not their sum; samples/s the sum.
        rates = sorted(r["steps_per_s"] for r in snap["rows"] if r["role"] == "trainer")
        assert snap["rate"] == "sync" and snap["steps_per_s"] == rates[len(rates) // 2], snap
        assert snap["samples_per_s"] == pytest.approx(sum(rows[t]["samples_per_s"] for t in ("trainer.0",
                                                                                               "trainer.1")))

        res = cli(cfg, "top", "--once", timeout=60, env=env)
        no_traceback(res)
        assert res.returncode == 0, res.stderr
        assert "slowest trainer.1" in res.stdout and "held/budget" in res.stdout
        assert "steps/s (sync: every trainer's)" in res.stdout and "samples/s (sum)" in res.stdout
        assert all(name in res.stdout for name in rows)
        for rows_, cols in ((24, 80), (30, 100), (50, 160)):
            _frame_in_a_terminal(cfg, env, rows_, cols, rows)
        # The full-screen view in an 80x24 terminal: every process's node and name on its row, then q.
        view = pexpect.spawn(sys.executable, ["-m", "paddle_cluster", "--conf", str(cfg), "top"],
                             env={**env, "TERM": "xterm"}, dimensions=(24, 80), encoding="utf-8", timeout=60)
        for name in rows:
            view.expect(rf"node0 +{re.escape(name)} +running")
        view.send("q")
        view.expect(pexpect.EOF, timeout=15)
        view.close()
        assert view.exitstatus == 0, view.before
        assert run.proc.poll() is None  # reading the figures touches nothing of the job
    finally:
        cli(cfg, "kill", env=env)
        run.finish(60)


SGR = re.compile(r"\x1b\[[0-9;]*m")  # rich's colours and bold: what a terminal draws, not text


def _frame_in_a_terminal(cfg: Path, env: dict, rows: int, cols: int, procs: dict) -> None:
    """``top --once`` in a ``rows`` x ``cols`` terminal: no line wider than it, every process's node and process
    name whole on its row, numbers for reading (no ``e+``), the columns that did not fit named."""
    term = pexpect.spawn(sys.executable, ["-m", "paddle_cluster", "--conf", str(cfg), "top", "--once"],
                         env={**env, "TERM": "xterm"}, dimensions=(rows, cols), encoding="utf-8", timeout=60)
    term.expect(pexpect.EOF)
    term.close()
    lines = [SGR.sub("", line) for line in term.before.replace("\r\n", "\n").split("\n")]
    assert term.exitstatus == 0, "\n".join(lines)
    from rich.cells import cell_len
    drawn = [line for line in lines if not line.startswith("paddle-cluster: ")]  # the CLI's line naming the config
    assert all(cell_len(line) <= cols for line in drawn), "\n".join(lines)
    for name, r in procs.items():
        assert any(re.match(rf"{r['node']} +{re.escape(name)} +running", line) for line in lines), "\n".join(lines)
    assert "e+" not in "\n".join(lines)
    table = next(line for line in lines if line.startswith("node "))
    if cols >= 160:
        assert all(h in table for h in ("steps/s", "loss", "cpu%", "rss", "sent/s", "held/budget")), table
    if cols == 80:
        assert "wider for:" in "\n".join(lines) and "steps/s" in table and "loss" in table, table


# A collective trainer (no pservers) that writes what a hostile or broken job could: metric names with rich
# markup and terminal escapes (title, clear screen), a figures file with a string for its step and a list for its
# rows, a log line with escapes (trainer 1: a FIFO and /dev/zero where its figures and metrics go); then holds
# while the file argv[1] exists.
HOSTILE_PY = r'''
import json, os, sys, time
d, me = os.environ["PADDLE_JOB_DIR"], os.environ["PADDLE_TRAINER_ID"]
if me == "1":  # files that would hold a reader: a FIFO for its figures, /dev/zero for its metrics
    os.mkfifo(os.path.join(d, "log", "figures.trainer.1.json"))
    os.symlink("/dev/zero", os.path.join(d, "log", "metrics.trainer1.jsonl"))
    print("done", flush=True)
    while os.path.exists(sys.argv[1]):
        time.sleep(0.2)
    sys.exit(0)
with open(os.path.join(d, "log", f"metrics.trainer{me}.jsonl"), "a") as f:
    f.write(json.dumps({"step": 3, "loss": 0.5, "[link=https://example.com]x[/link]\x1b]0;owned\x07": 1,
                        "[blink]b\x1b[2J": 2}) + "\n")
with open(os.path.join(d, "log", f"figures.trainer.{me}.json"), "w") as f:
    json.dump({"step": "abc", "rows": [1], "held": {"x": 1}, "time": time.time()}, f)
print("[bold red]alert[/bold red] \x1b]0;owned\x07\x1b[2J done", flush=True)
while os.path.exists(sys.argv[1]):
    time.sleep(0.2)
'''


def test_what_a_job_writes_is_shown_as_text(tmp_path):
    """Markup in a metric name stays its characters, escape sequences are shown escaped, and a figures file with
    the wrong kinds is a row with those figures missing and a note naming them: in ``top --once``, ``top --json``
    and ``status`` (its last log line), never a crash or a sequence reaching the terminal."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(HOSTILE_PY)
    hold = tmp_path / "hold"
    hold.touch()
    # --collective: no pservers; two trainers, the second leaving a FIFO and /dev/zero where its files go.
    cfg = local_conf(tmp_path, PSERVERS_PER_NODE=0, PSERVER_COMMAND=OMIT, TRAINERS_PER_NODE=2)
    run = Launch(cfg, "--collective", "--job_dispatch_package", str(ws), "--", str(hold))
    try:
        run.wait_line(r"\[trainer\.0@node0\] .*done", 60)
        run.wait_line(r"\[trainer\.1@node0\] done", 60)
        once = cli(cfg, "top", "--once", timeout=60)
        no_traceback(once)
        assert once.returncode == 0, once.stderr
        assert "\x1b" not in once.stdout and "\\x1b]0;owned\\x07" in once.stdout, once.stdout
        assert "[link=https://example.com]x[/link]" in once.stdout and "[blink]b\\x1b[2J" in once.stdout
        assert 'figures step = "abc"' in once.stdout and "figures rows = [1]" in once.stdout, once.stdout
        snap = json.loads(cli(cfg, "top", "--json", timeout=60).stdout)
        assert next(r for r in snap["rows"] if r["name"] == "trainer.1")["state"] == "running"  # shown, not held
        row = next(r for r in snap["rows"] if r["name"] == "trainer.0")
        assert row["step"] == 3 and row["rows"] is None and row["held"] is None  # its metrics' step, nothing else
        assert row["malformed"] and any("figures held" in n for n in snap["notes"]), snap
        st = cli(cfg, "status", timeout=60)
        no_traceback(st)
        assert st.returncode == 0 and "\x1b" not in st.stdout, st.stdout
        assert "[bold red]alert[/bold red] \\x1b]0;owned\\x07\\x1b[2J done" in st.stdout.replace("\n", ""), st.stdout
    finally:
        hold.unlink()
        run.finish(60)


def test_the_jobs_step_rate_is_the_shared_one_in_sync_and_the_sum_in_async():
    """Six trainers at 3.3 steps/s each: a sync job steps at 3.3 (not 19.8); an async one at their sum, labelled."""
    from paddle_cluster.launch.top import RATE_LABEL, Row, job_rate

    def trainers(mode):
        return [Row("node0", "h", f"trainer.{k}", "trainer", "running", steps_per_s=3.3 + k / 100, mode=mode)
                for k in range(6)]
    assert job_rate(trainers("sync")) == (pytest.approx(3.33), "sync")
    assert job_rate(trainers("async")) == (pytest.approx(19.95), "async")
    assert job_rate(trainers(None)) == (pytest.approx(19.95), "sum")  # a client that does not say its mode
    assert RATE_LABEL["async"] == "steps/s (async: the trainers' sum)"


def test_top_of_a_job_that_never_ran(tmp_path):
    cfg = local_conf(tmp_path)
    res = cli(cfg, "top", "--json", "--job_name", "JOBNOSUCH")
    no_traceback(res)
    assert res.returncode != 0 and "JOBNOSUCH" in res.stderr and len(res.stderr.strip().splitlines()) <= 2


@pytest.mark.cluster
def test_top_view_on_three_hosts(cluster, tmp_path):
    """The view as a person uses it, on a real 3-host job: every process shown, the trainer slowed on purpose
    named the slowest, ``q`` leaves the view and the job runs on, and the job's end shows its outcome."""
    # conf(): the test hosts' interpreter and SSH keys; PSERVER_COMMAND left out as a user's conf.py does
    # (train.py does not serve: the built-in pserver).
    cfg = conf(tmp_path, cluster, PSERVER_COMMAND=OMIT, BARRIER_TIMEOUT=60.0)
    env = checkout_env(TERM="xterm")
    hold = tmp_path / "hold"  # the trainers step on while it exists (every host sees the test's tmp_path)
    hold.touch()
    run = Launch(cfg, "--job_dispatch_package", str(_workspace(tmp_path)), "--", "20", "1", str(hold))

    def spawn() -> pexpect.spawn:
        return pexpect.spawn(sys.executable, ["-m", "paddle_cluster", "--conf", str(cfg), "top"], env=env,
                             cwd=str(tmp_path), dimensions=(30, 200), encoding="utf-8", codec_errors="replace",
                             timeout=60)
    try:
        run.wait_line(r"\[trainer\.2@node2\] training", 90)
        view = spawn()
        for name in ("pserver.0", "pserver.1", "pserver.2", "trainer.0", "trainer.1", "trainer.2"):
            view.expect_exact(name)
        view.expect(r"slowest trainer\.1")
        view.send("q")
        view.expect(pexpect.EOF, timeout=15)
        view.close()
        assert view.exitstatus == 0, view.before
        assert run.proc.poll() is None and not run.find(r"\[trainer\.0@node0\] done")  # the job runs on

        view = spawn()
        view.expect_exact("trainer.2")
        hold.unlink()
        view.expect(r"finished \(exit 0\)", timeout=120)  # the job ends while it is watched
        view.send("q")
        view.expect(pexpect.EOF, timeout=15)
        view.close()
        assert view.exitstatus == 0
        assert run.finish(60) == 0
        assert run.find(r"\[trainer\.1@node1\] done")
    finally:
        if run.proc.poll() is None:
            cli(cfg, "kill")
        run.finish(60)
