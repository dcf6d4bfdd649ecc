"""Every private API (a name starting with ``_``) of PyTorch, PaddlePaddle or Python that the frontends use, in one
place: where it lives, what the frontend uses it for, and the versions it was read from. A new version may move
any of them without notice: ``tests/test_private_apis.py`` checks each one here on the installed framework
(it exists and does what the frontend relies on) and that the frontends use no private name missing here."""

from __future__ import annotations

from dataclasses import dataclass

TORCH = "torch 2.13.0"
PADDLE = "paddlepaddle 3.3.1"
PYTHON = "CPython 3.11.7 (threading._register_atexit exists since 3.9)"


@dataclass(frozen=True)
class PrivateAPI:
    """One private name: ``owner.name`` (``owner`` a class or module, dotted), what for, checked against."""

    owner: str
    name: str
    used_for: str
    checked: str


APIS = (
    PrivateAPI("torch.optim.Optimizer", "_opt_called",
               "set after each step(): an LR scheduler made on the wrapped optimizer then sees it stepped (its "
               "LRScheduler.step() warns without it, as its step() wrapper would have set it)", TORCH),
    PrivateAPI("torch.Tensor", "_version",
               "a tensor's in-place version counter: tells that a gradient changed between backward() and step() "
               "after it was sent during backward (train/overlap.py)", TORCH),
    PrivateAPI("threading", "_register_atexit",
               "shutdown() at exit runs before the client's thread pools stop (threading's exit hooks run before "
               "atexit's), so a script that just ends still tells the pservers it is done", PYTHON),
    PrivateAPI("paddle.regularizer.L2Decay", "_coeff", "an L2Decay weight decay's coefficient", PADDLE),
    PrivateAPI("paddle.optimizer.Optimizer", "_grad_clip", "the optimizer's grad_clip (a group's overrides it)",
               PADDLE),
    PrivateAPI("paddle.optimizer.Optimizer", "_default_dict",
               "the constructor's hyper-parameters (momentum, beta1, epsilon...) a parameter group does not set",
               PADDLE),
    PrivateAPI("paddle.optimizer.Optimizer", "_param_groups",
               "the parameters it trains: a list of parameters, or of parameter-group dicts", PADDLE),
    PrivateAPI("paddle.optimizer.AdamW", "_apply_decay_param_fun",
               "which parameters AdamW's decoupled weight decay applies to (None: all)", PADDLE),
    PrivateAPI("paddle.optimizer.AdamW", "_lr_ratio", "refused when set (None otherwise): a per-parameter LR ratio",
               PADDLE),
    PrivateAPI("paddle.optimizer.Adam", "_amsgrad", "Adam's and AdamW's amsgrad flag", PADDLE),
    PrivateAPI("paddle.Tensor", "_get_tensor_from_selected_rows",
               "the rows of a SelectedRows gradient (paddle.nn.Embedding(sparse=True)) as a dense tensor", PADDLE),
    PrivateAPI("paddle.Tensor", "_register_backward_hook",
               "a hook run once backward has accumulated a parameter's gradient (Paddle's own sharding overlaps "
               "with it): the gradient leaves during backward (train/overlap.py)", PADDLE),
    PrivateAPI("paddle.Tensor", "_set_grad_ivar",
               "synchronize() gives a parameter a gradient where it had none (or a SelectedRows one)", PADDLE),
)
