"""The cache-resident timing's bookkeeping: which figures stand for others (the timing itself runs in
test_calibration.py)."""

from __future__ import annotations

import torch

from whichdevice.hardware.probes import cpu_timing


def test_only_a_steady_hopeless_figure_stands_for_the_larger_shapes(monkeypatch):
    # fp16 at 0.1x fp32 each time; the first shape's timing unsteady, the rest steady: the unsteady
    # figure (dropped later) must not be copied to the shapes after it, which are timed instead.
    rounds: list[tuple[str, ...]] = []

    def best_of(runs, deadline):
        rounds.append(tuple(runs))
        return {name: (1.0 if name == "float32" else 10.0) for name in runs}, len(rounds) > 1

    monkeypatch.setattr(cpu_timing, "_best_of", best_of)
    weights = {name: [torch.zeros(8, 4, dtype=getattr(torch, name))] for name in ("float32", "float16")}
    speeds, _, unsteady = cpu_timing._matmul_speeds(torch, weights, deadline=float("inf"))
    assert unsteady == ["b1"] and "float16" in rounds[1]  # timed again at b2, found hopeless there
    assert all("float16" not in timed for timed in rounds[2:])  # then its b2 figure stands for the rest
    assert speeds["fp16.b4"] == 0.1
