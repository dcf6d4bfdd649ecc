"""Gradients sent while backward runs (sync mode): a frontend's per-parameter hook (torch's
``register_post_accumulate_grad_hook``, Paddle's ``_register_backward_hook``) calls ``ready(name)`` each time a
backward pass has accumulated a parameter's gradient; once a bucket of parameters has its step's gradient, it goes
to the pservers on the channels' threads (``PSClient.push_pull_part``) and their values for the next step come back
while backward computes the earlier layers. ``step()`` then sends only what is left (parameters with no gradient
this step, flagged there, and the last bucket) and waits.

A gradient may only leave once it is final for the step, which a hook cannot know: a script may run several
backward passes before ``step()`` (gradient accumulation), call ``synchronize()``, change a gradient between
``backward()`` and ``step()`` (clip it by hand), or change a hyper-parameter there. So the first step sends
everything at ``step()``, as without overlap, and watches: a step with none of those is *plain*, and from then on
a parameter leaves at the most backward passes a plain step had. A step that does one of the other things turns
overlap off for the rest of the run, before anything left; one that does it after its gradients left (more
backward passes than any step before, a late ``synchronize()``, a gradient changed after it left) cannot be made
exact any more and fails in one line naming ``overlap=False``. Nothing here imports a framework."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Set

import numpy as np

BUCKET_BYTES = 4 << 20  # a bucket goes once this much gradient is final (the pservers' block size)

_FIX = ("pass overlap=False to DistributedOptimizer for a script whose number of backward passes per step, "
        "synchronize() calls or gradient changes between backward() and step() vary")


class Overlap:
    """One trainer's sending of its dense gradients during backward. ``grad(name)``: the parameter's gradient now
    as a numpy array (None: it has none); ``mark(name)``: what tells whether the gradient changed since (a
    tensor's identity and in-place version); ``hypers()``: the groups' hyper-parameters now (None: ``step()``
    will refuse them); ``send(grads, hypers)``: hand a bucket to the sending threads (``Bridge.send_early``)."""

    def __init__(self, nbytes: Mapping[str, int], grad: Callable[[str], Optional[np.ndarray]],
                 mark: Callable[[str], Any], hypers: Callable[[], Any],
                 send: Callable[[Dict[str, np.ndarray], Any], None], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.nbytes = dict(nbytes)
        self.grad, self.mark, self.hypers, self.send = grad, mark, hypers, send
        self.bucket_bytes = bucket_bytes
        self.on = True  # off for good once the script does what overlap cannot follow
        self.passes: Optional[int] = None  # the most backward passes a plain step had (None: no plain step yet)
        self.expected: set = set()  # the parameters that had a gradient in the last plain step
        self.buckets = 0  # buckets sent during backward, over the run (what shows that overlap happened)
        self._new_step()

    def _new_step(self) -> None:
        self.fired: Dict[str, int] = {}  # backward passes that gave each parameter a gradient this step
        self.marks: Dict[str, Any] = {}  # each parameter's gradient mark at its last hook (or when it left)
        self.pending: List[str] = []  # final for this step, not sent yet
        self.pending_bytes = 0
        self.final = 0  # parameters of ``expected`` whose gradient is final (sent or pending)
        self.sent: Set[str] = set()
        self.plain = True
        self.at_backward: Any = None  # the hyper-parameters when this step's first gradient was ready

    @property
    def active(self) -> bool:
        """This step's gradients leave during backward."""
        return self.on and self.passes is not None

    def ready(self, name: str) -> None:
        """(The hook.) A backward pass has accumulated ``name``'s gradient."""
        n = self.fired[name] = self.fired.get(name, 0) + 1
        self.marks[name] = self.mark(name)
        if self.at_backward is None:
            self.at_backward = self.hypers()
            if self.at_backward is None:  # what the step will refuse (a parameter group added behind its back)
                self.plain = False
        if not self.active or not self.plain and not self.sent:
            return
        if n > self.passes:  # type: ignore[operator]
            if name in self.sent:
                raise RuntimeError(f"DistributedOptimizer: backward pass {n} of this step added to {name}'s gradient "
                                   f"after it was sent (no step before had more than {self.passes}): {_FIX}")
            if name in self.pending:
                self.pending.remove(name)
                self.pending_bytes -= self.nbytes[name]
                self.final -= name in self.expected
            self.plain = False
            return
        if n == self.passes:
            self.pending.append(name)
            self.pending_bytes += self.nbytes[name]
            self.final += name in self.expected
            if self.pending_bytes >= self.bucket_bytes or self.final == len(self.expected):
                self._flush()

    def _flush(self) -> None:
        bucket = {}
        for name in self.pending:
            g = self.grad(name)
            if g is not None:
                bucket[name] = g
                self.marks[name] = self.mark(name)
        self.pending, self.pending_bytes = [], 0
        if bucket:
            self.send(bucket, self.at_backward)
            self.buckets += 1
            self.sent.update(bucket)

    def before_sync(self) -> None:
        """``synchronize()``: the step's gradients go averaged; refused once some left already."""
        if self.sent:
            raise RuntimeError(f"DistributedOptimizer.synchronize(): this step's gradients were sent during "
                               f"backward already (no step before called synchronize()): {_FIX}")
        self.on = False

    def before_zero_grad(self) -> None:
        """``zero_grad()``/``clear_grad()``: a step's passes start again; refused once some gradients left."""
        if self.sent:
            raise RuntimeError(f"DistributedOptimizer: gradients cleared after this step's were sent during "
                               f"backward: {_FIX}")
        self._new_step()

    def before_step(self, hypers: Any) -> None:
        """At ``step()``, before the rest is sent (``hypers``: the groups' hyper-parameters now). Refused (one
        line) where what left is no longer the step's gradient; otherwise a step that was not plain turns overlap
        off."""
        changed = [n for n, m in self.marks.items() if m != self.mark(n)]
        hypers_changed = self.at_backward is not None and hypers != self.at_backward
        if self.sent and (changed or hypers_changed):
            what = f"the gradients of {', '.join(changed)} changed" if changed else "a hyper-parameter changed"
            raise RuntimeError(f"DistributedOptimizer.step(): {what} between backward() and step(), after the "
                               f"gradients were sent (no step before did): {_FIX}")
        if changed or hypers_changed or not self.plain:
            self.on = False

    def after_step(self) -> None:
        """The step is done: a plain one teaches how many backward passes make a step's gradients final."""
        if self.on and self.plain and self.fired:
            n = max(self.fired.values())
            if self.passes is None or n >= self.passes:  # fewer (an epoch's last, short accumulation) teach nothing
                self.passes = n
                self.expected = {name for name, k in self.fired.items() if k == n}
        self._new_step()
