"""The arguments a framework's ``nn.Embedding`` takes, checked for an ``Embedding`` whose rows live on the
pservers: ``padding_idx`` is honoured (``padding_index``), an option that cannot be is refused in one line
(``refuse``)."""

from __future__ import annotations

from typing import Any, Optional


def padding_index(cls: str, num_embeddings: int, padding_idx: Optional[int]) -> Optional[int]:
    """``padding_idx`` as a row id (a negative one counts from the end, as torch and Paddle do); ValueError
    (one line) outside ``[-num_embeddings, num_embeddings)``."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or \
            not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"{cls}: padding_idx={padding_idx!r} must be an integer in [-{num_embeddings}, "
                         f"{num_embeddings}) (num_embeddings={num_embeddings})")
    return padding_idx % num_embeddings


def refuse(cls: str, **given: Any) -> None:
    """ValueError (one line) naming the first option given a value the pservers cannot honour (the value is
    anything but None/False), and why."""
    why = {
        "max_norm": "it renormalises the looked-up rows in place, a write the pservers' rows do not take; clip or "
                    "normalise the output instead",
        "scale_grad_by_freq": "it scales each row's gradient by its count in the batch of one trainer, not of the "
                              "job",
        "_weight": "the rows are created on the pservers from (seed, id); give init_scale and seed instead",
        "_freeze": "a frozen table needs no pserver: use the framework's own Embedding",
        "weight_attr": "the rows are created on the pservers from (seed, id); give init_scale and seed instead",
    }
    for k, v in given.items():
        if v is not None and v is not False:
            shown = repr(v) if isinstance(v, (bool, int, float)) else f"<{type(v).__name__}>"  # a tensor: one line
            raise ValueError(f"{cls}({k}={shown}) is not supported: {why[k]}")
