"""The settings of a DCDM run (Algorithm 2 of the C2F/DCDM paper), torch-free: the sweep schema checks a
`dcdm` section with them (orchestrator/stages/dcdm.py), the DCDM run builds its spec from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

W0_RULES = ("uniform", "tokens")
METRICS = ("kl", "log_ppl")


@dataclass
class DCDMSpec:
    """The settings of one DCDM run (torch-free checks: the sweep schema validates them with it)."""

    w0: str = "uniform"
    metric: str = "kl"
    temperature: float = 1.0
    max_iters: int = 10
    tol: float = 1e-3
    n_eval: int = 16
    seq_len: int = 128
    batch_size: int = 8
    seed: int = 4321

    def __post_init__(self) -> None:
        if self.w0 not in W0_RULES:
            raise ValueError(f"w0={self.w0!r}: allowed {', '.join(W0_RULES)}")
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}: allowed {', '.join(METRICS)}")
        if not (
            isinstance(self.temperature, int | float)
            and math.isfinite(self.temperature)
            and self.temperature > 0
        ):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number > 0")
        if not (isinstance(self.tol, int | float) and math.isfinite(self.tol) and self.tol >= 0):
            raise ValueError(f"tol={self.tol!r}: must be a finite number >= 0")
        for name in ("max_iters", "n_eval", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a positive integer")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len!r}: must be an integer >= 2")
