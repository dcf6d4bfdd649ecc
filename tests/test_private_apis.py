"""The private framework APIs the frontends use (``paddle_cluster/train/private.py``): each one is still there, and
still does what the frontend relies on, on the installed torch, Paddle and Python; and the frontends use no
private name that list lacks. A failure here names what a new framework version moved."""

from __future__ import annotations

import ast
import threading
import warnings
from pathlib import Path

import pytest

from paddle_cluster.train.private import APIS

ROOT = Path(__file__).resolve().parents[1] / "paddle_cluster"
FRONTENDS = [*sorted((ROOT / "torch").glob("*.py")), *sorted((ROOT / "paddle").glob("*.py")),
             *sorted((ROOT / "train").glob("*.py"))]
# Our own private names the frontends share across modules (the table marker, an Embedding's bridge, the
# process's optimizer and its _load): ours to move, not a framework's.
OURS = {"_paddle_cluster_table", "_bridge", "_held", "_load"}


def _private_uses() -> set:
    """Every ``x._name`` the frontends read or write on something not their own (not ``self``/``cls``), and every
    ``getattr(x, "_name", ...)``."""
    found = set()
    for path in FRONTENDS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and str(node.args[1].value).startswith("_"):
                found.add(node.args[1].value)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                found.add(node.attr)
    return found


def test_the_frontends_use_no_private_name_the_list_lacks():
    listed = {a.name for a in APIS}
    unlisted = _private_uses() - listed - OURS
    assert not unlisted, f"private framework names used but not in paddle_cluster/train/private.py: {unlisted}"
    assert len(listed) == len(APIS) and listed <= _private_uses(), "listed but no longer used: drop it from the list"


def test_torch_private_apis_are_where_they_were():
    torch = pytest.importorskip("torch")
    assert {a.name for a in APIS if a.owner.startswith("torch")} == {"_opt_called", "_version"}
    # _version: each in-place change of a tensor (an accumulated gradient, a clip) counts once.
    t = torch.zeros(3)
    v = t._version
    t.add_(1)
    t.mul_(0.5)
    assert t._version == v + 2
    # _opt_called: a scheduler made on an optimizer whose step() it did not see warns unless the flag is set.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sched.step()
    assert any("optimizer.step()" in str(w.message) for w in seen), "LRScheduler no longer warns: drop _opt_called"
    opt2 = torch.optim.SGD([p], lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1)
    opt2._opt_called = True
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sched2.step()
    assert not [w for w in seen if "optimizer.step()" in str(w.message)], "LRScheduler no longer reads _opt_called"


def test_python_private_apis_are_where_they_were():
    assert callable(threading._register_atexit)


def test_paddle_private_apis_are_where_they_were():
    paddle = pytest.importorskip("paddle")
    import numpy as np

    names = {a.name for a in APIS if a.owner.startswith("paddle")}
    checked = set()
    assert paddle.regularizer.L2Decay(0.25)._coeff == 0.25
    checked.add("_coeff")
    layer = paddle.nn.Linear(2, 2)
    clip = paddle.nn.ClipGradByGlobalNorm(1.0)
    mom = paddle.optimizer.Momentum(0.1, momentum=0.8, parameters=layer.parameters(), grad_clip=clip)
    assert mom._grad_clip is clip
    assert mom._default_dict["momentum"] == 0.8 and "use_nesterov" in mom._default_dict
    assert mom._param_groups == list(layer.parameters())
    grouped = paddle.optimizer.Adam(0.1, parameters=[{"params": layer.parameters(), "beta1": 0.5}], amsgrad=True)
    assert isinstance(grouped._param_groups[0], dict) and grouped._param_groups[0]["beta1"] == 0.5
    assert grouped._amsgrad is True and grouped._default_dict["beta2"] == 0.999
    fun = (lambda name: True)  # noqa: E731
    adamw = paddle.optimizer.AdamW(0.1, parameters=layer.parameters(), apply_decay_param_fun=fun)
    assert adamw._apply_decay_param_fun is fun and adamw._lr_ratio is None and adamw._amsgrad is False
    assert adamw._default_dict["weight_decay"] == 0.01
    checked |= {"_grad_clip", "_default_dict", "_param_groups", "_amsgrad", "_apply_decay_param_fun", "_lr_ratio"}
    emb = paddle.nn.Embedding(5, 3, sparse=True)
    emb(paddle.to_tensor([1, 3, 1])).sum().backward()
    g = emb.weight.grad
    assert g.is_selected_rows() and sorted(g.rows()) == [1, 1, 3]
    assert g._get_tensor_from_selected_rows().numpy().shape == (3, 3)
    checked.add("_get_tensor_from_selected_rows")
    seen = []
    layer.bias._register_backward_hook(lambda *_: seen.append(float(layer.bias.grad.numpy().sum())))
    for _ in range(2):  # run after each pass, the gradient accumulated so far in place
        layer(paddle.ones([4, 2])).sum().backward()
    assert seen == [8.0, 16.0], seen
    checked.add("_register_backward_hook")
    w = layer.weight
    w.clear_gradient(False)
    w._set_grad_ivar(paddle.to_tensor(np.full((2, 2), 3.0, dtype=np.float32)))
    assert np.array_equal(w.grad.numpy(), np.full((2, 2), 3.0))
    checked.add("_set_grad_ivar")
    assert checked == names
