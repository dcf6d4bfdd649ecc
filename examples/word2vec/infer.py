"""Load a model train.py saved; print the likeliest next words of a context and/or the perplexity of a file.

    python infer.py [--model output/pass-00001] [--context "the stock market is"] [--top 10] [--file ptb.test.txt]

``--model`` defaults to the last ``output/pass-*`` directory. With neither --context nor --file it prints
the next words of a few fixed contexts. The perplexity is computed exactly as trainer 0 computes it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import List, Optional, Tuple

import imikolov
import numpy as np
from model import NgramLM, perplexity, total_nll

from paddle_cluster.ps import load_dense
from paddle_cluster.train.layers import set_dense_values, softmax

DEMO_CONTEXTS = ("the stock market is", "he said the company", "in the first quarter", "<s> <s> <s> <s>")


def latest_model(output: str = "output") -> str:
    dirs = sorted(glob.glob(os.path.join(output, "pass-[0-9]*")))
    if not dirs:
        raise FileNotFoundError(f"no {output}/pass-* directory: train first, or pass --model")
    return dirs[-1]


def load_model(path: str) -> Tuple[NgramLM, dict, dict]:
    """(model with its table, vocabulary word -> id, config) from a pass directory."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    vocab = imikolov.load_dict(os.path.join(path, imikolov.DICT_FILE))
    table = np.load(os.path.join(path, "emb.npy"), allow_pickle=False)
    model = NgramLM(len(vocab), cfg["emb_size"], cfg["hidden_size"], cfg["ngram"] - 1, cfg["act"],
                    local_table=table)
    set_dense_values(model, load_dense(os.path.join(path, "params.npz")))
    return model, vocab, cfg


def next_words(model: NgramLM, vocab: dict, context: str, top: int) -> List[Tuple[str, float]]:
    words = context.split()
    if len(words) != model.context:
        raise ValueError(f"context {context!r} has {len(words)} words; the model needs {model.context}")
    unk = vocab[imikolov.UNK]
    ids = np.array([[vocab.get(w, unk) for w in words]], dtype=np.int64)
    probs = softmax(model.logits(ids)[0].astype(np.float64))
    inv = {i: w for w, i in vocab.items()}
    best = np.argsort(-probs)[:top]
    return [(inv[int(i)], float(probs[i])) for i in best]


def file_perplexity(model: NgramLM, vocab: dict, path: str, batch: int = 1024) -> Tuple[float, int]:
    samples = imikolov.ngrams(imikolov.read_lines(path), vocab, model.context + 1)
    table = model.emb.table
    return perplexity(total_nll(model, samples, lambda ids: table[ids], batch), len(samples)), len(samples)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a pass directory (default: the last output/pass-*)")
    ap.add_argument("--context", action="append", help="N-1 words (repeatable)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--file", help="print the perplexity of this text (one sentence per line)")
    ap.add_argument("--batch", type=int, default=1024, help="evaluation batch (train.py's --eval-batch)")
    args = ap.parse_args(argv)
    try:
        path = args.model or latest_model()
        model, vocab, cfg = load_model(path)
        print(f"model {path}: {cfg['ngram']}-gram, vocabulary {len(vocab)}, emb {cfg['emb_size']}, "
              f"hidden {cfg['hidden_size']} ({cfg['act']})")
        contexts = args.context or ([] if args.file else list(DEMO_CONTEXTS))
        for c in contexts:
            best = next_words(model, vocab, c, args.top)
            print(f"{c!r} -> " + ", ".join(f"{w} {p:.3f}" for w, p in best))
        if args.file:
            ppl, n = file_perplexity(model, vocab, args.file, args.batch)
            print(f"{os.path.basename(args.file)}: {n} words")
            print(f"ppl={round(ppl, 4)}")
    except (OSError, ValueError, KeyError) as e:
        print(f"infer.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
