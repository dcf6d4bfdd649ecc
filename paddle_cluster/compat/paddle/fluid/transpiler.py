"""``fluid.DistributeTranspiler``: binds a Program to its job's pservers -- the endpoints, trainer count and id
from the arguments, completed by the launcher's contract (``JobEnv.from_environ()``).

``get_trainer_program()`` is the transpiled main program: running it is one parameter-server step.
``get_pserver_program(endpoint)`` + ``Executor.run`` serve that pserver with the runtime's own pserver until every
trainer has closed (``pserver.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

from ....contract import PSERVER, ContractError, Endpoint, JobEnv, job_secret
from ...missing import NotInCompat, Strict
from . import framework as F
from .executor import Session
from .pserver import PServerProgram, PServerStartup


def parse_endpoints(text: str) -> Tuple[Endpoint, ...]:
    """``"ip:port,ip:port"`` -> endpoints; errors name the bad item and the whole value."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"pservers={text!r}: expected a comma-separated list of HOST:PORT")
    out: List[Endpoint] = []
    for item in text.split(","):
        try:
            ep = Endpoint.parse(item)
        except ContractError as e:
            raise ValueError(f"pservers={text!r}: {e}") from None
        if ep in out:
            raise ValueError(f"pservers={text!r}: endpoint {str(ep)!r} is listed twice (several pservers on one "
                             "host need different ports: use $PADDLE_PSERVER_ENDPOINTS from the launcher)")
        out.append(ep)
    return tuple(out)


def job_env(trainer_id: Optional[int], pservers: Optional[str], trainers: Optional[int]) -> JobEnv:
    """The job ``transpile``'s arguments describe, completed from the launcher's contract."""
    base = JobEnv.from_environ()
    eps = parse_endpoints(pservers) if pservers is not None else None
    if base is None and eps is None:
        raise ValueError("transpile: no pservers given (pservers='ip:port,...') and no launcher contract in the "
                         "environment (PADDLE_PSERVER_ENDPOINTS)")
    if trainers is not None and (isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1):
        raise ValueError(f"trainers={trainers!r}: expected a positive integer")
    if base is None:
        assert eps is not None
        base = JobEnv(job_id="fluid", pservers=eps, trainers=trainers or 1, ports_num=1, ports_num_for_sparse=0,
                      secret=job_secret())
    if eps and eps != base.pservers:
        # The launcher's endpoints are the real ones; a list computed otherwise would hang on a wrong address.
        raise ValueError(f"transpile(pservers={pservers!r}): the job's pservers are "
                         f"{','.join(map(str, base.pservers))} (PADDLE_PSERVER_ENDPOINTS); pass that, or leave "
                         "pservers out to take them from the environment")
    n_trainers = base.trainers if trainers is None else trainers
    tid = trainer_id if trainer_id is not None else base.trainer_id
    if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < n_trainers):
        raise ValueError(f"trainer_id={tid!r}: expected an integer in [0, {n_trainers})")
    try:
        return dataclasses.replace(base, pservers=eps or base.pservers, trainers=n_trainers,
                                   trainer_id=tid if base.role != PSERVER else None)
    except ContractError as e:
        raise ValueError(f"transpile(pservers={pservers!r}, trainers={trainers!r}): {e}") from None


class DistributeTranspiler(Strict):
    _paddle_name = "paddle.fluid.DistributeTranspiler"

    def __init__(self, config: Any = None) -> None:
        if config is not None:
            raise NotInCompat("DistributeTranspiler(config=...)", "blocks are placed by the runtime")
        self.env: Optional[JobEnv] = None
        self.program: Optional[F.Program] = None
        self.mode = "sync"

    def transpile(self, trainer_id: Optional[int] = None, program: Optional[F.Program] = None,
                  pservers: Optional[str] = None, trainers: Optional[int] = None, sync_mode: bool = True,
                  startup_program: Any = None, current_endpoint: Optional[str] = None) -> None:
        """Fluid's arguments; ``pservers``/``trainers``/``trainer_id`` left out come from the launcher's contract.

        Like Fluid, transpiling rewrites the main program in place: running it is now a PS step."""
        self.env = job_env(trainer_id, pservers, trainers)
        self.mode = "sync" if sync_mode else "async"
        prog = program if program is not None else F.default_main_program()
        if not isinstance(prog, F.Program):
            raise TypeError(f"transpile(program=...): expected a fluid.Program, got {type(prog).__name__}")
        origin = prog.origin
        old = origin.session
        if old is not None and old.client is not None and not old.closed:
            raise ValueError("this program is already training against pservers; exe.close() before transpiling it "
                             "again")
        self.program = prog
        origin.session = Session(origin, dataclasses.replace(self.env, role=None, pserver_id=None), self.mode)

    def _env(self) -> JobEnv:
        if self.env is None:
            raise ValueError("call transpile() first")
        return self.env

    def get_trainer_program(self, wait_port: bool = True) -> F.Program:
        """The transpiled main program: running it is one PS step (``wait_port``: connecting retries anyway)."""
        self._env()
        assert self.program is not None
        return self.program

    def get_pserver_program(self, endpoint: Optional[str] = None) -> PServerProgram:
        """The program serving ``endpoint`` (default: this process's pserver per the launcher)."""
        env = self._env()
        names = ",".join(map(str, env.pservers))
        if endpoint is None:
            if env.pserver_id is None:
                raise ValueError("get_pserver_program: no endpoint given and PADDLE_PSERVER_ID is not set")
            return PServerProgram(env, env.pserver_id)
        try:
            ep = Endpoint.parse(endpoint)
        except ContractError:
            raise ValueError(f"current endpoint {endpoint!r}: expected HOST:PORT") from None
        if ep not in env.pservers:
            raise ValueError(f"current endpoint {endpoint!r} is not one of the pservers {names}")
        k = env.pservers.index(ep)
        if env.pserver_id is not None and env.pserver_id != k:
            raise ValueError(f"current endpoint {endpoint!r} is pserver {k}, but the launcher started this process "
                             f"as pserver {env.pserver_id} ({env.pservers[env.pserver_id]}); use "
                             "$PADDLE_CURRENT_ENDPOINT")
        return PServerProgram(env, k)

    def get_startup_program(self, endpoint: Optional[str] = None, pserver_program: Any = None) -> PServerStartup:
        return PServerStartup()
