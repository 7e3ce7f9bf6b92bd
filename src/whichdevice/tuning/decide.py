"""Which tunings a resolution hands over: one ``Tuning`` record (or None), each setting with its trace line.

On a CPU both settings come from the same estimate the dtype was chosen by (``measure.estimate``),
made again for the dtype that loads: batch-1 decode steps through torch's GEMV kernel where that
path was measured ``MARGIN`` faster for bf16 weights streamed from memory, and the linear weights
packed ahead where the whole job, packing counted, is ``PACK_MARGIN`` faster and this CPU's oneDNN
packs that dtype. Only for an inference load whole on the CPU, unquantized, with every figure its
estimate reads steady. On an NVIDIA GPU, the static cache (``tuning.static_cache``). The CPU decode
attention is chosen with the attention (attention/choose.py) and recorded here, since prepare() installs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.dtypes import item_size, short_name
from whichdevice.core.records import TraceStep
from whichdevice.measure.estimate import estimate_seconds, lost_figures, upcast_rows
from whichdevice.measure.packing_plan import PACK_MARGIN
from whichdevice.tuning.record import Tuning
from whichdevice.tuning.static_cache import static_cache_step

if TYPE_CHECKING:
    from whichdevice.attention.record import Attention
    from whichdevice.core.job import Job
    from whichdevice.device.target import Target
    from whichdevice.measure.estimate import CpuJob
    from whichdevice.measure.packing_plan import PackingPlan
    from whichdevice.memory.record import Placement
    from whichdevice.model.facts import ModelFacts

__all__ = ["decide_tuning"]


def decide_tuning(
    target: Target,
    task: str,
    measured: CpuJob | None,
    model: ModelFacts | None,
    job: Job,
    placement: Placement,
    attention: Attention,
    quantized: bool,
) -> tuple[Tuning | None, list[TraceStep]]:
    """What ``Resolution.prepare(model)`` installs for this resolution (the model as ``placement`` loads
    it, running ``attention``; ``quantized``: by bitsandbytes or as the checkpoint stores it), and the
    trace lines that say why."""
    single_row, packing, upcast, steps = False, None, None, list[TraceStep]()
    dtype = placement.weights
    if task == "inference" and measured is not None and dtype is not None and _whole_on_cpu(placement, quantized):
        single_row, packing, steps = _cpu_tunings(measured, dtype)
        upcast, more = _upcast(measured, dtype)
        steps += more
    static_cache, more = static_cache_step(target, task, model, job, placement, attention, quantized)
    steps += more
    decode = attention.decode  # chosen with the attention, said in its trace line
    if not (single_row or packing or static_cache or decode or upcast):
        return None, steps
    return Tuning(single_row, packing, static_cache, decode, upcast), steps


def _whole_on_cpu(placement: Placement, quantized: bool) -> bool:
    return placement.device_map == "cpu" and not quantized


def _cpu_tunings(measured: CpuJob, dtype: str) -> tuple[bool, PackingPlan | None, list[TraceStep]]:
    calib, job, weights = measured
    if lost_figures(calib, job, weights, (dtype,)):
        return False, None, []  # the dtype's line says which figures moved: the flags decided
    estimate = estimate_seconds(calib, dtype, job, weights)
    if estimate is None:
        return False, None, []
    step = estimate[1]
    steps: list[TraceStep] = []
    single_row = step.single_row and dtype == "bfloat16"
    if single_row:
        steps.append(TraceStep("generation", _SINGLE_ROW))
    plan = step.plan
    if plan is not None:
        from whichdevice.measure.cpu_memory import packable_dtypes

        if dtype not in packable_dtypes():
            why = (
                f"not packed: the estimate found {short_name(dtype)} weights packed ahead faster, but this CPU's "
                f"oneDNN cannot pack {dtype} (torch's check asks for AVX-512BW/VL/DQ or AVX-NE-CONVERT, or Arm BF16)"
            )
            return single_row, None, [*steps, TraceStep("generation", why)]
        steps.append(TraceStep("generation", _packing_line(plan, weights.parameters if weights else None)))
    return single_row, plan, steps


def _upcast(measured: CpuJob, dtype: str) -> tuple[int | None, list[TraceStep]]:
    """The rows above which a bf16 load's forwards run in fp32 (``tuning.upcast``), and its trace line."""
    calib = measured.calibration
    rows = upcast_rows(calib) if dtype == "bfloat16" and not calib.lost("prompt") else None
    if rows is None:
        return None, []
    own, up = calib.speed(dtype, "prompt"), calib.speed(dtype, "up")
    figures = f"bf16 {own:.2f}x fp32 here, in fp32 from the bf16 weights {up:.2f}x" if own and up else ""
    return rows, [
        TraceStep(
            "generation",
            f"res.prepare(model) computes each bf16 linear layer's forward of more than {rows} rows (a prompt) in "
            f"fp32 from its weights, copied at each call into one reused fp32 buffer per weight shape (freed by "
            f"res.unprepare(model)), and forwards of {rows} rows or fewer (decode steps) in bf16 as loaded: this "
            f"CPU's bf16 arithmetic measured slow for a prompt-sized matmul ({figures}, the copy counted; the "
            "calibration's bf16.prompt and bf16.up) and its bf16 decode steps fast; the crossover is where the "
            "copy's cost equals the arithmetic saved",
        )
    ]


_SINGLE_ROW = (
    "res.prepare(model) runs batch-1 decode steps (one token row) with oneDNN off, through torch's own "
    "GEMV kernel, measured faster for bf16 weights streamed from memory (the calibration's bf16.g1 and "
    "bf16.gn1 over bf16.s1 and bf16.sn1, for this model's matmuls); prompts and larger batches keep oneDNN"
)


def _packing_line(plan: PackingPlan, parameters: int | None) -> str:
    size = f", a copy of {parameters * item_size(plan.dtype) / 1024**3:.2f} GiB beside them" if parameters else ""
    name = short_name(plan.dtype)
    when = (
        f"res.prepare(model) packs the {name} linear weights"
        if plan.told
        else f"the first model.generate() call whose own prompt and new tokens repay it packs the {name} "
        "linear weights (res.prepare(model) hooks it; the job's new tokens were not told)"
    )
    limit = f"{plan.budget_for_job:.2g} s" if plan.told else "that call's budget"
    return (
        f"{when} in oneDNN's layout for batch {plan.batch}{size}, measured faster for decode steps of several rows "
        f"and prompts (the calibration's p4 and pp), the packing counted against the job's tokens and stopped "
        f"(the layers packed by then kept) if its own rate prices the whole copy past {limit} (the job "
        f"{PACK_MARGIN:.1f}x faster with it); made only while it takes at most half the memory available; a "
        "layer runs its copy only while its weight is unchanged (docs/tuning.md), and training and other dtypes "
        "run unpacked"
    )
