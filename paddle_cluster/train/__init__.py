"""What a training script and the Fluid API (``paddle_cluster.compat.paddle.fluid``) are built on (node side:
stdlib + numpy only): ``layers`` and ``losses`` (numpy layers with exact backward passes), ``data``
(paddle.reader-style readers) and ``metrics`` (per-trainer metrics files). The parameter server and its client
are ``paddle_cluster.ps``.
"""

from . import data, layers, losses, metrics

__all__ = ["data", "layers", "losses", "metrics"]
