"""What a training script and the Fluid API (``paddle_cluster.compat.paddle.fluid``) are built on (node side:
stdlib + numpy only): ``layers`` and ``losses`` (numpy layers with exact backward passes), ``data``
(paddle.reader-style readers) and ``metrics`` (per-trainer metrics files); ``bridge`` (imported by name) is the
framework-neutral core of the PyTorch and Paddle frontends. The parameter server and its client are
``paddle_cluster.ps``.
"""

from . import data, layers, losses, metrics

__all__ = ["data", "layers", "losses", "metrics"]
