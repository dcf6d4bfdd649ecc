"""A small Fluid-like API over the parameter-server runtime, so seed 003's quick start ports with few changes.

There is no graph compiler: a ``Program`` wraps a model built from ``paddle_cluster.train.layers``, a loss
layer and an optimizer, and running its trainer side does pull -> forward -> backward -> push per step.
Node side: stdlib + numpy + ``paddle_cluster.ps`` only.

==============================================  ================================================================
Fluid (seed 003)                                here
==============================================  ================================================================
``fluid.layers.data`` / ``fc`` / ``mean(...)``  ``Program(model, loss, inputs="x", label="y")`` with the model a
                                                ``train.layers`` layer (e.g. ``Linear``) and the loss a loss
                                                layer (``SquareError`` is ``mean(square_error_cost(...))``)
``fluid.optimizer.SGD(lr).minimize(avg_loss)``  ``fluid.optimizer.SGD(lr).minimize(program)`` (also ``Momentum``,
                                                ``Adagrad``, ``Adam``): an ``OptimizerSpec`` the pservers run
``fluid.DataFeeder(feed_list=[x, y])``          ``DataFeeder(feed_list=["x", "y"])``: samples -> ``{name: array}``
``fluid.Executor(place)``, ``CPUPlace()``       the same; ``run(program, feed, fetch_list)`` with fetch names
                                                ``"loss"`` and ``"prediction"``
``DistributeTranspiler().transpile(...)``       the same arguments (``trainer_id``, ``program``, ``pservers``,
                                                ``trainers``, ``sync_mode``); left out, they come from the
                                                launcher's contract (``JobEnv.from_environ()``)
``get_pserver_program(ep)`` + ``exe.run``       serves pserver ``ep`` with the runtime's pserver entry point
                                                (``paddle_cluster.ps.server.serve``) until every trainer closed
``get_trainer_program()`` + ``exe.run``         one synchronous or asynchronous PS step per call
``default_startup_program()``                   a no-op: trainer 0's initial values (or a resumed checkpoint)
                                                initialise the pservers on the first step
``exe.close()``                                 closes the trainer on every pserver (``PSClient.close``)
``fluid.io.save_params`` / ``load_params``      ``params.npz`` in a directory (``PSClient.save_dense`` format)
``main.clone(for_test=True)``                   forward only; a transpiled program's clone first pulls the
                                                newest parameters from the pservers
==============================================  ================================================================

Running a ``Program`` that was never transpiled trains locally against an in-process pserver (the runtime's
``connect()`` with no contract), so a script also runs without a launcher.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..contract import PSERVER, ContractError, Endpoint, JobEnv, ProcessEnv, job_secret
from ..ps import atomic
from ..ps.client import PSClient, connect, load_dense
from ..ps.optim import OptimizerSpec
from ..ps.server import serve
from . import layers as L

FETCHABLE = ("loss", "prediction")


class FluidError(ValueError):
    """Misuse of this API; the message names the bad value."""


class CPUPlace:
    """Accepted for compatibility; everything runs on the CPU."""


# -- optimizers ------------------------------------------------------------------------------------------


class Optimizer:
    """Base of the Fluid optimizer classes: a name and hyper-parameters for the pservers' optimizer."""

    def __init__(self, name: str, learning_rate: float, **hyper: float) -> None:
        self.spec = OptimizerSpec(name=name, lr=learning_rate, **hyper)

    def minimize(self, program: Program) -> Program:
        """Attach this optimizer to ``program`` (Fluid appended optimizer ops to the main program)."""
        if not isinstance(program, Program):
            raise FluidError(f"minimize() takes the Program to train, got {type(program).__name__}")
        program.optimizer = self.spec
        return program


class SGD(Optimizer):
    def __init__(self, learning_rate: float, regularization: float = 0.0) -> None:
        super().__init__("sgd", learning_rate, weight_decay=regularization)


class Momentum(Optimizer):
    def __init__(self, learning_rate: float, momentum: float = 0.9, regularization: float = 0.0) -> None:
        super().__init__("momentum", learning_rate, momentum=momentum, weight_decay=regularization)


class Adagrad(Optimizer):
    def __init__(self, learning_rate: float, epsilon: float = 1e-6, regularization: float = 0.0) -> None:
        super().__init__("adagrad", learning_rate, eps=epsilon, weight_decay=regularization)


class Adam(Optimizer):
    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, regularization: float = 0.0) -> None:
        super().__init__("adam", learning_rate, beta1=beta1, beta2=beta2, eps=epsilon, weight_decay=regularization)


# ``fluid.optimizer.SGD`` as in Fluid.
optimizer = SimpleNamespace(SGD=SGD, Momentum=Momentum, Adagrad=Adagrad, Adam=Adam)


# -- programs --------------------------------------------------------------------------------------------


class StartupProgram:
    """Fluid's startup programs: nothing to run here (see the module docstring)."""


_default_startup = StartupProgram()
_default_main: Optional[Program] = None


def default_startup_program() -> StartupProgram:
    return _default_startup


def default_main_program() -> Program:
    if _default_main is None:
        raise FluidError("no Program has been created yet")
    return _default_main


class Program:
    """A model, its loss and its optimizer; ``model.forward(*feed[inputs])`` then ``loss(pred, feed[label])``.

    The newest Program created is the default main program (``transpile`` uses it when given none).
    """

    def __init__(self, model: L.Layer, loss: Optional[L.Layer] = None, inputs: Union[str, Sequence[str]] = "x",
                 label: Optional[str] = "y") -> None:
        global _default_main
        self.model = model
        self.loss = loss if loss is not None else L.SquareError()
        self.inputs: Tuple[str, ...] = (inputs,) if isinstance(inputs, str) else tuple(inputs)
        self.label = label
        self.optimizer: Optional[OptimizerSpec] = None
        self.for_test = False
        self._origin: Program = self
        self._trainer: Optional[TrainerProgram] = None
        _default_main = self

    def clone(self, for_test: bool = False) -> Program:
        """A program sharing this one's model (and, once transpiled, its pservers)."""
        c = object.__new__(Program)
        c.__dict__.update(self.__dict__)
        c.for_test = for_test
        c._origin = self._origin
        c._trainer = None  # only the origin's counts
        return c

    def forward(self, feed: Mapping[str, Any]) -> Tuple[np.ndarray, Optional[float]]:
        """The prediction and, if the feed has the label, the loss."""
        missing = [n for n in self.inputs if n not in feed]
        if missing:
            raise FluidError(f"feed has no {', '.join(map(repr, missing))}; it has {sorted(feed)}")
        pred = self.model.forward(*(np.asarray(feed[n]) for n in self.inputs))
        if self.label is None or self.label not in feed:
            return pred, None
        return pred, self.loss.forward(pred, feed[self.label])

    def backward(self) -> None:
        """Gradients of the last ``forward``'s loss, accumulated into the model's parameters."""
        self.model.backward(self.loss.backward(1.0))


class TrainerProgram:
    """The trainer side of a transpiled ``Program``: connects on its first step, one PS step per run.

    ``env`` None means a local in-process pserver (one trainer).
    """

    def __init__(self, program: Program, env: Optional[JobEnv], mode: str) -> None:
        if program.optimizer is None:
            raise FluidError("the program has no optimizer: call optimizer.minimize(program) before transpiling")
        self.program = program
        self.env = env
        self.mode = mode
        self.client: Optional[PSClient] = None
        self.closed = False

    def _connect(self) -> PSClient:
        if self.closed:
            raise FluidError("this trainer program was closed (exe.close()); it cannot run again")
        if self.client is None:
            self.client = connect(self.mode, self.program.optimizer, env=self.env)
            start = self.client.register_dense(L.dense_values(self.program.model))
            L.set_dense_values(self.program.model, start)
        return self.client

    def refresh(self) -> None:
        """Copy the pservers' newest parameters into the model (a no-op before the first step)."""
        if self.client is not None and not self.closed:
            L.set_dense_values(self.program.model, self.client.pull())

    def step(self, feed: Mapping[str, Any]) -> Tuple[np.ndarray, Optional[float]]:
        ps = self._connect()
        L.set_dense_values(self.program.model, ps.step_values())
        L.zero_grads(self.program.model)
        pred, loss = self.program.forward(feed)
        if loss is None:
            raise FluidError(f"a training step needs the label {self.program.label!r} in the feed")
        self.program.backward()
        ps.finish_step(L.dense_grads(self.program.model))
        return pred, loss

    def save(self, dirname: str) -> str:
        return self._connect().save_dense(dirname)

    def close(self) -> None:
        if self.client is not None and not self.closed:
            self.client.close()
        self.closed = True


class PServerProgram:
    """Serving pserver ``pserver_id`` of ``env``; ``Executor.run`` returns once every trainer has closed."""

    def __init__(self, env: JobEnv, pserver_id: int) -> None:
        self.env = env
        self.pserver_id = pserver_id

    def serve(self) -> None:
        host = self.env.pservers[self.pserver_id].host
        code = serve(self.env.for_process(PSERVER, self.pserver_id, host), ProcessEnv.from_environ())
        if code:
            raise SystemExit(code)  # the entry point's documented exit codes; it has logged why


# -- transpiler ------------------------------------------------------------------------------------------


def parse_endpoints(text: str) -> Tuple[Endpoint, ...]:
    """``"ip:port,ip:port"`` -> endpoints; errors name the bad item and the whole value."""
    if not isinstance(text, str) or not text.strip():
        raise FluidError(f"pservers={text!r}: expected a comma-separated list of HOST:PORT")
    out: List[Endpoint] = []
    for item in text.split(","):
        try:
            ep = Endpoint.parse(item)
        except ContractError as e:
            raise FluidError(f"pservers={text!r}: {e}") from None
        if ep in out:
            raise FluidError(f"pservers={text!r}: endpoint {str(ep)!r} is listed twice (several pservers on one "
                             "host need different ports: use $PADDLE_PSERVER_ENDPOINTS from the launcher)")
        out.append(ep)
    return tuple(out)


class DistributeTranspiler:
    """Splits a Program into its pserver and trainer sides (here: binds it to a job's pservers)."""

    def __init__(self) -> None:
        self.env: Optional[JobEnv] = None
        self.program: Optional[Program] = None
        self.mode = "sync"

    def transpile(self, trainer_id: Optional[int] = None, program: Optional[Program] = None,
                  pservers: Optional[str] = None, trainers: Optional[int] = None, sync_mode: bool = True,
                  startup_program: Any = None) -> None:
        """Anything not given comes from the launcher's contract in the environment."""
        self.env = self._job_env(trainer_id, pservers, trainers)
        self.mode = "sync" if sync_mode else "async"
        self._bind(program)

    def _job_env(self, trainer_id: Optional[int], pservers: Optional[str], trainers: Optional[int]) -> JobEnv:
        """The job the arguments describe, completed from the launcher's contract."""
        base = JobEnv.from_environ()
        eps = parse_endpoints(pservers) if pservers is not None else None
        if base is None and eps is None:
            raise FluidError("transpile: no pservers given (pservers='ip:port,...') and no launcher contract in "
                             "the environment (PADDLE_PSERVER_ENDPOINTS)")
        if trainers is not None and (isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1):
            raise FluidError(f"trainers={trainers!r}: expected a positive integer")
        if base is None:
            assert eps is not None
            base = JobEnv(job_id="fluid", pservers=eps, trainers=trainers or 1, ports_num=1, ports_num_for_sparse=0,
                          secret=job_secret())
        if eps and eps != base.pservers:
            # The launcher's endpoints are the real ones; a list computed otherwise would hang on a wrong address.
            raise FluidError(f"transpile(pservers={pservers!r}): the job's pservers are "
                             f"{','.join(map(str, base.pservers))} (PADDLE_PSERVER_ENDPOINTS); pass that, or leave "
                             "pservers out to take them from the environment")
        n_trainers = base.trainers if trainers is None else trainers
        tid = trainer_id if trainer_id is not None else base.trainer_id
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < n_trainers):
            raise FluidError(f"trainer_id={tid!r}: expected an integer in [0, {n_trainers})")
        try:
            return dataclasses.replace(base, pservers=eps or base.pservers, trainers=n_trainers,
                                       trainer_id=tid if base.role != PSERVER else None)
        except ContractError as e:
            raise FluidError(f"transpile(pservers={pservers!r}, trainers={trainers!r}): {e}") from None

    def _bind(self, program: Optional[Program]) -> None:
        """Like Fluid, transpiling rewrites the main program in place: running it is now a PS step."""
        assert self.env is not None
        self.program = program if program is not None else default_main_program()
        old = self.program._origin._trainer
        if old is not None and old.client is not None and not old.closed:
            raise FluidError("this program is already training against pservers; exe.close() before transpiling "
                             "it again")
        trainer_env = dataclasses.replace(self.env, role=None, pserver_id=None)
        self.program._origin._trainer = TrainerProgram(self.program._origin, trainer_env, self.mode)

    def _env(self) -> JobEnv:
        if self.env is None:
            raise FluidError("call transpile() first")
        return self.env

    def get_trainer_program(self, wait_port: bool = True) -> Program:
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
                raise FluidError("get_pserver_program: no endpoint given and PADDLE_PSERVER_ID is not set")
            return PServerProgram(env, env.pserver_id)
        try:
            ep = Endpoint.parse(endpoint)
        except ContractError:
            raise FluidError(f"current endpoint {endpoint!r}: expected HOST:PORT") from None
        if ep not in env.pservers:
            raise FluidError(f"current endpoint {endpoint!r} is not one of the pservers {names}")
        k = env.pservers.index(ep)
        if env.pserver_id is not None and env.pserver_id != k:
            raise FluidError(f"current endpoint {endpoint!r} is pserver {k}, but the launcher started this "
                             f"process as pserver {env.pserver_id} ({env.pservers[env.pserver_id]}); use "
                             "$PADDLE_CURRENT_ENDPOINT")
        return PServerProgram(env, k)

    def get_startup_program(self, endpoint: Optional[str] = None, pserver_program: Any = None) -> StartupProgram:
        return _default_startup


# -- feeding, running, saving ----------------------------------------------------------------------------


class DataFeeder:
    """Turns a batch of samples (tuples in ``feed_list`` order) into ``{name: float array (batch, -1)}``."""

    def __init__(self, feed_list: Sequence[str], place: Any = None, dtype: Any = np.float32) -> None:
        self.names = list(feed_list)
        self.dtype = dtype

    def feed(self, batch: Sequence[Sequence[Any]]) -> Dict[str, np.ndarray]:
        if not batch:
            raise FluidError("DataFeeder.feed: empty batch")
        if len(batch[0]) != len(self.names):
            raise FluidError(f"DataFeeder.feed: samples have {len(batch[0])} fields, feed_list names "
                             f"{len(self.names)} ({self.names})")
        return {n: np.asarray([s[i] for s in batch], dtype=self.dtype).reshape(len(batch), -1)
                for i, n in enumerate(self.names)}


class Executor:
    """Runs programs: a startup program (no-op), a pserver program (serves), a trainer or test program."""

    def __init__(self, place: Any = None) -> None:
        self._trainers: List[TrainerProgram] = []

    def run(self, program: Any = None, feed: Optional[Mapping[str, Any]] = None,
            fetch_list: Sequence[str] = ()) -> List[np.ndarray]:
        if program is None:
            program = default_main_program()
        if isinstance(program, StartupProgram):
            return []
        if isinstance(program, PServerProgram):
            program.serve()
            return []
        if not isinstance(program, Program):
            raise FluidError(f"Executor.run: cannot run a {type(program).__name__}")
        bad = [f for f in fetch_list if f not in FETCHABLE]
        if bad:
            raise FluidError(f"fetch_list {bad}: can fetch {', '.join(FETCHABLE)}")
        feed = feed or {}
        if program.for_test:
            trainer = program._origin._trainer
            if trainer is not None:
                trainer.refresh()
            pred, loss = program.forward(feed)
        else:
            trainer = program._origin._trainer
            if trainer is None:  # never transpiled: train against an in-process pserver
                trainer = program._origin._trainer = TrainerProgram(program._origin, None, "sync")
            if trainer not in self._trainers:
                self._trainers.append(trainer)
            pred, loss = trainer.step(feed)
        out = []
        for name in fetch_list:
            if name == "loss":
                if loss is None:
                    raise FluidError(f"fetching 'loss' needs the label {program.label!r} in the feed")
                out.append(np.asarray([loss], dtype=pred.dtype))
            else:
                out.append(np.array(pred))
        return out

    def close(self) -> None:
        """Tell every pserver that this trainer is done, so sync barriers stop waiting for it."""
        for t in self._trainers:
            t.close()
        self._trainers.clear()


def save_params(executor: Optional[Executor], dirname: str, main_program: Optional[Program] = None) -> str:
    """Write the dense parameters to ``dirname/params.npz`` (pulled from the pservers when transpiled)."""
    program = main_program if main_program is not None else default_main_program()
    trainer = program._origin._trainer
    if trainer is not None and trainer.client is not None:
        return trainer.save(dirname)
    path = os.path.join(dirname, "params.npz")
    atomic.save_npz_atomic(path, L.dense_values(program.model))
    return path


def load_params(executor: Optional[Executor], dirname: str, main_program: Optional[Program] = None) -> None:
    """Load what ``save_params`` wrote into the program's model."""
    program = main_program if main_program is not None else default_main_program()
    path = dirname if dirname.endswith(".npz") else os.path.join(dirname, "params.npz")
    L.set_dense_values(program.model, load_dense(path))


# ``fluid.io.save_params`` as in Fluid.
io = SimpleNamespace(save_params=save_params, load_params=load_params)
