"""What a training script uses (node side: stdlib + numpy only): ``layers`` (numpy model layers with exact
backward passes), ``data`` (paddle.reader-style readers), ``metrics`` (per-trainer metrics files) and ``fluid``
(a Fluid-like ``DistributeTranspiler`` / ``Executor`` over the parameter server in ``paddle_cluster.ps``).
"""

from . import data, fluid, layers, metrics

__all__ = ["data", "fluid", "layers", "metrics"]
