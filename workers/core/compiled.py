"""Small pure functions (elementwise arithmetic and its row reductions) through torch.compile, eager as
the fallback.

Eager torch runs each elementwise op as its own pass over memory; on a GPU, a chain of them over a large
buffer costs more than the matmul that produced it. Compiled, the chain is one or a few fused kernels.
Each function is compiled once per process (dynamic shapes: chunks of any length share one graph). Where it
cannot compile (no compiler, an unsupported op), the first failure is a warning naming the function and
the error, and every later call returns None at once, so the caller runs its eager path.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

_FAILED: dict[str, str] = {}  # function -> its first compile error: called eagerly from then on


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=True, fullgraph=True)


def call_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) through its compiled version; None when it cannot compile here (warned once per function)."""
    name = fn.__qualname__
    if name in _FAILED:
        return None
    try:
        return _compiled(fn)(*args)
    except Exception as exc:  # a compiler missing or failing: the caller's eager path gives the same values
        _FAILED[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        warnings.warn(f"compiled {name} unavailable ({_FAILED[name]}); eager", stacklevel=2)
        return None
