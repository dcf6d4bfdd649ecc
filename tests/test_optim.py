"""Optimizers against hand-written reference formulas (float64 references, float32 implementations)."""

import json

import numpy as np
import pytest

from paddle_cluster.ps.optim import DenseOptimizer, OptimizerSpec, SparseOptimizer


def _ref_dense(spec, p, grads):
    """Textbook updates in float64, one gradient per step."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) + spec.weight_decay * p
        if spec.name == "sgd":
            p -= spec.lr * g
        elif spec.name == "momentum":
            v = spec.momentum * v + g
            p -= spec.lr * v
        elif spec.name == "adagrad":
            m += g * g
            p -= spec.lr * g / (np.sqrt(m) + spec.eps)
        elif spec.name == "adam":
            m = spec.beta1 * m + (1 - spec.beta1) * g
            v = spec.beta2 * v + (1 - spec.beta2) * g * g
            m_hat = m / (1 - spec.beta1**t)
            v_hat = v / (1 - spec.beta2**t)
            p -= spec.lr * m_hat / (np.sqrt(v_hat) + spec.eps)
    return p


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_dense_matches_reference(name, wd):
    rng = np.random.default_rng(0)
    spec = OptimizerSpec(name=name, lr=0.05, eps=1e-6, weight_decay=wd)
    p0 = rng.standard_normal((7, 5)).astype(np.float32)
    grads = [rng.standard_normal((7, 5)).astype(np.float32) for _ in range(5)]
    p = p0.copy()
    opt = DenseOptimizer(spec, p)
    for g in grads:
        opt.apply(p, g)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, _ref_dense(spec, p0, grads), rtol=1e-5, atol=1e-6)
    if name == "adam":
        assert opt.state["t"].dtype == np.int64 and opt.state["t"].shape == (1,) and opt.state["t"][0] == 5


def test_dense_sgd_is_bit_exact():
    rng = np.random.default_rng(1)
    p = rng.standard_normal(1000).astype(np.float32)
    expect = p.copy()
    opt = DenseOptimizer(OptimizerSpec("sgd", lr=0.1), p)
    for _ in range(3):
        g = rng.standard_normal(1000).astype(np.float32)
        opt.apply(p, g)
        expect -= 0.1 * g
    assert np.array_equal(p, expect)


def test_lr_is_read_each_step():
    spec = OptimizerSpec("sgd", lr=1.0)
    p = np.zeros(3, np.float32)
    opt = DenseOptimizer(spec, p)
    opt.apply(p, np.ones(3, np.float32))
    spec.lr = 0.5
    opt.apply(p, np.ones(3, np.float32))
    np.testing.assert_array_equal(p, [-1.5, -1.5, -1.5])


def test_dense_state_load_roundtrip():
    rng = np.random.default_rng(2)
    spec = OptimizerSpec("adam", lr=0.01)
    p = rng.standard_normal(4).astype(np.float32)
    a = DenseOptimizer(spec, p)
    for _ in range(3):
        a.apply(p, rng.standard_normal(4).astype(np.float32))
    saved = {k: v.copy() for k, v in a.state.items()}
    p2 = p.copy()
    b = DenseOptimizer(spec, p2)
    b.load_state(saved)
    g = rng.standard_normal(4).astype(np.float32)
    a.apply(p, g)
    b.apply(p2, g)
    assert np.array_equal(p, p2)
    with pytest.raises(ValueError):
        b.load_state({"m": saved["m"]})


def test_spec_dict_roundtrip_and_rejects_unknown():
    spec = OptimizerSpec("adam", lr=0.002, beta2=0.99)
    d = json.loads(json.dumps(spec.to_dict()))
    assert OptimizerSpec.from_dict(d) == spec
    with pytest.raises(ValueError, match="unknown optimizer keys"):
        OptimizerSpec.from_dict({"name": "sgd", "learning_rate": 0.1})
    with pytest.raises(ValueError, match="unknown optimizer"):
        OptimizerSpec.from_dict({"name": "rmsprop"})
    with pytest.raises(ValueError):
        OptimizerSpec("sgd", lr=float("nan"))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_sparse_rows_match_dense_and_are_lazy(name):
    """Each touched row follows the dense formula with its own step count; untouched rows never change."""
    rng = np.random.default_rng(3)
    spec = OptimizerSpec(name=name, lr=0.05, eps=1e-6)
    cap, w = 10, 4
    table = rng.standard_normal((cap, w)).astype(np.float32)
    table0 = table.copy()
    opt = SparseOptimizer(spec, w)
    state = opt.new_state(cap)
    for k, (suffix, dt) in opt.row_slots.items():
        assert state[k].shape == (cap, *suffix) and state[k].dtype == dt
    # Row 2 is touched in every step, row 5 only in the last, row 7 never.
    steps = [np.array([2, 3]), np.array([0, 2]), np.array([2, 5, 9])]
    per_row = {}
    for idx in steps:
        g = rng.standard_normal((len(idx), w)).astype(np.float32)
        opt.apply(table, state, idx, g)
        for r, gr in zip(idx, g):
            per_row.setdefault(int(r), []).append(gr)
    for r in range(cap):
        if r in per_row:
            ref = _ref_dense(spec, table0[r], per_row[r])
            np.testing.assert_allclose(table[r], ref, rtol=1e-5, atol=1e-6)
        else:
            assert np.array_equal(table[r], table0[r])
            for arr in state.values():
                assert not np.any(arr[r])
    if name == "adam":
        assert state["t"][[0, 2, 3, 5, 7, 9]].tolist() == [1, 3, 1, 1, 0, 1]


def test_sparse_sgd_bit_exact_with_dense():
    rng = np.random.default_rng(4)
    table = rng.standard_normal((6, 3)).astype(np.float32)
    dense = table.copy()
    idx = np.array([1, 4])
    g = rng.standard_normal((2, 3)).astype(np.float32)
    SparseOptimizer(OptimizerSpec("sgd", lr=0.3), 3).apply(table, {}, idx, g)
    full = np.zeros_like(dense)
    full[idx] = g
    DenseOptimizer(OptimizerSpec("sgd", lr=0.3), dense).apply(dense, full)
    assert np.array_equal(table, dense)


def test_sparse_shape_errors():
    opt = SparseOptimizer(OptimizerSpec("adagrad"), 3)
    table = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError):
        opt.apply(table, opt.new_state(4), np.array([0, 1]), np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError):
        opt.apply(np.zeros((4, 2), np.float32), opt.new_state(4), np.array([0]), np.zeros((1, 2), np.float32))
    for bad in ([1, 1], [-1, 0], [0, 4]):
        with pytest.raises(ValueError):
            opt.apply(table, opt.new_state(4), np.array(bad), np.ones((2, 3), np.float32))
    assert not table.any()
    # An empty push is fine.
    opt.apply(table, opt.new_state(4), np.zeros(0, np.int64), np.zeros((0, 3), np.float32))


# -- the rules of torch.optim, against torch.optim itself --------------------------------------------------

TORCH_CASES = [  # (torch class, its options, the OptimizerSpec that must do the same)
    ("SGD", dict(lr=0.1, weight_decay=0.01), dict(name="sgd", lr=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
     dict(name="momentum", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True), dict(name="momentum", lr=0.1, momentum=0.9, nesterov=True)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.2, eps=1e-10, weight_decay=0.01),
     dict(name="adagrad", lr=0.1, lr_decay=0.05, initial_accumulator_value=0.2, eps=1e-10, weight_decay=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.01),
     dict(name="adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=0.01)),
    ("Adam", dict(lr=0.01, amsgrad=True), dict(name="adam", lr=0.01, amsgrad=True)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, eps=1e-3), dict(name="adamw", lr=0.01, weight_decay=0.1, eps=1e-3)),
]


@pytest.mark.parametrize("cls,options,spec", TORCH_CASES, ids=[f"{c[0]}-{c[2]['name']}-{i}"
                                                                  for i, c in enumerate(TORCH_CASES)])
def test_dense_and_sparse_match_torch_optim(cls, options, spec):
    """Dense and sparse (every row touched every step) forms end where torch.optim does, to float32 tolerance."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((5, 3)).astype(np.float32)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(5)]
    w = torch.nn.Parameter(torch.tensor(p0))
    opt = getattr(torch.optim, cls)([w], **options)
    for g in grads:
        w.grad = torch.tensor(g)
        opt.step()
    dense, table = p0.copy(), p0.copy()
    d = DenseOptimizer(OptimizerSpec(**spec), dense)
    s = SparseOptimizer(OptimizerSpec(**spec), 3)
    state = s.new_state(5)
    for g in grads:
        d.apply(dense, g.copy())
        s.apply(table, state, np.arange(5), g.copy())
    np.testing.assert_allclose(dense, w.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table, w.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_sparse_first_step_counts_per_row():
    """A row first touched late starts as at step 1: momentum with dampening takes its gradient undampened."""
    spec = OptimizerSpec("momentum", lr=1.0, momentum=0.5, dampening=0.5)
    s = SparseOptimizer(spec, 1)
    table, state = np.zeros((2, 1), np.float32), s.new_state(2)
    s.apply(table, state, np.array([0]), np.ones((1, 1)))
    s.apply(table, state, np.array([0, 1]), np.ones((2, 1)))
    assert table[:, 0].tolist() == [-2.0, -1.0]  # row 0: v=1 then 0.5*1+0.5*1; row 1: v=1 at its first step


@pytest.mark.parametrize("bad,says", [
    ({"name": "momentum", "nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov"),
    ({"name": "adam", "amsgrad": 1}, "amsgrad=1"),
    ({"name": "sgd", "dampening": 2}, "dampening=2"),
    ({"name": "adagrad", "lr_decay": -1}, "lr_decay"),
    ({"name": "lamb"}, "adamw"),
])
def test_spec_refuses_bad_options_in_one_line(bad, says):
    with pytest.raises(ValueError) as e:
        OptimizerSpec.from_dict(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_initial_accumulator_fills_new_state():
    spec = OptimizerSpec("adagrad", initial_accumulator_value=0.25)
    assert DenseOptimizer(spec, np.zeros(3, np.float32)).state["m"].tolist() == [0.25] * 3
    assert SparseOptimizer(spec, 2).new_state(1)["m"].tolist() == [[0.25, 0.25]]


PADDLE_CASES = [  # (paddle.optimizer class, its options, the OptimizerSpec that must do the same)
    ("SGD", dict(learning_rate=0.1, weight_decay=0.01), dict(name="sgd", lr=0.1, weight_decay=0.01)),
    ("Momentum", dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01),
     dict(name="momentum", lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("Momentum", dict(learning_rate=0.1, momentum=0.9, use_nesterov=True),
     dict(name="momentum", lr=0.1, momentum=0.9, nesterov=True)),
    ("Adagrad", dict(learning_rate=0.1, epsilon=1e-6, initial_accumulator_value=0.2),
     dict(name="adagrad", lr=0.1, eps=1e-6, initial_accumulator_value=0.2)),
    ("Adam", dict(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-3, weight_decay=0.01),
     dict(name="adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=0.01)),
    ("Adam", dict(learning_rate=0.01, amsgrad=True, epsilon=1e-3), dict(name="adam", lr=0.01, amsgrad=True, eps=1e-3)),
    ("AdamW", dict(learning_rate=0.01, weight_decay=0.1, epsilon=1e-3),
     dict(name="adamw", lr=0.01, weight_decay=0.1, eps=1e-3)),
]


@pytest.mark.parametrize("cls,options,spec", PADDLE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(PADDLE_CASES)])
def test_dense_matches_paddle_optimizer(cls, options, spec):
    """Paddle 3's dygraph optimizers (float weight_decay: L2, coupled; AdamW's: decoupled) are these rules too."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((5, 3)).astype(np.float32)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(5)]
    w = paddle.create_parameter([5, 3], "float32", default_initializer=paddle.nn.initializer.Assign(p0))
    opt = getattr(paddle.optimizer, cls)(parameters=[w], **options)
    for g in grads:
        (w * paddle.to_tensor(g)).sum().backward()  # d/dw = g
        opt.step()
        opt.clear_grad()
    p = p0.copy()
    d = DenseOptimizer(OptimizerSpec(**spec), p)
    for g in grads:
        d.apply(p, g.copy())
    np.testing.assert_allclose(p, w.numpy(), rtol=1e-5, atol=1e-6)
