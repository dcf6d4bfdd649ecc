"""The README's PyTorch and Paddle snippets run as shown (an embedding of 50 million rows, ``save`` after
training): a table too big to save whole is saved as its rows by default, and a ``save`` that fails has the
pservers save a checkpoint first, so the model is never lost (docs/pytorch.md, "Patterns")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import rt_helpers as H
from helpers import checkout_env

from paddle_cluster.contract import TRAINER
from paddle_cluster.ps import checkpoint as ckpt

README = Path(H.REPO) / "README.md"

# What the README's snippets leave to the reader: a model, a loss, this trainer's part of the data.
PRELUDE = {
    "torch": """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(32, 1)
    def forward(self, ids):
        return self.head(self.users(ids).sum(1))
model, loss_fn = Model(), torch.nn.functional.mse_loss
def my_part_of_the_data(rank, size):
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 50_000_000, (8, 2), generator=g)
        yield ids, (ids % 2).float().sum(1, keepdim=True)
""",
    "paddle": """
import paddle
class Model(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.head = paddle.nn.Linear(32, 1)
    def forward(self, ids):
        return self.head(self.users(ids).sum(1))
model, loss_fn = Model(), paddle.nn.functional.mse_loss
def my_part_of_the_data(rank, size):
    paddle.seed(rank)
    for _ in range(3):
        ids = paddle.randint(0, 50_000_000, [8, 2])
        yield ids, (ids % 2).astype("float32").sum(1, keepdim=True)
""",
}
CHECK = {
    "torch": "sd = torch.load('output/model.pt')\nprint('keys', sorted(sd), 'rows', len(sd['users.weight.ids']))\n",
    "paddle": "sd = paddle.load('output/model.pdparams')\n"
              "print('keys', sorted(sd), 'rows', sd['users.weight.ids'].shape[0])\n",
}


def _snippet(fw: str) -> str:
    """The README's fenced Python block that imports paddle_cluster.<fw>, verbatim."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if f"import paddle_cluster.{fw} as" in b]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fw", ["torch", "paddle"])
def test_the_readme_snippet_runs_as_shown(tmp_path, fw):
    """Alone (its in-process pserver), the README's lines train and ``save`` writes the 50-million-row table
    as the rows that exist, saying so once, and the dense parameters whole."""
    pytest.importorskip(fw)
    (tmp_path / "output").mkdir()  # as in a job directory, where the snippet runs
    script = tmp_path / "snippet.py"
    script.write_text(textwrap.dedent(PRELUDE[fw]) + _snippet(fw) + CHECK[fw])
    env = checkout_env({k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")})
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "keys ['head.bias', 'head.weight', 'users.weight.ids', 'users.weight.rows'] rows 48" in res.stdout, \
        res.stdout
    told = [ln for ln in res.stderr.splitlines() if "whole would be 6103 MiB (over 1024 MiB)" in ln]
    assert len(told) == 1 and "its 48 existing rows" in told[0], res.stderr


SAVE_FAILS = """
import sys, torch
import paddle_cluster.torch as pct
model = torch.nn.Sequential(pct.Embedding(1000, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
opt = pct.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step in range(2):
    opt.zero_grad()
    model(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    opt.step()
pct.save(model, sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_a_failing_save_has_the_pservers_save_a_checkpoint_first(tmp_path):
    """A launched trainer whose ``save`` cannot write (no such directory): the pservers hold a checkpoint of
    the step before the trainer's one-line error, which names it; the job ends (the pservers exit)."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(SAVE_FAILS)
    env = H.make_env(2, 1, tmp_path, ports_num=1, sparse_ports=1)
    target = tmp_path / "no" / "such" / "model.pt"
    with H.procs(tmp_path) as pr:
        servers = [pr.pserver(env, k) for k in range(2)]
        t = pr.start([sys.executable, str(script), str(target)], H.proc_env(env, TRAINER, 0), "trainer0")
        assert H.wait_all(pr, [t], 60) == [1]
        assert H.wait_all(pr, servers, 15) == [0, 0]
        last = pr.log(t).strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: save '{target}' failed: ") and \
        "the pservers saved a checkpoint of step 2 first (" in last and "--resume_from JOB" in last, last
    root = ckpt.default_root(str(tmp_path))
    assert ckpt.complete_steps(root, [0, 1]) == [2]
