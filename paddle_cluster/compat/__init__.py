"""Compatibility packages for scripts written against PaddlePaddle's own API (node side: stdlib + numpy only).

``paddle_cluster.compat.paddle`` stands in for ``paddle`` and ``paddle_cluster.compat.paddle.fluid`` for
``paddle.fluid``: the seeds' scripts run after changing their two import lines. docs/migrating.md lists every
name that is there and where it lives.
"""
