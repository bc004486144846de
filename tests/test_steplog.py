"""Long jobs write their step, loss and throughput to their log at a steady interval."""

from __future__ import annotations

from workers.core.steplog import StepLog


def test_a_line_per_interval_and_at_the_last_step(capsys):
    now = [100.0]
    log = StepLog("distill", 10, every_s=5.0, clock=lambda: now[0])
    lines = []
    for step in range(1, 11):
        now[0] += 2.0  # 2 s a step
        lines.append(log(step, loss=1.0 / step, tokens=step * 512))
    written = [x for x in lines if x is not None]
    # at 6 s (step 3), 12 s (step 6), 18 s (step 9) and the last step (20 s)
    assert [x.split("  ")[0] for x in written] == [
        "distill: step 3/10",
        "distill: step 6/10",
        "distill: step 9/10",
        "distill: step 10/10",
    ]
    assert written[-1] == "distill: step 10/10  loss 0.1000  0.50 steps/s  256 tokens/s"
    assert capsys.readouterr().out.splitlines() == written  # printed: the job's stdout is its log
