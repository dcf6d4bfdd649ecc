"""PaddlePaddle users' files run by `paddle-cluster run` as they are: seed 003's dist_train.py (two import lines
changed) with `--entry dist_train.py` on the local layout and on 3 SSH hosts, pservers running the script too;
seed 000's word2vec workspace (train.py, mylib.py, word_dict.pickle, train.list/test.list, SPLIT_COUNT shards)
with its v2 options, from --job_workspace. Real processes, real TCP, the real CLI."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from helpers import (
    HOUSING,
    OMIT,
    SEEDS,
    assert_nothing_left,
    cli,
    dataset_dir,
    local_conf,
    no_traceback,
    ported,
    write_conf,
)

PTB = dataset_dir("ptb", var="PTB_DIR")
ROLE_NOTE = "pservers run dist_train.py as PADDLE_TRAINING_ROLE=PSERVER"


def data_home(tmp: Path) -> Path:
    """Paddle's dataset cache with uci_housing in it (the processes find it through PADDLE_DATA_HOME): every 10th
    row (51, 5 batches an epoch; each column still varies, as its normalisation needs). That the seed's loss falls
    over the whole data is the conformance suite's concurrent scenario (test_conformance_jobs.py, every engine);
    here, what the run leaves on each node."""
    d = tmp / "data_home"
    (d / "uci_housing").mkdir(parents=True, exist_ok=True)
    rows = HOUSING.read_text().splitlines(keepends=True)[::10]
    (d / "uci_housing" / "housing.data").write_text("".join(rows))
    return d


def seed_workspace(tmp: Path) -> Path:
    ws = tmp / "ws"
    ws.mkdir()
    ported(SEEDS / "dist_train.py", ws / "dist_train.py")
    return ws


def local_default(tmp: Path, **extra) -> Path:
    """The built-in local default (2 pservers + 2 trainers on loopback) on free ports."""
    return local_conf(tmp, PADDLE_PORTS_NUM=1, PADDLE_PORTS_NUM_FOR_SPARSE=1, PSERVERS_PER_NODE=2,
                      TRAINERS_PER_NODE=2, **extra)


def pserver_cmds(job_dir: Path):
    recs = json.loads((job_dir / ".paddle_cluster" / "procs.json").read_text())["procs"]
    return [r["cmd"] for r in recs if r["role"] == "PSERVER"]


def test_seed_dist_train_local_default_layout(tmp_path):
    ws = seed_workspace(tmp_path)
    conf = local_default(tmp_path, ENV={"PADDLE_DATA_HOME": str(data_home(tmp_path))})
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--entry", "dist_train.py", "--job_name", "seed",
              timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first_lines = res.stderr.splitlines()[:3]
    assert any(ROLE_NOTE in line for line in first_lines), first_lines
    job = tmp_path / "root" / "seed"
    assert [c.split()[-1] for c in pserver_cmds(job)] == ["dist_train.py", "dist_train.py"]
    # each pserver on its own loopback address, as PADDLE_PSERVER_IPS x PADDLE_PSERVER_PORT says
    # (the pservers' INFO "listening" lines stay in their logs without --verbose; their ready lines are shown)
    assert "PSERVER_READY 0 127.0.0.1 " in res.stdout and "PSERVER_READY 1 127.0.0.2 " in res.stdout
    assert (job / "nodefile").read_text() == "0\n"
    for info, log in (("paddle_trainer.0.INFO", "train.0.log"), ("paddle_pserver2.1.INFO", "server.1.log")):
        assert os.readlink(job / "log" / info) == log and "PSERVER_READY" in (job / "log" / "server.1.log").read_text()
    no_traceback(res)


def test_seed_dist_train_on_three_ssh_hosts(ssh_cluster, tmp_path):
    ws = seed_workspace(tmp_path)
    # No PSERVER_COMMAND (write_conf's stand-in pserver left out): pservers run the seed's script, chosen by it.
    conf = write_conf(tmp_path, ssh_cluster, PSERVER_COMMAND=OMIT,
                      ENV={"PADDLE_DATA_HOME": str(data_home(tmp_path))})
    try:
        res = cli(conf, "run", "--job_dispatch_package", str(ws), "--entry", "dist_train.py", "--job_name", "seed3",
                  timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert ROLE_NOTE in res.stderr
        for i in range(3):
            job = ssh_cluster.root_dir(i) / "seed3"
            assert pserver_cmds(job) == [f"{ssh_cluster.python} dist_train.py"]
            assert (job / "nodefile").read_text() == f"{i}\n"
            assert os.readlink(job / "log" / "paddle_pserver2.INFO") == "server.log"
            assert f"listening on {ssh_cluster.ips[i]} " in (job / "log" / "server.log").read_text()
        no_traceback(res)
    finally:
        for i in range(len(ssh_cluster.hosts)):
            ssh_cluster.kill_all(i)
    assert_nothing_left(ssh_cluster)


def test_same_machine_twice_is_refused_by_check_and_run(ssh_cluster, tmp_path):
    user, ip = ssh_cluster.hosts[0].split("@")[0], ssh_cluster.ips[0]
    hosts = [ssh_cluster.hosts[0], ssh_cluster.hosts[1], f"{user}@{ip}:22"]
    conf = write_conf(tmp_path, ssh_cluster, hosts=hosts)
    chk = cli(conf, "check")
    assert chk.returncode != 0
    assert f"node0 ({hosts[0]}) and node2 ({hosts[2]}) are the same machine" in chk.stdout + chk.stderr
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('never runs')\n")
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "twice")
    assert res.returncode == 2 and "are the same machine" in res.stderr and "never runs" not in res.stdout
    assert not (ssh_cluster.root_dir(0) / "twice").exists()
    no_traceback(res)


# -- seed 000: the word2vec workspace ----------------------------------------------------------------------
SPLIT_COUNT = 2


def word2vec_workspace(tmp: Path) -> Path:
    """What seed 000's prepare.py leaves: word_dict.pickle, the training text split into SPLIT_COUNT files,
    train.list / test.list, beside train.py and mylib.py (a slice of PTB keeps it quick)."""
    ws = tmp / "word2vec"
    (ws / "data").mkdir(parents=True)
    for name in ("train.py", "mylib.py"):
        shutil.copy(SEEDS / "word2vec" / name, ws / name)
    train = (PTB / "ptb.train.txt").read_text().splitlines()[:600]
    test = (PTB / "ptb.test.txt").read_text().splitlines()[:100]
    counts = Counter(w for line in train for w in line.split())
    words = ["<s>", "<e>"] + sorted(w for w, c in counts.items() if c >= 3 and w != "<unk>")
    with open(ws / "word_dict.pickle", "wb") as f:
        pickle.dump({w: i for i, w in enumerate(words + ["<unk>"])}, f)
    shards = []
    for k in range(SPLIT_COUNT):
        shards.append(f"data/train.txt-{k:05d}")
        (ws / shards[-1]).write_text("\n".join(train[k::SPLIT_COUNT]) + "\n")
    (ws / "data" / "test.txt").write_text("\n".join(test) + "\n")
    (ws / "train.list").write_text("\n".join(shards) + "\n")
    (ws / "test.list").write_text("data/test.txt\n")
    return ws


@pytest.mark.skipif(not (PTB / "ptb.train.txt").is_file(), reason=f"PTB not found at {PTB} (set PTB_DIR)")
def test_seed_word2vec_workspace_with_v2_options(tmp_path):
    ws = word2vec_workspace(tmp_path)
    before = sorted(p.name for p in ws.iterdir())
    conf = local_default(tmp_path)
    res = cli(conf, "run", "--job_workspace", str(ws), "--job_name", "w2v", "--", "--trainer_count=2", "--use_gpu",
              "false", "--num_passes", "2", "--saving_period=1", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "train.py does not handle PADDLE_TRAINING_ROLE=PSERVER" in res.stderr
    for t in (0, 1):
        assert f"[trainer.{t}@node0] init: trainer_count=2 use_gpu=0 num_passes=2 saving_period=1 node=0" \
            in res.stdout
        ppl = [float(x) for x in re.findall(rf"^\[trainer\.{t}@node0\] Pass \d done, .* perplexity (\S+)$",
                                            res.stdout, re.M)]
        assert len(ppl) == 2 and ppl[1] < ppl[0], ppl
    job = tmp_path / "root" / "w2v"
    # per node: nodefile, log/ and output/ in the job directory beside the linked workspace; the workspace
    # itself (maybe shared by every node) is left as it was
    assert sorted(p.name for p in ws.iterdir()) == before
    assert os.readlink(job / "train.py") == str(ws / "train.py") and (job / "nodefile").read_text() == "0\n"
    assert sorted(os.listdir(job / "output")) == ["pass-00000", "pass-00001"]
    assert os.readlink(job / "log" / "paddle_trainer.1.INFO") == "train.1.log"
    no_traceback(res)


def test_v2_option_errors_are_one_line(tmp_path):
    ws = seed_workspace(tmp_path)
    conf = local_default(tmp_path)
    for args, words in ((["--", "--trainer_id=1"], "PADDLE_INIT_TRAINER_ID"),
                        (["--", "--num_passes=x"], "whole number"),
                        (["--entry", "missing.py"], "--entry missing.py: no such file in the workspace")):
        res = cli(conf, "run", "--job_dispatch_package", str(ws), *args, timeout=60)
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (tmp_path / "root").exists()
