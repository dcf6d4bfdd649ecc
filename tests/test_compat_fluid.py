"""paddle_cluster.compat.paddle.fluid: the graph's gradients against finite differences, local training through an
in-process pserver (real TCP), sparse tables, saving and loading, and errors that name what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import paddle_cluster.compat.paddle.fluid as fluid
from paddle_cluster.compat.missing import NotInCompat
from paddle_cluster.compat.paddle.fluid import executor as E
from paddle_cluster.compat.paddle.fluid import kernels as K
from paddle_cluster.ps import init_rows


@pytest.fixture(autouse=True)
def fresh_programs(monkeypatch):
    """Each test builds into its own main/startup programs, with no launcher contract around."""
    for name in list(os.environ):
        if name.startswith("PADDLE_"):
            monkeypatch.delenv(name)
    main, startup = fluid.Program(), fluid.Program()
    with fluid.program_guard(main, startup):
        yield main


def loss_and_grads(prog, loss, feed):
    ops = prog.ancestors([loss])
    E._zero_grads(ops)
    values = E.run_forward(ops, feed)
    E.run_backward(ops, values, loss)
    return float(values[loss.name][0])


def test_gradients_match_finite_differences(fresh_programs):
    prog = fresh_programs
    layers = fluid.layers
    ids = layers.data(name="ids", shape=[1], dtype="int64")
    x = layers.data(name="x", shape=[3], dtype="float64")
    other = layers.data(name="other", shape=[4], dtype="float64")
    label = layers.data(name="label", shape=[1], dtype="int64")
    y = layers.data(name="y", shape=[1], dtype="float64")
    emb = layers.embedding(input=ids, size=[7, 4], dtype="float64")
    h = layers.fc(input=[layers.concat([emb, x], axis=1), x], size=5, act="tanh")
    h2 = layers.fc(input=h, size=4, act="sigmoid", bias_attr=fluid.ParamAttr(initializer=fluid.initializer.Normal()))
    logits = layers.relu(layers.fc(input=h2, size=3))
    ce = layers.cross_entropy(input=layers.softmax(logits), label=label)
    sq = layers.square_error_cost(input=layers.cos_sim(h2, other), label=y)
    loss = layers.mean(layers.concat([ce, sq], axis=0))
    rng = np.random.default_rng(0)
    feed = {"ids": np.array([[1], [3], [1], [6], [0]]), "x": rng.normal(size=(5, 3)),
            "label": np.array([0, 2, 1, 2, 0]), "other": rng.normal(size=(5, 4)), "y": rng.uniform(-1, 1, size=(5, 1))}
    loss_and_grads(prog, loss, feed)
    params = prog.all_parameters()
    assert len(params) == 8  # embedding; fc: 2 weights + bias; two more fc: weight + bias
    for p in params:
        analytic = p.param.grad.copy()
        numeric = np.zeros_like(analytic)
        for i in np.ndindex(*p.shape):
            old = p.param.value[i]
            p.param.value[i] = old + 1e-6
            up = loss_and_grads(prog, loss, feed)
            p.param.value[i] = old - 1e-6
            down = loss_and_grads(prog, loss, feed)
            p.param.value[i] = old
            numeric[i] = (up - down) / 2e-6
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7, err_msg=p.name)


def test_cross_entropy_kernels():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(4, 5))
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    lab = np.array([0, 4, 2, 2])
    plain, fused = K.CrossEntropy(), K.SoftmaxCrossEntropy()
    expect = -np.log(p[np.arange(4), lab]).reshape(-1, 1)
    np.testing.assert_allclose(plain.forward(p, lab), expect)
    np.testing.assert_allclose(fused.forward(z, lab), expect)
    d = rng.normal(size=(4, 1))
    gp = plain.backward(d)[0]
    # through the softmax's own backward, the plain kernel's gradient is the fused one's
    np.testing.assert_allclose(p * (gp - (gp * p).sum(axis=1, keepdims=True)), fused.backward(d)[0])
    big = np.array([[1000.0, -1000.0]])
    assert np.isfinite(fused.forward(big, np.array([1]))).all()  # log(0) never taken
    ignored = K.CrossEntropy(ignore_index=1).forward(p[:2], np.array([1, 4]))
    assert ignored[0, 0] == 0 and ignored[1, 0] > 0


def fit_a_line(opt=None):
    x = fluid.layers.data(name="x", shape=[13], dtype="float32")
    y = fluid.layers.data(name="y", shape=[1], dtype="float32")
    y_predict = fluid.layers.fc(input=x, size=1, act=None)
    avg = fluid.layers.mean(fluid.layers.square_error_cost(input=y_predict, label=y))
    (opt or fluid.optimizer.SGD(learning_rate=0.01)).minimize(avg)
    return x, y, y_predict, avg


def linear_data(n=64):
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(n, 13)).astype(np.float32)
    return [(r, np.array([r @ np.arange(13) / 10 + 1.0], dtype=np.float32)) for r in xs]


@pytest.mark.parametrize("opt", [fluid.optimizer.SGD(learning_rate=0.05), fluid.optimizer.Momentum(0.01, 0.9),
                                 fluid.optimizer.Adagrad(learning_rate=0.5), fluid.optimizer.Adam(learning_rate=0.1)])
def test_local_training_through_an_in_process_pserver(fresh_programs, opt):
    x, y, y_predict, avg = fit_a_line(opt)
    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(fluid.default_startup_program())
    feeder = fluid.DataFeeder(place=fluid.CPUPlace(), feed_list=[x, y])
    data = linear_data()
    losses = []
    for _ in range(40):
        for i in range(0, len(data), 16):
            loss, pred = exe.run(fluid.default_main_program(), feed=feeder.feed(data[i:i + 16]),
                                 fetch_list=[avg, y_predict])
            losses.append(float(loss[0]))
    assert loss.shape == (1,) and pred.shape == (16, 1) and pred.dtype == np.float32
    assert losses[-1] < losses[0] / 20, (losses[0], losses[-1])
    assert fresh_programs.origin.session.client is not None  # trained against a pserver, over TCP
    exe.close()


def test_clone_for_test_runs_forward_only_with_the_trained_values(fresh_programs):
    x, y, y_predict, avg = fit_a_line()
    test_prog = fresh_programs.clone(for_test=True)
    exe = fluid.Executor()
    feeder = fluid.DataFeeder(feed_list=[x, y])
    batch = feeder.feed(linear_data(8))
    before, = exe.run(test_prog, feed=batch, fetch_list=[avg])
    again, = exe.run(test_prog, feed=batch, fetch_list=[avg])
    assert before == again  # forward only: nothing changed
    for _ in range(20):
        exe.run(fresh_programs, feed=batch, fetch_list=[avg])
    after, = exe.run(test_prog, feed=batch, fetch_list=[avg.name])
    assert after[0] < before[0]
    exe.close()


def embedding_model(sparse: bool, vocab=50, dim=6):
    words = [fluid.layers.data(name=f"w{i}", shape=[1], dtype="int64") for i in range(3)]
    attr = fluid.ParamAttr(name="emb", initializer=fluid.initializer.Uniform(-0.1, 0.1))
    embs = [fluid.layers.embedding(input=w, size=[vocab, dim], is_sparse=sparse, param_attr=attr) for w in words[:2]]
    pred = fluid.layers.fc(input=fluid.layers.concat(embs, axis=1), size=vocab, act="softmax", param_attr="fc.w",
                           bias_attr="fc.b")
    avg = fluid.layers.mean(fluid.layers.cross_entropy(input=pred, label=words[2]))
    fluid.optimizer.SGD(learning_rate=0.5).minimize(avg)
    return words, pred, avg


def test_sparse_table_on_the_pserver_trains_like_the_dense_table(fresh_programs):
    rng = np.random.default_rng(3)
    data = [(a, b, (a + b) % 50) for a, b in rng.integers(0, 50, size=(96, 2))]
    runs = []
    for sparse in (False, True):
        with fluid.program_guard(fluid.Program(), fluid.Program()):
            words, pred, avg = embedding_model(sparse)
            prog = fluid.default_main_program()
            table = prog.var("emb")
            assert table.sparse == sparse and (table.value is None) == sparse
            if not sparse:  # start from the rows the pserver will create for the sparse table
                table.param.value[...] = init_rows(np.arange(50), 6, 0.1, table.seed)
            exe, feeder = fluid.Executor(), fluid.DataFeeder(feed_list=words)
            runs.append([float(exe.run(prog, feed=feeder.feed(data[i:i + 32]), fetch_list=[avg])[0][0])
                         for _ in range(5) for i in range(0, 96, 32)])
            exe.close()
    np.testing.assert_allclose(runs[0], runs[1], rtol=2e-5)
    assert runs[1][-1] < runs[1][0]


def test_save_and_load_persistables_and_inference_model(fresh_programs, tmp_path):
    words, pred, avg = embedding_model(sparse=True)
    exe, feeder = fluid.Executor(), fluid.DataFeeder(feed_list=words)
    batch = feeder.feed([(1, 2, 3), (4, 5, 9)])
    for _ in range(3):
        exe.run(feed=batch, fetch_list=[avg])
    want, = exe.run(fresh_programs.clone(for_test=True), feed=batch, fetch_list=[pred])
    out = tmp_path / "output" / "pass-00000"
    fluid.io.save_inference_model(str(out), ["w0", "w1"], [pred], exe)
    fluid.io.save_persistables(exe, str(tmp_path / "persist"))
    exe.close()
    prog, feeds, fetches = fluid.io.load_inference_model(str(out), fluid.Executor())
    assert feeds == ["w0", "w1"] and sorted(os.listdir(out)) == ["__model__.json", "params.npz"]
    got, = fluid.Executor().run(prog, feed={k: batch[k] for k in feeds}, fetch_list=fetches)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with fluid.program_guard(fluid.Program(), fluid.Program()):
        words2, pred2, _ = embedding_model(sparse=True)
        fluid.io.load_persistables(fluid.Executor(), str(tmp_path / "persist"))
        got2, = fluid.Executor().run(fluid.default_main_program().clone(for_test=True), feed=batch, fetch_list=[pred2])
    np.testing.assert_allclose(got2, want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"also need \['w1'\]"):
        fluid.io.save_inference_model(str(tmp_path / "bad"), ["w0"], [pred], exe)


def test_startup_program_reinitialises(fresh_programs):
    x, y, y_predict, avg = fit_a_line()
    w = fresh_programs.var("fc_0.w_0") if "fc_0.w_0" in fresh_programs.vars else fresh_programs.all_parameters()[0]
    first = w.value.copy()
    w.param.value[...] = 7
    fluid.Executor().run(fluid.default_startup_program())
    np.testing.assert_array_equal(w.value, first)


def test_errors_name_what_is_wrong(fresh_programs):
    x, y, y_predict, avg = fit_a_line()
    exe = fluid.Executor()
    with pytest.raises(NotInCompat, match=r"paddle\.fluid\.layers\.conv2d is not provided.*docs/migrating\.md"):
        fluid.layers.conv2d(input=x, num_filters=2, filter_size=3)
    with pytest.raises(NotInCompat, match=r"paddle\.fluid\.ParallelExecutor"):
        fluid.ParallelExecutor(use_cuda=False)
    with pytest.raises(NotInCompat, match=r"paddle\.fluid\.Variable\.astype"):
        x.astype("int64")
    with pytest.raises(NotInCompat, match=r"act='elu'"):
        fluid.layers.fc(input=x, size=2, act="elu")
    with pytest.raises(NotInCompat, match="lod_level=1"):
        fluid.layers.data(name="seq", shape=[1], dtype="int64", lod_level=1)
    with pytest.raises(ValueError, match=r"feed 'z': the program has no data variable.*\['x', 'y'\]"):
        exe.run(feed={"z": np.zeros((2, 13))}, fetch_list=[avg])
    with pytest.raises(ValueError, match=r"feed 'x': array of shape \[2, 12\], the variable has shape \[-1, 13\]"):
        exe.run(feed={"x": np.zeros((2, 12)), "y": np.zeros((2, 1))}, fetch_list=[avg])
    with pytest.raises(ValueError, match=r"square_error_cost needs 'y': feed it"):
        exe.run(feed={"x": np.zeros((2, 13))}, fetch_list=[avg])
    with pytest.raises(ValueError, match=r"sample 1 has 1 fields, feed_list has 2"):
        fluid.DataFeeder(feed_list=[x, y]).feed([(np.zeros(13), [1.0]), (np.zeros(13),)])
    with pytest.raises(NotInCompat, match="learning_rate="):
        fluid.optimizer.SGD(learning_rate=x)
    exe.close()


def test_the_package_is_node_side_only():
    """It is shipped to the nodes: importing all of it loads nothing of the launcher."""
    code = ("import sys, paddle_cluster.compat.paddle as paddle, paddle_cluster.compat.paddle.fluid as fluid; "
            "bad = [m for m in ('click', 'fabric', 'invoke', 'paramiko', 'rich', 'yaml', 'matplotlib', "
            "'paddle_cluster.launch') if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
