"""PyTorch on the pservers, Horovod-style: ``rank()``, ``size()``, ``DistributedOptimizer`` and ``Embedding``.

::

    import paddle_cluster.torch as pct
    model = Net()                                    # may hold pct.Embedding tables: rows on the pservers
    opt = pct.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    for x, y in batches_of_this_trainer:            # each trainer its 1/size() of the global batch
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    pct.save(model, "model.pt")                      # trainer 0: a plain torch state_dict, tables included

The only module of paddle_cluster that imports torch: a node without it still runs numpy jobs. docs/pytorch.md
describes the API, the update rules and the state kept per embedding row.
"""

from __future__ import annotations

import socket
import sys

try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError(f"paddle_cluster.torch needs PyTorch, which {sys.executable} on host {socket.gethostname()} "
                      "lacks: install it there with `pip install torch==2.13.0` (the CPU build) or "
                      "`pip install 'paddle-cluster[torch]'`, or set PYTHON in conf.py to an interpreter that has "
                      "it") from None

from .embedding import Embedding
from .optimizer import SUPPORTED, Compression, DistributedOptimizer, rank, save, shutdown, size, state_dict
from .report import average, report

__all__ = ["SUPPORTED", "Compression", "DistributedOptimizer", "Embedding", "average", "rank", "report", "save",
           "shutdown", "size", "state_dict"]
