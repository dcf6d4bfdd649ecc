"""PaddlePaddle 2.x/3.x dygraph on the pservers, Horovod-style: ``rank()``, ``size()``, ``DistributedOptimizer``
and ``Embedding``.

::

    import paddle_cluster.paddle as ppc
    model = Net()                                    # may hold ppc.Embedding tables: rows on the pservers
    opt = ppc.DistributedOptimizer(paddle.optimizer.Adam(learning_rate=1e-3, parameters=model.parameters()))
    for x, y in batches_of_this_trainer:            # each trainer its 1/size() of the global batch
        loss_fn(model(x), y).backward(); opt.step(); opt.clear_grad()
    ppc.save(model, "model.pdparams")               # trainer 0: a plain Paddle state_dict, tables included

The only module of paddle_cluster that imports paddle: a node without it still runs numpy jobs.
docs/pytorch.md (its PaddlePaddle section) describes the API, the update rules and the state kept per embedding row.
"""

from __future__ import annotations

import socket
import sys
import warnings

try:
    with warnings.catch_warnings():  # paddle's import warns that no C++ compiler cache exists: not our concern
        warnings.filterwarnings("ignore", message="No ccache found")
        import paddle  # noqa: F401
except ImportError:
    raise ImportError(f"paddle_cluster.paddle needs PaddlePaddle, which {sys.executable} on host "
                      f"{socket.gethostname()} lacks: install it there with `pip install paddlepaddle==3.3.1` "
                      "(the CPU build) or `pip install 'paddle-cluster[paddle]'`, or set PYTHON in conf.py to an "
                      "interpreter that has it") from None

from .embedding import Embedding
from .optimizer import SUPPORTED, Compression, DistributedOptimizer, rank, save, shutdown, size, state_dict
from .report import average, report

__all__ = ["SUPPORTED", "Compression", "DistributedOptimizer", "Embedding", "average", "rank", "report", "save",
           "shutdown", "size", "state_dict"]
