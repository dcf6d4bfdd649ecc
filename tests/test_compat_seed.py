"""Seed 003's dist_train.py, its two import lines replaced and nothing else, as 1 pserver + 2 trainers: real
processes, real TCP, the launcher's environment contract, the dataset in Paddle's cache under $HOME. Also: the same
network trained in one process gives the same losses, and a sparse (distributed) embedding over 2 pservers
matches its single-process run."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from helpers import HOUSING, SEEDS, losses, ported
from rt_helpers import make_env, proc_env, procs, wait_all

from paddle_cluster.contract import PSERVER, TRAINER

REPO = Path(__file__).resolve().parent.parent
# Python's random module seeded, then the script run unchanged: paddle.reader.shuffle draws the same order.
SEEDED = "import random, runpy, sys; random.seed(0); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
         "run_name='__main__')"


def workspace(tmp_path: Path) -> tuple:
    ws, home = tmp_path / "ws", tmp_path / "home"
    (home / ".cache" / "paddle" / "dataset" / "uci_housing").mkdir(parents=True)
    (home / ".cache" / "paddle" / "dataset" / "uci_housing" / "housing.data").write_bytes(HOUSING.read_bytes())
    ws.mkdir()
    return ws, {"HOME": str(home)}


def run_job(tmp_path, script: Path, n_pservers: int, trainers: int, seeded: bool, extra: dict, timeout=240.0):
    """Pservers and trainers all run ``script`` (cwd: its directory); returns each trainer's stdout."""
    env = make_env(n_pservers, trainers, tmp_path / "job")
    (tmp_path / "job").mkdir(exist_ok=True)
    argv = [sys.executable, "-c", SEEDED, str(script)] if seeded else [sys.executable, str(script)]
    with procs(tmp_path) as ps:
        servers = [ps.start(argv, {**proc_env(env, PSERVER, k, extra)}, f"pserver{k}") for k in range(n_pservers)]
        for k, p in enumerate(servers):
            line = p.stdout.readline().decode()
            assert line.startswith("PSERVER_READY"), f"pserver {k}: {line!r}\n{ps.log(p)}"
        workers = [ps.start(argv, proc_env(env, TRAINER, i, extra), f"trainer{i}") for i in range(trainers)]
        codes = wait_all(ps, workers, timeout)
        outs = [p.stdout.read().decode() for p in workers]
        assert codes == [0] * trainers, [ps.log(p) for p in workers]
        assert wait_all(ps, servers, 30) == [0] * n_pservers  # they end by themselves once every trainer closed
    return outs


def run_local(tmp_path, script: Path, extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update(extra, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", SEEDED, str(script)], env=env, cwd=script.parent, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_seed_dist_train_1_pserver_2_trainers_loss_falls(tmp_path):
    ws, extra = workspace(tmp_path)
    script = ported(SEEDS / "dist_train.py", ws / "dist_train.py")
    outs = run_job(tmp_path, script, 1, 2, seeded=False, extra=extra)
    for out in outs:
        got = losses(out)
        assert [(e, b) for e, b, _ in got] == [(e, b) for e in range(30) for b in (9, 19, 29, 39, 49)]
        first = sum(v for e, _, v in got if e == 0) / 5
        # The median of the last 5 epochs' printed batches: one epoch's 5 shuffled batches vary by tens.
        last = statistics.median(v for e, _, v in got if e >= 25)
        assert first > 300 and last < first / 4, (first, last)  # as in the quick start: ~600 down to tens


def test_distributed_run_matches_the_single_process_run(tmp_path):
    """Both trainers shuffle alike (random.seed(0)), so each sync step averages two equal gradients: exactly the
    single-process step. The printed losses must be identical."""
    ws, extra = workspace(tmp_path)
    dist = run_job(tmp_path, ported(SEEDS / "dist_train.py", ws / "dist_train.py"), 1, 2, seeded=True, extra=extra)
    local = run_local(tmp_path, ported(SEEDS / "fit_a_line_local.py", ws / "local.py"), extra)
    assert len(losses(local)) == 150
    assert losses(dist[0]) == losses(dist[1]) == losses(local)
    assert sorted(os.listdir(ws / "output" / "pass-00029")) == ["__model__.json", "params.npz"]


SPARSE = '''
import os
import numpy as np
import paddle_cluster.compat.paddle as paddle
import paddle_cluster.compat.paddle.fluid as fluid

V, D = 300, 8
words = [fluid.layers.data(name="w%d" % i, shape=[1], dtype="int64") for i in range(3)]
embs = [fluid.layers.embedding(input=w, size=[V, D], is_distributed=True, param_attr="emb") for w in words[:2]]
hidden = fluid.layers.fc(input=fluid.layers.concat(input=embs, axis=1), size=16, act="tanh")
predict = fluid.layers.fc(input=hidden, size=V, act="softmax")
avg_cost = fluid.layers.mean(fluid.layers.cross_entropy(input=predict, label=words[2]))
fluid.optimizer.Adagrad(learning_rate=0.2).minimize(avg_cost)
rng = np.random.RandomState(4)
data = [(a, b, (a * 7 + b) % V) for a, b in rng.randint(0, V, size=(640, 2))]
reader = paddle.batch(paddle.reader.shuffle(lambda: iter(data), buf_size=200), batch_size=32)
exe, feeder = fluid.Executor(fluid.CPUPlace()), fluid.DataFeeder(feed_list=words, place=fluid.CPUPlace())
role = os.getenv("PADDLE_TRAINING_ROLE")
prog = fluid.default_main_program()
if role:
    t = fluid.DistributeTranspiler()
    # pservers and trainers from the launcher's contract
    t.transpile(trainer_id=int(os.getenv("PADDLE_TRAINER_ID", "0")), sync_mode=os.getenv("MODE") != "async")
    if role == "PSERVER":
        exe.run(t.get_pserver_program(os.getenv("PADDLE_CURRENT_ENDPOINT")))
        raise SystemExit(0)
    prog = t.get_trainer_program()
exe.run(fluid.default_startup_program())
for epoch in range(4):
    for batch_id, batch in enumerate(reader()):
        cost, = exe.run(prog, feed=feeder.feed(batch), fetch_list=[avg_cost])
        print("Epoch: %d, Batch: %d, loss: %r" % (epoch, batch_id, float(cost[0])))
exe.close()
'''


def test_distributed_sparse_embedding_over_2_pservers_matches_single_process(tmp_path):
    script = tmp_path / "sparse.py"
    script.write_text(SPARSE)
    dist = run_job(tmp_path, script, 2, 2, seeded=True, extra={})
    local = run_local(tmp_path, script, {})
    got = losses(local)
    assert len(got) == 80 and got[-1][2] < got[0][2] * 0.9
    for out in dist:
        assert [v for *_, v in losses(out)] == [v for *_, v in got]


def test_async_mode_trains_the_distributed_embedding(tmp_path):
    script = tmp_path / "sparse.py"
    script.write_text(SPARSE)
    for out in run_job(tmp_path, script, 2, 2, seeded=False, extra={"MODE": "async"}):
        got = [v for *_, v in losses(out)]
        assert len(got) == 80 and sum(got[-10:]) < 0.8 * sum(got[:10]), got
