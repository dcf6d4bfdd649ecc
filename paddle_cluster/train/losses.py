"""Loss layers: ``forward(pred, target)`` returns the mean loss as a float, ``backward(dloss=1.0)`` the gradient
of the prediction, to feed the model's ``backward`` (``layers.py``)."""

from __future__ import annotations

import numpy as np

from .layers import Layer


class SquareError(Layer):
    """Mean over all elements of (pred - target)^2; backward gives d loss / d pred."""

    def forward(self, pred: np.ndarray, target: np.ndarray) -> float:
        self._diff = pred - np.asarray(target, dtype=pred.dtype).reshape(pred.shape)
        return float(np.mean(self._diff * self._diff))

    def backward(self, dloss: float = 1.0) -> np.ndarray:
        return (self._diff * (2.0 * dloss / self._diff.size)).astype(self._diff.dtype, copy=False)


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy of softmax(logits) against integer labels, fused for stability.

    ``probs`` holds the softmax of the last forward (e.g. for accuracy).
    """

    def forward(self, logits: np.ndarray, labels: np.ndarray) -> float:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if logits.ndim != 2 or len(labels) != len(logits):
            raise ValueError(f"logits {logits.shape} and labels {labels.shape} do not match")
        z = logits - logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        logp = z[np.arange(len(labels)), labels] - lse
        self.probs = np.exp(z - lse[:, None])
        self._labels = labels
        return float(-logp.mean())

    def backward(self, dloss: float = 1.0) -> np.ndarray:
        g = self.probs.copy()
        g[np.arange(len(self._labels)), self._labels] -= 1
        g *= dloss / len(self._labels)
        return g
