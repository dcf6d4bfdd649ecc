"""``fluid.DistributeTranspiler``: binds a Program to its job's pservers (``paddle_cluster.train.fluid`` does the
job side: the endpoints, trainer count and id from the arguments, completed by the launcher's contract).

``get_trainer_program()`` is the transpiled main program: running it is one parameter-server step.
``get_pserver_program(endpoint)`` + ``Executor.run`` serve that pserver with the runtime's own pserver until every
trainer has closed; there is no per-model pserver program, parameters and tables are defined by the trainers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ....train import fluid as TF
from ...missing import NotInCompat, Strict
from . import framework as F
from .executor import Session


class DistributeTranspiler(TF.DistributeTranspiler, Strict):
    _paddle_name = "paddle.fluid.DistributeTranspiler"

    def __init__(self, config: Any = None) -> None:
        if config is not None:
            raise NotInCompat("DistributeTranspiler(config=...)", "blocks are placed by the runtime")
        super().__init__()

    def transpile(self, trainer_id: Optional[int] = None, program: Optional[F.Program] = None,  # type: ignore[override]
                  pservers: Optional[str] = None, trainers: Optional[int] = None, sync_mode: bool = True,
                  startup_program: Any = None, current_endpoint: Optional[str] = None) -> None:
        """Fluid's arguments; ``pservers``/``trainers``/``trainer_id`` left out come from the launcher's contract."""
        super().transpile(trainer_id, program, pservers, trainers, sync_mode, startup_program)

    def _bind(self, program: Optional[F.Program]) -> None:  # type: ignore[override]
        assert self.env is not None
        prog = program if program is not None else F.default_main_program()
        if not isinstance(prog, F.Program):
            raise TypeError(f"transpile(program=...): expected a fluid.Program, got {type(prog).__name__}")
        origin = prog.origin
        old = origin.session
        if old is not None and old.client is not None and not old.closed:
            raise ValueError("this program is already training against pservers; exe.close() before transpiling it "
                             "again")
        self.program = prog  # type: ignore[assignment]
        origin.session = Session(origin, dataclasses.replace(self.env, role=None, pserver_id=None), self.mode)
