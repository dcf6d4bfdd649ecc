"""The N-gram neural language model (Bengio et al. 2003, as in Paddle's word2vec/imikolov demo).

N-1 context ids -> one shared embedding table (a sparse pserver table, the same rows for every
position) -> concatenation -> Linear + tanh -> Linear over the whole vocabulary -> softmax cross-entropy.
The softmax layer is the cost: (batch x hidden x vocab) multiply-adds three times per step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from paddle_cluster.train.layers import Embedding, Layer, Linear, ReLU, Tanh

EMB_TABLE = "emb"


class NgramLM(Layer):
    def __init__(self, vocab: int, emb_size: int, hidden: int, context: int = 4, act: str = "tanh",
                 seed: int = 1, local_table: Optional[np.ndarray] = None) -> None:
        self.vocab, self.emb_size, self.hidden_size, self.context = vocab, emb_size, hidden, context
        self.emb = Embedding(EMB_TABLE, emb_size, vocab=vocab)
        self.emb.table = local_table  # set by infer.py; trainers pass pulled rows instead
        self.hidden = Linear("hidden", context * emb_size, hidden, seed=seed)
        self.act = Tanh() if act == "tanh" else ReLU()
        self.out = Linear("out", hidden, vocab, seed=seed)

    def logits(self, ctx: np.ndarray, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """(B, vocab) scores for context ids (B, N-1); ``rows`` are the table rows of ``np.unique(ctx)``."""
        e = self.emb.forward(ctx, rows)
        # The rows of the N-1 positions side by side: the concat layer, done as a free reshape.
        x = e.reshape(len(ctx), self.context * self.emb_size)
        return self.out.forward(self.act.forward(self.hidden.forward(x)))

    def train_step(self, ctx: np.ndarray, target: np.ndarray, rows: np.ndarray) -> float:
        """Forward and backward of the mean cross-entropy; grads land in the params and ``emb.sparse_grad``."""
        z = self.logits(ctx, rows)
        nll, dz = softmax_xent_(z, target, grad=True)
        dh = self.act.backward(self.out.backward(dz))
        dx = self.hidden.backward(dh)
        self.emb.backward(dx.reshape(len(ctx), self.context, self.emb_size))
        return nll / len(ctx)


def softmax_xent_(z: np.ndarray, target: np.ndarray, grad: bool = False) -> Tuple[float, Optional[np.ndarray]]:
    """Summed cross-entropy of softmax(z) (computed in place: ``z`` is overwritten) and, with ``grad``, the
    gradient of the *mean* with respect to z, in z's own buffer. In place because at batch 1024 x 10k words every
    extra temporary costs as much as the exp itself."""
    b = np.arange(len(z))
    z -= z.max(axis=1, keepdims=True)
    picked = z[b, target].astype(np.float64)
    np.exp(z, out=z)
    s = z.sum(axis=1, dtype=np.float64)
    nll = float((np.log(s) - picked).sum())
    if not grad:
        return nll, None
    z *= (1.0 / s).astype(z.dtype)[:, None]
    z[b, target] -= 1
    z *= z.dtype.type(1.0 / len(z))
    return nll, z


def total_nll(model: NgramLM, samples: np.ndarray, rows_of, batch: int = 1024) -> float:
    """Summed negative log-likelihood (nats) of the targets; ``rows_of(ids)`` gives table rows (or None)."""
    total = 0.0
    for lo in range(0, len(samples), batch):
        s = samples[lo:lo + batch]
        ctx = s[:, :-1]
        z = model.logits(ctx, rows_of(np.unique(ctx)))
        total += softmax_xent_(z, s[:, -1])[0]
    return total


def perplexity(nll: float, n: int) -> float:
    return float(np.exp(nll / max(1, n)))

