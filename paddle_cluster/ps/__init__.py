"""The numpy parameter server and its client (node side: stdlib + numpy only).

Native API::

    from paddle_cluster.ps import connect, OptimizerSpec
    ps = connect(mode="sync", optimizer=OptimizerSpec("sgd", lr=0.1))
    params = ps.register_dense({"w": w0})
    ps.register_sparse("emb", width=32, vocab_size=100_000, init_scale=0.05, seed=1)
    for batch in data:
        rows = ps.pull_sparse("emb", ids)
        ps.push_sparse("emb", ids, row_grads)
        params = ps.push_pull({"w": gw})  # = ps.push({"w": gw}); params = ps.pull()
    ps.close()

``pull()`` and ``push_pull()`` return the client's own buffers (valid until the next pull); ``pull_sparse``
returns one row per id in the shape ``ids.shape + (width,)``; ``push_sparse`` sums duplicate ids. In sync
mode every step's ``push`` is a barrier across trainers; errors are typed (``BarrierTimeout`` names the
missing trainers). A pserver is ``python -m paddle_cluster.ps`` (see its docstring for the variables it reads).
"""

from .client import CheckpointInfo, PSClient, PushHandle, connect, load_dense
from .errors import (
    AuthError,
    BarrierTimeout,
    CheckpointError,
    ConfigMismatch,
    ConnectionLost,
    LimitExceeded,
    NonFinite,
    ProtocolError,
    PSError,
    RemoteError,
    UnknownKey,
)
from .optim import OptimizerSpec
from .placement import init_rows
from .server.pserver import PServer, serve

__all__ = [
    "AuthError", "BarrierTimeout", "CheckpointError", "CheckpointInfo", "ConfigMismatch", "ConnectionLost",
    "LimitExceeded", "NonFinite", "OptimizerSpec", "PSClient", "PServer", "PSError", "ProtocolError", "PushHandle",
    "RemoteError", "UnknownKey", "connect", "init_rows", "load_dense", "serve",
]
