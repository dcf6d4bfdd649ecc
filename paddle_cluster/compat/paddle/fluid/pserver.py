"""What a pserver process runs in a Fluid script: ``get_pserver_program`` and ``get_startup_program``'s programs.

There is no per-model pserver program: ``Executor.run`` of a ``PServerProgram`` serves with the runtime's own
pserver (``paddle_cluster.ps.serve``) until every trainer has closed; parameters and tables are defined by the
trainers. Its startup program has nothing to initialise.
"""

from __future__ import annotations

from ....contract import PSERVER, JobEnv, ProcessEnv
from ....ps.server.pserver import serve


class PServerProgram:
    """Serving pserver ``pserver_id`` of ``env``."""

    def __init__(self, env: JobEnv, pserver_id: int) -> None:
        self.env = env
        self.pserver_id = pserver_id

    def serve(self) -> None:
        host = self.env.pservers[self.pserver_id].host
        code = serve(self.env.for_process(PSERVER, self.pserver_id, host), ProcessEnv.from_environ())
        if code:
            raise SystemExit(code)  # the entry point's documented exit codes; it has logged why


class PServerStartup:
    """A pserver's startup program: running it does nothing."""
