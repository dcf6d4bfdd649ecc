"""Every layer's backward against central finite differences (in float64), plus a tiny end-to-end MLP."""

import numpy as np
import pytest

from paddle_cluster.ps.optim import DenseOptimizer, OptimizerSpec, SparseOptimizer
from paddle_cluster.train import layers as L
from paddle_cluster.train import losses

F64 = np.float64


def numeric_grad(f, x, h=1e-6):
    """Central differences of scalar f() with respect to array x, perturbed in place."""
    g = np.zeros_like(x, dtype=F64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f()
        x[i] = old - h
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_linear(rng):
    lin = L.Linear("fc", 4, 3, seed=1, dtype=F64)
    lin.bias.value[...] = rng.standard_normal(3)
    x = rng.standard_normal((5, 4))
    r = rng.standard_normal((5, 3))

    def f():
        return float((lin.forward(x) * r).sum())

    f()
    dx = lin.backward(r)
    close(dx, numeric_grad(f, x))
    close(lin.weight.grad, numeric_grad(f, lin.weight.value))
    close(lin.bias.grad, numeric_grad(f, lin.bias.value))
    # Gradients accumulate across backward calls until zero_grads.
    lin.forward(x)
    lin.backward(r)
    close(lin.weight.grad, 2 * numeric_grad(f, lin.weight.value))
    L.zero_grads(lin)
    assert not lin.weight.grad.any() and not lin.bias.grad.any()


def test_linear_default_dtype_and_deterministic_init():
    a, b, c = L.Linear("fc1", 8, 4, seed=3), L.Linear("fc1", 8, 4, seed=3), L.Linear("fc2", 8, 4, seed=3)
    assert a.weight.value.dtype == np.float32 and a.bias.value.dtype == np.float32
    assert np.array_equal(a.weight.value, b.weight.value)
    assert not np.array_equal(a.weight.value, c.weight.value)
    limit = np.sqrt(6 / 12)
    assert np.abs(a.weight.value).max() <= limit


@pytest.mark.parametrize("cls", [L.ReLU, L.Tanh, L.Sigmoid, L.Softmax])
def test_activations(cls, rng):
    layer = cls()
    x = rng.standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = 0.5  # keep ReLU's kink away from the finite-difference step
    r = rng.standard_normal((4, 6))

    def f():
        return float((layer.forward(x) * r).sum())

    f()
    close(layer.backward(r), numeric_grad(f, x))


def test_sigmoid_and_softmax_are_stable():
    x = np.array([[-1000.0, 0.0, 1000.0]], dtype=np.float32)
    s = L.sigmoid(x)
    assert s.dtype == np.float32 and np.all(np.isfinite(s))
    np.testing.assert_allclose(s, [[0, 0.5, 1]])
    np.testing.assert_allclose(L.softmax(x), [[0, 0, 1]])


def test_concat(rng):
    cat = L.Concat()
    a, b, c = rng.standard_normal((3, 2)), rng.standard_normal((3, 4)), rng.standard_normal((3, 1))
    r = rng.standard_normal((3, 7))

    def f():
        return float((cat.forward([a, b, c]) * r).sum())

    f()
    da, db, dc = cat.backward(r)
    close(da, numeric_grad(f, a))
    close(db, numeric_grad(f, b))
    close(dc, numeric_grad(f, c))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_seq_pool_with_empty_and_length_one(mode, rng):
    # Sequences of lengths 0, 3, 1, 0, 2, 0 (empty at the start, in the middle and at the end).
    offsets = L.lengths_to_offsets([0, 3, 1, 0, 2, 0])
    x = rng.standard_normal((6, 3))
    r = rng.standard_normal((6, 3))
    pool = L.SeqPool(mode)

    def f():
        return float((pool.forward(x, offsets) * r).sum())

    out = pool.forward(x, offsets)
    expect = np.zeros((6, 3))
    for i in range(6):
        seg = x[offsets[i] : offsets[i + 1]]
        if len(seg):
            expect[i] = seg.sum(0) if mode == "sum" else seg.mean(0)
    close(out, expect)
    close(pool.backward(r), numeric_grad(f, x))


def test_seq_pool_all_empty_and_bad_offsets():
    pool = L.SeqPool("mean")
    out = pool.forward(np.zeros((0, 2)), np.array([0, 0, 0]))
    assert out.shape == (2, 2) and not out.any()
    assert pool.backward(np.ones((2, 2))).shape == (0, 2)
    with pytest.raises(ValueError):
        pool.forward(np.zeros((3, 2)), np.array([0, 2]))


def test_cosine_similarity(rng):
    cos = L.CosineSimilarity()
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    b[1] = -2 * a[1]  # exactly anti-parallel
    r = rng.standard_normal(5)

    def f():
        return float((cos.forward(a, b) * r).sum())

    c = cos.forward(a, b)
    ref = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose(c, ref, rtol=1e-7)
    da, db = cos.backward(r)
    close(da, numeric_grad(f, a))
    close(db, numeric_grad(f, b))
    # A zero row gives a finite cosine and gradient.
    z = L.CosineSimilarity().forward(np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32))
    assert np.isfinite(z).all()


def test_square_error(rng):
    loss = losses.SquareError()
    p, t = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))

    def f():
        return loss.forward(p, t)

    assert f() == pytest.approx(np.mean((p - t) ** 2))
    close(loss.backward(), numeric_grad(f, p))


def test_softmax_cross_entropy(rng):
    loss = losses.SoftmaxCrossEntropy()
    logits = rng.standard_normal((5, 4))
    labels = np.array([0, 3, 1, 1, 2])

    def f():
        return loss.forward(logits, labels)

    v = f()
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert v == pytest.approx(-np.log(p[np.arange(5), labels]).mean())
    close(loss.backward(), numeric_grad(f, logits))
    # Fused log-softmax stays finite where a naive log(softmax) would give log(0).
    big = np.array([[1000.0, -1000.0]], dtype=np.float32)
    assert loss.forward(big, [1]) == pytest.approx(2000.0)
    assert np.all(np.isfinite(loss.backward()))


def test_embedding_sparse_grad_with_duplicates(rng):
    emb = L.Embedding("words", dim=3, vocab=10, local=True, dtype=F64)
    ids = np.array([[7, 2, 7], [2, 9, 7]])
    r = rng.standard_normal((2, 3, 3))

    def f():
        return float((emb.forward(ids) * r).sum())

    out = emb.forward(ids)
    assert np.array_equal(out, emb.table[ids])
    g = emb.backward(r)
    assert g.ids.tolist() == [2, 7, 9]
    dense = numeric_grad(f, emb.table)
    close(g.rows, dense[g.ids])
    untouched = np.setdiff1d(np.arange(10), g.ids)
    assert not dense[untouched].any()


def test_embedding_with_pulled_rows_and_shared_table(rng):
    """Two layers on one pserver table: forward uses the rows for np.unique(ids); grads are merged."""
    table = rng.standard_normal((20, 4)).astype(np.float32)
    q, t = L.Embedding("shared", 4), L.Embedding("shared", 4)
    q_ids, t_ids = np.array([3, 5, 3]), np.array([5, 11])
    q_out = q.forward(q_ids, rows=table[L.Embedding.unique(q_ids)])
    t_out = t.forward(t_ids, rows=table[np.unique(t_ids)])
    assert np.array_equal(q_out, table[q_ids]) and np.array_equal(t_out, table[t_ids])
    q.backward(np.ones((3, 4), np.float32))
    t.backward(np.full((2, 4), 10, np.float32))

    class Two(L.Layer):
        def __init__(self):
            self.towers = [q, t]

    g = L.sparse_grads(Two())["shared"]
    assert g.ids.tolist() == [3, 5, 11]
    assert g.rows[:, 0].tolist() == [2, 11, 10]
    with pytest.raises(ValueError):
        q.forward(q_ids, rows=table[:3])
    with pytest.raises(ValueError):
        q.forward(q_ids)  # no local table and no rows


def test_bag_of_words_end_to_end_grad(rng):
    """Embedding -> mean pool -> linear -> cross-entropy: the embedding rows' gradient is exact."""
    emb = L.Embedding("w", dim=3, vocab=8, local=True, dtype=F64)
    pool, fc, loss = L.SeqPool("mean"), L.Linear("fc", 3, 2, dtype=F64), losses.SoftmaxCrossEntropy()
    ids, offsets = L.pack_sequences([[1, 4, 1], [], [6]])
    labels = np.array([0, 1, 1])

    def f():
        return loss.forward(fc.forward(pool.forward(emb.forward(ids), offsets)), labels)

    f()
    g = emb.backward(pool.backward(fc.backward(loss.backward())))
    close(g.rows, numeric_grad(f, emb.table)[g.ids])


def test_param_dict_helpers():
    model = L.Sequential(L.Linear("a", 3, 4), L.ReLU(), L.Linear("b", 4, 2))
    vals = L.dense_values(model)
    assert sorted(vals) == ["a.b", "a.w", "b.b", "b.w"]
    new = {k: np.full_like(v, 0.5) for k, v in vals.items()}
    L.set_dense_values(model, new)
    assert np.all(model.layers[0].weight.value == 0.5)
    with pytest.raises(KeyError):
        L.set_dense_values(model, {"a.w": new["a.w"]})
    with pytest.raises(ValueError):
        L.set_dense_values(model, {**new, "a.w": np.zeros((2, 2))})
    dup = L.Sequential(L.Linear("a", 3, 3), L.Linear("a", 3, 3))
    with pytest.raises(ValueError):
        L.dense_params(dup)


def test_mlp_trains_with_dense_sgd():
    """Two-layer MLP on a non-linearly separable synthetic problem: loss must fall a lot."""
    rng = np.random.default_rng(42)
    x = rng.standard_normal((512, 2)).astype(np.float32)
    y = ((x[:, 0] * x[:, 1]) > 0).astype(np.int64)  # XOR-like quadrants
    model = L.Sequential(L.Linear("h", 2, 32, seed=7), L.Tanh(), L.Linear("o", 32, 2, seed=7))
    loss = losses.SoftmaxCrossEntropy()
    spec = OptimizerSpec("sgd", lr=0.5)
    opts = {k: DenseOptimizer(spec, p.value) for k, p in L.dense_params(model).items()}
    first = loss.forward(model.forward(x), y)
    for _ in range(300):
        L.zero_grads(model)
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        for k, p in L.dense_params(model).items():
            opts[k].apply(p.value, p.grad)
    last = loss.forward(model.forward(x), y)
    acc = (loss.probs.argmax(1) == y).mean()
    assert last < 0.3 * first and acc > 0.9
    assert all(p.value.dtype == np.float32 for p in L.dense_params(model).values())


def test_local_embedding_trains_with_sparse_optimizer():
    rng = np.random.default_rng(5)
    emb = L.Embedding("e", dim=2, vocab=6, local=True, seed=1)
    before = emb.table.copy()
    opt = SparseOptimizer(OptimizerSpec("adagrad", lr=0.1), 2)
    state = opt.new_state(6)
    target = rng.standard_normal((4, 2)).astype(np.float32)
    ids = np.array([0, 2, 2, 3])
    loss = losses.SquareError()
    first = loss.forward(emb.forward(ids), target)
    for _ in range(50):
        L.zero_grads(emb)
        loss.forward(emb.forward(ids), target)
        emb.backward(loss.backward())
        g = L.sparse_grads(emb)["e"]
        opt.apply(emb.table, state, g.ids, g.rows)
    assert loss.forward(emb.forward(ids), target) < 0.5 * first
    assert np.array_equal(emb.table[[1, 4, 5]], before[[1, 4, 5]])
