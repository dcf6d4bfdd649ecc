"""PTB 5-gram neural language model on the parameter server: ``python train.py --data DIR [options]``.

Run by ``paddle-cluster run --job_dispatch_package examples/word2vec -- --data DIR``; without a launcher it
starts an in-process pserver and trains alone. See README.md for the model, the data and the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import imikolov
import numpy as np
from model import EMB_TABLE, NgramLM, perplexity, total_nll

from paddle_cluster.contract import JobEnv
from paddle_cluster.ps import OptimizerSpec, PSClient, connect, load_dense
from paddle_cluster.train.layers import dense_grads, dense_values, set_dense_values, zero_grads
from paddle_cluster.train.metrics import MetricsWriter, RunningMean, write_final


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    opt = ap.add_argument
    opt("--data", required=True, help="directory with ptb.{train,valid,test}.txt and/or prepare.py's shards")
    opt("--mode", choices=("sync", "async"), default="sync")
    opt("--passes", type=int, default=2)
    opt("--batch-size", "--batch_size", type=int, default=512, help="per trainer and step")
    opt("--lr", type=float, default=0.005, help="Adam learning rate of the dense parameters")
    opt("--sparse-lr", "--sparse_lr", type=float, default=0.3, help="Adagrad learning rate of the embedding rows")
    opt("--emb-size", "--emb_size", type=int, default=32)
    opt("--hidden-size", "--hidden_size", type=int, default=128)
    opt("--act", choices=("tanh", "relu"), default="tanh")
    opt("--ngram", type=int, default=5, help="N: N-1 context words predict the next one")
    opt("--min-freq", "--min_freq", type=int, default=1, help="vocabulary: words seen at least this often")
    opt("--max-train-words", "--max_train_words", type=int, default=None,
        help="train on at most this many target words of the job (each trainer: its share's first ones)")
    opt("--init-scale", "--init_scale", type=float, default=0.1, help="embedding rows start uniform in +-this")
    opt("--eval-batch", "--eval_batch", type=int, default=1024)
    opt("--log-every", "--log_every", type=int, default=100, help="print progress every this many steps")
    opt("--seed", type=int, default=1)
    opt("--output", default="output")
    args = ap.parse_args(argv)
    if min(args.passes, args.batch_size, args.emb_size, args.hidden_size, args.eval_batch, args.log_every) < 1:
        ap.error("--passes, --batch-size, --emb-size, --hidden-size, --eval-batch and --log-every must be >= 1")
    if args.ngram < 2 or args.min_freq < 1:
        ap.error("--ngram must be >= 2 and --min-freq >= 1")
    if args.max_train_words is not None and args.max_train_words < 1:
        ap.error("--max-train-words must be >= 1")
    if args.lr <= 0 or args.sparse_lr <= 0:
        ap.error("learning rates must be > 0")
    return args


def save_model(ps: PSClient, out_dir: str, vocab: Dict[str, int], config: Dict[str, object]) -> tuple:
    """``params.npz`` (save_dense), ``emb.npy`` (every vocabulary row of the table), ``word_dict.txt`` and
    ``config.json``; returns (dense values, table) exactly as saved, so the evaluation uses what infer.py loads."""
    os.makedirs(out_dir, exist_ok=True)
    params = load_dense(ps.save_dense(out_dir))
    table = ps.pull_sparse(EMB_TABLE, np.arange(len(vocab)))
    tmp = os.path.join(out_dir, ".emb.tmp.npy")
    np.save(tmp, table)
    os.replace(tmp, os.path.join(out_dir, "emb.npy"))
    imikolov.save_dict(vocab, os.path.join(out_dir, imikolov.DICT_FILE))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return params, table


def evaluate(model: NgramLM, params: Dict[str, np.ndarray], table: np.ndarray, samples: np.ndarray,
             batch: int) -> float:
    set_dense_values(model, params)
    return perplexity(total_nll(model, samples, lambda ids: table[ids], batch), len(samples))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    started = time.time()
    env = JobEnv.from_environ()
    trainers = env.trainers if env is not None else 1
    tid = env.trainer_id if env is not None and env.trainer_id is not None else 0
    try:
        vocab, vocab_src = imikolov.load_vocab(args.data, args.min_freq)
        lines, src = imikolov.train_lines(args.data, tid, trainers)
        total = imikolov.total_train_samples(args.data)
        valid_path = imikolov.eval_path(args.data, imikolov.VALID)
        test_path = imikolov.eval_path(args.data, imikolov.TEST)
        if tid == 0 and valid_path is None:
            raise FileNotFoundError(f"{args.data}: no {imikolov.VALID} to evaluate on")
        valid = imikolov.ngrams(imikolov.read_lines(valid_path), vocab, args.ngram) if tid == 0 else None
        test = imikolov.ngrams(imikolov.read_lines(test_path), vocab, args.ngram) if tid == 0 and test_path else None
    except (OSError, ValueError) as e:
        print(f"trainer {tid}: cannot read the PTB data: {e}", file=sys.stderr, flush=True)
        return 2
    mine = imikolov.ngrams(lines, vocab, args.ngram)
    if args.max_train_words is not None:
        mine = mine[:math.ceil(args.max_train_words / trainers)]
        total = min(total, args.max_train_words)
    # Every trainer takes the same number of steps per pass (its share cut into that many batches), so
    # in sync mode all finish a pass together and nobody waits at a barrier for a trainer that stopped.
    steps = max(1, math.ceil(total / (trainers * args.batch_size)))
    print(f"trainer {tid}/{trainers}: {src}: {len(lines)} sentences, {len(mine)} samples ({steps} steps/pass of "
          f"~{math.ceil(len(mine) / steps)}); vocabulary {len(vocab)} words from {vocab_src}; mode {args.mode}",
          flush=True)

    ps = connect(mode=args.mode, optimizer=OptimizerSpec("adam", lr=args.lr))
    V = len(vocab)
    model = NgramLM(V, args.emb_size, args.hidden_size, args.ngram - 1, args.act, seed=args.seed)
    # Output bias = log unigram frequency of this shard's targets (trainer 0's values win at registration):
    # training starts at the unigram model instead of spending its first hundreds of steps finding it.
    counts = np.bincount(mine[:, -1], minlength=V) + 0.5
    model.out.bias.value[:] = np.log(counts / counts.sum())
    set_dense_values(model, ps.register_dense(dense_values(model)))
    ps.register_sparse(EMB_TABLE, args.emb_size, **model.emb.id_space(), init_scale=args.init_scale,
                       seed=args.seed, optimizer=OptimizerSpec("adagrad", lr=args.sparse_lr))
    config = {"vocab": V, "emb_size": args.emb_size, "hidden_size": args.hidden_size, "ngram": args.ngram,
              "act": args.act, "min_freq": args.min_freq, "mode": args.mode, "trainers": trainers,
              "batch_size": args.batch_size, "lr": args.lr, "sparse_lr": args.sparse_lr}
    metrics = MetricsWriter(tid)
    step, valid_ppl, test_ppl = 0, float("nan"), float("nan")
    params = table = None
    try:
        for p in range(args.passes):
            t0, nll = time.time(), RunningMean()
            rng = np.random.default_rng([args.seed, tid, p])
            t_log, nll_log = time.time(), RunningMean()
            for k, sel in enumerate(np.array_split(rng.permutation(len(mine)), steps)):
                s = mine[sel]
                ctx = s[:, :-1]
                set_dense_values(model, ps.step_values())
                zero_grads(model)
                if len(s):
                    rows = ps.pull_sparse(EMB_TABLE, np.unique(ctx))
                    loss = model.train_step(ctx, s[:, -1], rows)
                    g = model.emb.sparse_grad
                    ps.push_sparse(EMB_TABLE, g.ids, g.rows)
                else:  # a share smaller than the step count: push zeros so sync barriers still count us
                    loss = 0.0
                ps.finish_step(dense_grads(model))  # sync: one exchange brings the next step's values
                nll.add(loss, len(s))
                nll_log.add(loss, len(s))
                metrics.log(p, step, loss, samples=len(s), ppl=math.exp(min(loss, 50.0)))
                step += 1
                if (k + 1) % args.log_every == 0:
                    dt = time.time() - t_log
                    print(f"pass {p} step {k + 1}/{steps} trainer {tid}: "
                          f"train_ppl={perplexity(nll_log.total, nll_log.count):.1f} "
                          f"{nll_log.count / max(dt, 1e-9):.0f} samples/s", flush=True)
                    t_log, nll_log = time.time(), RunningMean()
            line = (f"pass {p} trainer {tid}: train_ppl={perplexity(nll.total, nll.count):.2f} "
                    f"({time.time() - t0:.1f} s)")
            if tid == 0:
                last = p == args.passes - 1
                if last and args.mode == "async":
                    ps.wait()
                    if not ps.wait_others_closed(env.barrier_timeout if env is not None else 60.0):
                        print(f"trainer {ps.trainer_id}: other trainers still running; evaluating anyway",
                              file=sys.stderr, flush=True)
                params, table = save_model(ps, os.path.join(args.output, f"pass-{p:05d}"), vocab, {**config, "pass": p})
                if not last:  # the last pass is evaluated below, after this trainer let the others go
                    valid_ppl = evaluate(model, params, table, valid, args.eval_batch)
                    metrics.log(p, step, math.log(valid_ppl), valid_ppl=valid_ppl)
                    line += f" valid_ppl={valid_ppl:.2f}"
            print(line, flush=True)
    finally:
        metrics.close()
        ps.close()
    if tid == 0:
        t_eval = time.time()
        valid_ppl = evaluate(model, params, table, valid, args.eval_batch)
        if test is not None:
            test_ppl = evaluate(model, params, table, test, args.eval_batch)
        print(f"trainer 0: valid {len(valid)} words, test {0 if test is None else len(test)} words "
              f"(evaluated in {time.time() - t_eval:.1f} s)", flush=True)
        write_final("valid_ppl", round(valid_ppl, 4), args.output)
        if test is not None:
            write_final("test_ppl", round(test_ppl, 4), args.output)
        print(f"trainer 0: {args.passes} passes, {step} steps in {time.time() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
