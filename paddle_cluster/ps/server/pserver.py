"""The pserver: wires its sockets (``net``), shards (``shards``), barriers (``sync``) and request handlers
(``handlers``) together, and owns its lifecycle: ``start``, ``wait``, ``stop``. ``serve`` runs one pserver
of a job the way ``python -m paddle_cluster.ps`` does.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from ...contract import DEFAULT_MAX_CONNECTIONS, ContractError, JobEnv, ProcessEnv, check_secret, figures_path
from .. import checkpoint as ckpt
from ..counters import FiguresWriter
from ..errors import CheckpointError, LimitExceeded
from ..wire import protocol as P
from ..wire.lane import Desk
from . import handlers
from .budget import Budget, default_limit, human
from .dense import DenseShared
from .net import Conn, Listener
from .resume import resolve_resume, restore
from .state import State
from .sync import Sync

log = logging.getLogger("paddle_cluster.ps")


def make_budget(env: JobEnv, pserver_id: int, memory: int = 0) -> Budget:
    """Pserver ``pserver_id``'s memory budget: ``memory`` bytes (PADDLE_PSERVER_MEMORY), else its share of the node."""
    here = sum(1 for e in env.pservers if e.host == env.pservers[pserver_id].host)
    return Budget(memory or default_limit(here), pserver_id, "PADDLE_PSERVER_MEMORY" if memory else
                  f"default: half of this node's memory over its {here} pserver(s)")


class PServer:
    """Pserver ``pserver_id`` of the job described by ``env``.

    ``resume`` is a loaded checkpoint shard (see ``resume.resolve_resume``). ``ports`` overrides the
    contract's ports (0 = any free port), which the in-process local mode uses.
    """

    def __init__(self, env: JobEnv, pserver_id: int, *, resume: Optional[ckpt.ShardState] = None,
                 checkpoint_root: Optional[str] = None, max_frame: int = P.DEFAULT_MAX_FRAME_BYTES,
                 host: Optional[str] = None, ports: Optional[Tuple[int, ...]] = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, memory: int = 0,
                 allow_nonfinite: bool = False) -> None:
        self.env = env
        self.pserver_id = pserver_id
        check_secret(env.secret)  # refuses an empty or short one (ContractError)
        if not env.integrity:
            log.info("pserver %d: frame integrity is off (PADDLE_INTEGRITY=0): frames carry no MAC", pserver_id)
        budget = make_budget(env, pserver_id, memory)
        self.done = threading.Event()
        self.sync = Sync(pserver_id, env.trainers, env.barrier_timeout, self.done)
        self.state = st = State(pserver_id, len(env.pservers), env.trainers, int(max_frame),
                                checkpoint_root or ckpt.default_root(env.job_dir), budget, allow_nonfinite,
                                self.sync, DenseShared.make(self.sync, not allow_nonfinite, budget), self.done)
        if resume is not None:
            self.sync.mode, st.optimizer, st.base_step = resume.mode, resume.optimizer, resume.step
            st.resumed_from = resume.path
            st.blocks, st.tables = restore(resume, st.dense, budget, env.trainers)
            log.info("pserver %d: resumed from %s (step %d, %d blocks, %d tables)", pserver_id, resume.path,
                     resume.step, len(st.blocks), len(st.tables))
        self.net = Listener(env, pserver_id, host or env.pservers[pserver_id].host,
                            tuple(ports) if ports is not None else env.all_ports(pserver_id), st.max_frame,
                            self._handle, self.sync.touch, self.done, max_connections, budget)
        log.info("pserver %d: memory budget %s (%s)%s", pserver_id, human(budget.limit), budget.source,
                 "; NaN/Inf gradients accepted (PADDLE_ALLOW_NONFINITE=1)" if allow_nonfinite else "")

    @property
    def host(self) -> str:
        return self.net.host

    @property
    def ports(self) -> Tuple[int, ...]:
        """The ports listened on (after ``start``)."""
        return self.net.ports

    def figures(self) -> Dict[str, Any]:
        """What ``top`` shows of this pserver besides its traffic: its step (its slowest shard's), the table
        rows and the bytes it holds against its memory budget."""
        st = self.state
        blocks, tables = list(st.blocks.values()), list(st.tables.values())  # copies: handlers add to them
        steps = [s.step.n for s in blocks + tables]
        return {"step": min(steps) if steps else None, "blocks": len(blocks), "tables": len(tables),
                "rows": sum(t.n for t in tables), "held": st.budget.used, "budget": st.budget.limit}

    def _handle(self, conn: Conn, h: P.Header) -> bool:
        return handlers.route(self.state, conn, h)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> PServer:
        """Bind every port (all or nothing) and start accepting."""
        self.net.start()
        desk = Desk(self.env.job_id, self.pserver_id, self.ports[0], self.env.key_of, self.env.trainers,
                    self.state.budget.charge, self.state.budget.release)
        try:
            desk.start()
            self.state.lanes = desk
        except OSError as e:  # the trainers on this node stay on TCP
            log.warning("pserver %d: no same-host lanes: cannot listen on the lane socket: %s", self.pserver_id,
                        e.strerror or e)
        return self

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every trainer has closed (or ``stop``); True if so."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        self.done.set()
        self.state.dense.applier.shutdown(wait=False)
        with self.sync.lock:
            self.sync.lock.notify_all()
        self.net.stop()
        if self.state.lanes is not None:
            self.state.lanes.stop()
        for shard in self.state.shards():
            with shard.cv:
                shard.wake()


def serve(env: JobEnv, proc: ProcessEnv = ProcessEnv()) -> int:
    """Run pserver ``env.pserver_id`` until every trainer has closed or SIGTERM/SIGINT; returns the exit code
    of ``python -m paddle_cluster.ps`` (0 done; 2 no usable secret; 3 the requested checkpoint is unusable or
    none was found; 4 cannot listen)."""
    k = env.pserver_id
    if k is None:
        raise ValueError("serve() needs the contract of one pserver (JobEnv.for_process(PSERVER, ...))")
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, proc.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s pserver[{k}] %(levelname)s %(message)s")
    root = env.checkpoint_dir or ckpt.default_root(env.job_dir)
    try:
        shard = resolve_resume(env.resume, root, k, len(env.pservers), make_budget(env, k, proc.pserver_memory).limit,
                               not proc.allow_nonfinite)
    except (CheckpointError, ValueError) as e:
        log.error("cannot resume (%s): %s", env.resume, e)
        return 3
    if env.resume and shard is None:  # asked to resume: a fresh start would throw the progress away unasked
        log.error("cannot resume (%s): no checkpoint under %s (no step-NNNNNNNN directory with this pserver's "
                  "shard pserver-%d/%s); not starting fresh: name a job or directory that holds a complete "
                  "checkpoint, or leave out --resume_from (PADDLE_RESUME) to start fresh", env.resume, root, k,
                  ckpt.MANIFEST)
        return 3
    try:
        server = PServer(env, k, resume=shard, checkpoint_root=root, max_frame=proc.max_frame_bytes,
                         max_connections=proc.max_connections, memory=proc.pserver_memory,
                         allow_nonfinite=proc.allow_nonfinite)
    except ContractError as e:
        log.error("%s", e)
        return 2
    except (LimitExceeded, CheckpointError) as e:
        log.error("cannot resume from %s: %s", shard.path if shard else "?", e)
        return 3
    del shard  # the loaded copy: the pserver holds its own arrays now
    try:
        server.start()
    except OSError as e:
        log.error("%s", e)
        return 4

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"PSERVER_READY {k} {server.host} {','.join(map(str, server.ports))}", flush=True)
    figures = FiguresWriter(figures_path(env.job_dir, f"pserver.{k}"), server.figures).start() if env.job_dir \
        else None
    while not server.wait(0.5):  # a short wait, so the signal handlers run promptly
        pass
    server.stop()
    if figures is not None:
        figures.stop()
    return 0
