"""Timing the CPU: the matmuls and attention that dominate generation, in fp32, bf16 and fp16.

A decode step multiplies a few rows (one per sequence of the batch) by every weight matrix; a
prompt multiplies many rows by the same weights. Which dtype is faster differs between the two:
halving the bytes a step reads wins where the arithmetic is cheap, and emulated bf16 arithmetic
loses once there is much of it (the table in docs/backends/cpu.md). So both are timed, at the
batch sizes that matter, plus one-token attention as whichdevice_sdpa's decode path runs it against
torch's fused kernel as transformers calls it: plain matmuls for multi-head models, the fused
kernel with the query heads grouped by key/value head for grouped-query ones. Those shapes run from
the cache; the regime of real models, whose weights stream from memory on every step, is timed by
``cpu_memory``.

The cost is bounded: a dtype whose figure falls below ``HOPELESS`` of fp32 is not timed at larger
shapes (they only get worse), since an emulated fp16 matmul can take a hundred times fp32's time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from whichdevice.core.dtypes import short_name
from whichdevice.core.frozen import NamedTuple
from whichdevice.measure.figures import PROMPT_ROWS

__all__ = ["BATCHES", "BUDGET_S", "HALF_DTYPES", "HOPELESS", "PROMPT_ROWS", "STEADY", "WIDTH", "Measured", "measure"]

# A representative width (between small models' 512-768 and 7B models' 4096): two matrices of
# WIDTH x 2*WIDTH (16 MiB in fp32) stand for a layer's weights, larger than a core's L2 cache.
WIDTH = 1024
BATCHES = (1, 2, 4, 8)
HALF_DTYPES = ("bfloat16", "float16")
HOPELESS = 0.25
# Interleaved rounds, each dtype's best kept: other work on the machine only ever adds time, so the
# minimum of neighbouring runs is the figure least moved by it. A figure counts as steady when its
# two best runs agree within STEADY; more rounds are run until they do, up to _MAX_ROUNDS.
_ROUNDS = 5
_MAX_ROUNDS = 15
STEADY = 1.2
# Past this many seconds no more rounds are added and no more shapes timed: a machine so busy that
# nothing is steady is reported as such, not timed for longer (resolve_device() pays at most this
# once, `whichdevice calibrate` allows 5 s). A quiet 2-core machine needs about 0.9 s.
BUDGET_S = 2.0


def _once(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _steady(samples: list[float]) -> bool:
    if len(samples) < 2:
        return False
    first, second = sorted(samples)[:2]
    return second <= first * STEADY


def _best_of(runs: Mapping[str, Callable[..., Any]], deadline: float) -> tuple[dict[str, float], bool]:
    """Each run's best time over interleaved rounds, and whether every best is steady."""
    for run in runs.values():
        run()  # oneDNN builds its kernel for a shape on the first call
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(_MAX_ROUNDS):
        for name, run in runs.items():
            samples[name].append(_once(run))
        steady = all(_steady(s) for s in samples.values())
        late = time.perf_counter() > deadline
        if (round_ + 1 >= _ROUNDS and (steady or late)) or (late and round_ >= 1):
            break
    return {name: min(s) for name, s in samples.items()}, steady


def _matmul_speeds(
    torch: Any, weights: dict[str, list[Any]], deadline: float
) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """(speeds over fp32 per "bf16.b1".."fp16.prompt", fp32 seconds per "b1".."b8" and prompt row,
    the shapes whose figures were not steady)."""
    fp32: dict[str, float] = {}
    speeds: dict[str, float] = {}
    unsteady: list[str] = []
    live = [name for name in weights if name != "float32"]
    shapes = [*(f"b{b}" for b in BATCHES), "prompt"]
    for shape in shapes:
        if time.perf_counter() > deadline:
            # Out of time (a busy machine): the rest is not timed, and the whole is not to be used.
            unsteady += [f"{rest} (out of time)" for rest in shapes[shapes.index(shape) :]]
            break
        # As a model's linear layers see them: (batch, 1, width) for a step, (1, rows, width) for a prompt.
        size = (1, PROMPT_ROWS, WIDTH) if shape == "prompt" else (int(shape[1:]), 1, WIDTH)
        runs: dict[str, Callable[..., Any]] = {}
        inputs = {name: torch.randn(*size, dtype=getattr(torch, name)) for name in ["float32", *live]}
        for name, x in inputs.items():
            runs[name] = lambda x=x, ws=weights[name]: [torch.nn.functional.linear(x, w) for w in ws]
        if shape == "prompt":
            runs |= _packed_runs(torch, weights, inputs)
            if "bfloat16" in inputs:
                runs["upcast bfloat16"] = _upcast_run(torch, weights["bfloat16"], inputs["bfloat16"])
        best, steady = _best_of(runs, deadline)
        if not steady:
            unsteady.append(shape)
        fp32[shape] = best["float32"] / (PROMPT_ROWS if shape == "prompt" else 1)
        for name in live:
            speeds[f"{short_name(name)}.{shape}"] = best["float32"] / best[name]
        if "packed float32" in best:
            fp32["pp"] = best["packed float32"] / PROMPT_ROWS
        for name in [n for n in live if f"packed {n}" in best]:
            speeds[f"{short_name(name)}.pp"] = best["float32"] / best[f"packed {name}"]
        if "upcast bfloat16" in best:
            speeds["bf16.up"] = best["float32"] / best["upcast bfloat16"]
        # Larger shapes only do more of the arithmetic a hopeless dtype emulates: not worth the time.
        # Only a steady figure stands for the rest: an unsteady one is dropped (steady_part), and
        # its copies would otherwise be used in its place.
        for name in [n for n in live if steady and speeds[f"{short_name(n)}.{shape}"] < HOPELESS]:
            live.remove(name)
            for rest in shapes:
                speeds.setdefault(f"{short_name(name)}.{rest}", speeds[f"{short_name(name)}.{shape}"])
    return speeds, fp32, unsteady


def _packed_runs(torch: Any, weights: dict[str, list[Any]], inputs: dict[str, Any]) -> dict[str, Any]:
    """The prompt-sized matmuls of ``inputs`` (by dtype) again with the weights packed ahead in
    oneDNN's layout, as a model packed for its decode steps runs its prompt too (fp32 measured
    1.3-1.45x its plain prompt here), by "packed <dtype>"; none for a dtype oneDNN cannot pack."""
    from whichdevice.measure.cpu_memory import PACKED_BATCH, PACKED_DTYPES, packing_ops

    ops = packing_ops(torch)
    if ops is None:
        return {}
    pack, linear = ops
    runs = {}
    for name in [n for n in inputs if n in PACKED_DTYPES]:
        try:
            sets = [pack(w, PACKED_BATCH) for w in weights[name]]
        except RuntimeError:  # a oneDNN without this dtype's packing: not timed packed
            continue
        runs[f"packed {name}"] = lambda x=inputs[name], ws=sets: [linear(x, w, None) for w in ws]
    return runs


def _upcast_run(torch: Any, weights: list[Any], x: Any) -> Callable[[], Any]:
    """The prompt-sized matmuls as ``prepare()`` runs a bf16 model's prompts on a CPU whose bf16
    arithmetic is slow (``tuning.upcast``): each bf16 weight copied into one reused fp32 buffer, an fp32
    matmul, the result rounded back to bf16. Its time over fp32's is "bf16.up"."""
    buffer = torch.empty(weights[0].shape, dtype=torch.float32)

    def run() -> Any:
        return [torch.nn.functional.linear(x.float(), buffer.copy_(w)).to(x.dtype) for w in weights]

    return run


def _attention_ratio(torch: Any, dtype: Any, deadline: float) -> tuple[float, bool]:
    """Fused sdpa's time over plain matmuls' for a one-token query (batch 4, 12 heads of 64, 256 cached)."""
    q = torch.randn(4, 12, 1, 64, dtype=dtype)
    k = torch.randn(4, 12, 256, 64, dtype=dtype)
    v = torch.randn(4, 12, 256, 64, dtype=dtype)

    def matmuls() -> Any:
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype), v)

    runs = {"fused": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), "matmuls": matmuls}
    best, steady = _best_of(runs, deadline)
    return best["fused"] / best["matmuls"], steady


def _grouped_ratio(torch: Any, dtype: Any, deadline: float) -> tuple[float, bool]:
    """A grouped-query model's one-token attention (batch 1, 32 heads over 4 key/value heads of 64, 256
    cached) through the fused kernel one query row per head, as transformers calls it without a mask
    (``enable_gqa``), over the same kernel with each key/value head's query heads as its rows."""
    q = torch.randn(1, 32, 1, 64, dtype=dtype)
    k = torch.randn(1, 4, 256, 64, dtype=dtype)
    v = torch.randn(1, 4, 256, 64, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runs = {"per head": lambda: sdpa(q, k, v, enable_gqa=True), "grouped": lambda: sdpa(q.reshape(1, 4, 8, 64), k, v)}
    best, steady = _best_of(runs, deadline)
    return best["per head"] / best["grouped"], steady


# (figure, how it is timed, its name among the unsteady ones): calibration_figures' _COVERS reads them.
_ATTENTION = (("attention", _attention_ratio, "attention"), ("gqa", _grouped_ratio, "gqa attention"))


class Measured(NamedTuple):
    """speeds: "bf16.b1", "bf16.prompt", "bf16.s1", "bf16.attention", ..., each a dtype's speed over
    fp32's at that shape (above 1: faster; the attention figures are whichdevice_sdpa's one-token
    path's speed over torch's fused kernel as transformers calls it in that dtype: "attention" plain
    matmuls for multi-head models, "gqa" the grouped heads' fused call); fp32: seconds per shape;
    memory: the cache and bandwidth figures of ``cpu_memory``; unsteady: the figures other work on
    the machine kept moving."""

    speeds: dict[str, float]
    fp32: dict[str, float]
    memory: dict[str, float]
    threads: int
    unsteady: list[str]


def measure(budget_s: float = BUDGET_S) -> Measured:
    """This CPU's figures, in at most about ``budget_s`` seconds (see :class:`Measured`)."""
    import torch

    from whichdevice.measure.cpu_memory import measure_streamed

    # Each part has its share of the budget, so a busy machine that stretches the cache-resident
    # shapes still times the streamed ones (the figures real models are decided by).
    start = time.perf_counter()
    resident, streamed_by, deadline = (start + budget_s * share for share in (0.5, 0.9, 1.0))
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        base = [torch.empty(2 * WIDTH, WIDTH).uniform_(-0.03, 0.03) for _ in range(2)]
        weights = {name: [w.to(getattr(torch, name)) for w in base] for name in ("float32", *HALF_DTYPES)}
        with torch.inference_mode():
            speeds, fp32, unsteady = _matmul_speeds(torch, weights, resident)
            del weights
            live = [n for n in HALF_DTYPES if speeds.get(f"{short_name(n)}.b1", 0) >= HOPELESS]
            streamed = measure_streamed(torch, live, _best_of, streamed_by, lambda: time.perf_counter() > streamed_by)
            speeds.update(streamed[0])
            fp32.update(streamed[1])
            unsteady += streamed[3]
            for name in HALF_DTYPES:
                for shape, timed, label in _ATTENTION:
                    if speeds.get(f"{short_name(name)}.b1", 0) >= HOPELESS and time.perf_counter() < deadline:
                        ratio, steady = timed(torch, getattr(torch, name), deadline)
                        speeds[f"{short_name(name)}.{shape}"] = ratio
                        if not steady:
                            unsteady.append(f"{short_name(name)} {label}")
        memory = streamed[2] | {"cache": float(2 * 2 * WIDTH * WIDTH)}
        return Measured(speeds, fp32, memory, torch.get_num_threads(), unsteady)
    finally:
        torch.random.set_rng_state(generator_state)
