"""The cache-resident timing's bookkeeping: which figures stand for others (the timing itself runs in
test_calibration.py)."""

from __future__ import annotations

import torch

from whichdevice.measure import cpu_timing


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


def test_the_prompt_is_timed_packed_too_in_its_own_rounds(monkeypatch):
    from whichdevice.measure.cpu_memory import packable_dtypes, packing_ops

    timed: dict[str, dict[str, object]] = {}

    def best_of(runs, deadline):
        shape = "prompt" if any(name.startswith("packed") for name in runs) else f"step {len(timed)}"
        timed[shape] = dict(runs)
        return {name: (0.5 if name.startswith("packed") else 1.0) for name in runs}, True

    monkeypatch.setattr(cpu_timing, "_best_of", best_of)
    torch.manual_seed(0)
    base = torch.randn(64, 32)
    weights = {name: [base.to(getattr(torch, name))] for name in ("float32", "bfloat16", "float16")}
    speeds, fp32, _ = cpu_timing._matmul_speeds(torch, weights, deadline=float("inf"))
    if packing_ops(torch) is None:  # a torch without oneDNN's packing: nothing packed, nothing claimed
        assert "pp" not in fp32 and "bf16.pp" not in speeds
        return
    # bf16 is timed packed only where this CPU's oneDNN packs it (a real try: not on AVX2-only CPUs).
    bf16 = "bfloat16" in packable_dtypes()
    packed = {"packed float32", *(("packed bfloat16",) if bf16 else ())}
    assert set(timed["prompt"]) == {"float32", "bfloat16", "float16", "upcast bfloat16", *packed}
    assert fp32["pp"] == 0.5 / cpu_timing.PROMPT_ROWS and "fp16.pp" not in speeds
    assert speeds["bf16.up"] == 1.0 and "fp16.up" not in speeds  # the bf16 prompt in fp32 from its weights
    assert speeds.get("bf16.pp") == (2.0 if bf16 else None)
    # Only the prompt's rounds pack; and each packed run computes what its plain twin does.
    assert all(not name.startswith("packed") for shape, runs in timed.items() if shape != "prompt" for name in runs)
    x = torch.randn(1, 8, 32)
    packed_runs = cpu_timing._packed_runs(torch, weights, {"float32": x, "float16": x.half()})
    assert set(packed_runs) == {"packed float32"}  # fp16 is not packed
    torch.testing.assert_close(packed_runs["packed float32"]()[0], torch.nn.functional.linear(x, base))
    # The upcast run computes fp32 matmuls of the bf16 weights, rounded to bf16.
    upcast = cpu_timing._upcast_run(torch, weights["bfloat16"], x.bfloat16())()[0]
    expected = torch.nn.functional.linear(x.bfloat16().float(), base.bfloat16().float()).bfloat16()
    assert torch.equal(upcast, expected)
