"""A long job's progress in its log: every `every_s` seconds (and at the last step) one line with the
step, the loss and the throughput, so a job log read during a run (or after a crash) says how far it got
and how fast. The job's stdout is its log file (orchestrator/execute.py), so a line is a print."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class StepLog:
    def __init__(
        self, what: str, total: int, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what, self.total, self.every_s, self.clock = what, total, every_s, clock
        self.t0 = self.last = clock()

    def __call__(self, done: int, loss: float | None = None, tokens: int | None = None) -> str | None:
        """Log step `done` (of `total`) with the last step's loss and the tokens seen so far, if an interval
        has passed or it is the last step; returns the line written (None when it is not time yet)."""
        now = self.clock()
        if done < self.total and now - self.last < self.every_s:
            return None
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        parts = [f"{self.what}: step {done}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        parts.append(f"{done / elapsed:.2f} steps/s")
        if tokens is not None:
            parts.append(f"{tokens / elapsed:,.0f} tokens/s")
        line = "  ".join(parts)
        print(line, file=sys.stdout, flush=True)
        return line
