"""What a Resolution hands over for generation: decode hooks on a CPU, a compiled static cache on a GPU.

On a CPU the calibration measures two runtime settings that ``Resolution.prepare(model)`` installs:
batch-1 decode steps through torch's GEMV kernel (``single_row``) and linear weights packed ahead
(``packed_for_batch``). On an NVIDIA GPU the setting is transformers' own: with
``cache_implementation="static"``, ``generate`` compiles its decode step (``CompileConfig``'s default,
``mode="reduce-overhead"``: CUDA graphs). That removes the per-kernel launch cost that bounds decode of
small models there, and costs a compile first, so it is handed over (``Resolution.generate_kwargs()``)
only for a job long enough to repay it, and only where it was measured (``COMPILE_PAYS_AFTER_STEPS``):
everything else is left to transformers and the trace says why.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from whichdevice.core.dtypes import item_size, short_name
from whichdevice.core.job import Job, new_tokens
from whichdevice.core.records import TraceStep
from whichdevice.resolve.compile_support import cannot_compile_here

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.model.facts import ModelFacts
    from whichdevice.precision.packing_plan import PackingPlan

__all__ = [
    "COMPILE_MARGIN",
    "COMPILE_PAYS_AFTER_STEPS",
    "MEASURED_BATCH",
    "MEASURED_WEIGHT_BYTES",
    "Loaded",
    "packed_step",
    "single_row_step",
    "static_cache_step",
]

# The decode steps after which generate's compiled static cache had paid for its compile, measured
# on an NVIDIA H200 (torch 2.11+cu130, transformers 5.17, 16 host cores) for bf16 Llamas of 0.1B,
# 0.4B and 1.1B at batch 1 and 4 (benchmarks/compile_decode.py; benchmarks/results-27/gpu/): the
# compile took 13.8-34.0 s and each step saved 0.47-0.59 ms per layer (the eager step is bound by
# kernel launches: 5.6-14.9 ms against 1.4-3.1 ms compiled), so it paid after 1807-3682 steps; the
# largest is taken. Both the compile and the launches it saves grow with the layers, which is why a
# count of steps carries over between sizes; both run on the host CPU, which is why it carries over
# between hosts better than either figure alone.
COMPILE_PAYS_AFTER_STEPS = 3682
# Handed over only past this multiple of it: another GPU, host or model is not the one measured.
COMPILE_MARGIN = 1.25
# Outside what was measured the answer is transformers' default (no static cache): a model whose
# weights take longer to read than the launches it saves (a larger model, a slower GPU) or a larger
# batch moves the step from launch-bound to GPU-bound, where the compile may never pay.
# The 1.1B Llama's linear weights and lm_head in bf16 (1.03e9 parameters), counted as Job.parameters counts them.
MEASURED_WEIGHT_BYTES = 2.07e9
MEASURED_BATCH = 4
_MEASURED_DTYPES = ("bfloat16", "float16")  # bf16 measured; fp16 reads the same bytes per step
_MEASURED_ATTENTION = "sdpa"


def single_row_step(
    measured: bool, dtype: str | None, quantization: Any, device_map: Any
) -> tuple[bool, list[TraceStep]]:
    """Whether Resolution.prepare(model) hooks batch-1 decode steps onto torch's GEMV kernel: measured
    faster for the bf16 weights that load, unquantized, all on the CPU (whichdevice.precision.single_row)."""
    if not measured or dtype != "bfloat16" or quantization is not None or device_map != "cpu":
        return False, []
    why = (
        "res.prepare(model) runs batch-1 decode steps (one token row) with oneDNN off, through torch's own "
        "GEMV kernel, measured faster for bf16 weights streamed from memory (the calibration's bf16.g1 and "
        "bf16.gn1 over bf16.s1 and bf16.sn1, for this model's matmuls); prompts and larger batches keep oneDNN"
    )
    return True, [TraceStep("generation", why)]


def packed_step(
    plan: PackingPlan | None, dtype: str | None, quantization: Any, device_map: Any, job: Job
) -> tuple[PackingPlan | None, list[TraceStep]]:
    """The packing Resolution.prepare(model) makes of the linear weights, unquantized and all on the
    CPU, where the estimate with packing won (``plan``: its figures, batch and budget)."""
    if plan is None or quantization is not None or device_map != "cpu" or dtype is None:
        return None, []
    size = f", a copy of {job.parameters * item_size(dtype) / 1024**3:.2f} GiB beside them" if job.parameters else ""
    when = (
        f"res.prepare(model) packs the {short_name(dtype)} linear weights"
        if plan.told
        else f"the first model.generate() call whose own prompt and new tokens repay it packs the {short_name(dtype)} "
        "linear weights (res.prepare(model) hooks it; the job's new tokens were not told)"
    )
    from whichdevice.precision.packing_plan import PACK_MARGIN

    limit = f"{plan.budget_for_job:.2g} s" if plan.told else "that call's budget"
    why = (
        f"{when} in oneDNN's layout for batch {plan.batch}{size}, measured faster for decode steps of several rows "
        f"and prompts (the calibration's p4 and pp), the packing counted against the job's tokens and stopped "
        f"(the layers packed by then kept) if its own rate prices the whole copy past {limit} (the job "
        f"{PACK_MARGIN:.1f}x faster with it); "
        "made only while it takes at most half the memory available, and training, other dtypes and changed "
        "weights run unpacked"
    )
    return plan, [TraceStep("generation", why)]


def static_cache_step(
    backend: Backend,
    result: ProbeResult,
    task: str,
    model: ModelFacts | None,
    job: Job,
    *,
    loaded: Loaded,
) -> tuple[bool, list[TraceStep]]:
    """Whether generate gets ``cache_implementation="static"`` (compiled by generate on CUDA): an
    inference job on one NVIDIA GPU, long enough to repay the compile, for a model inside the measured
    range whose classes transformers marks as compiling whole."""
    if backend.name != "cuda" or result.variant != "cuda" or task != "inference" or not job.generation:
        # Measured on NVIDIA alone (a CPU's settings are measured by its calibration), and only
        # for a job that says its sequences: a resolution that knows nothing of one says nothing.
        return False, []
    refusal = (
        loaded.unusual()
        or _outside_measured(loaded.dtype, loaded.attention, model, job)
        or _tokens_needed(job)
        or cannot_compile_here(result)
    )
    if refusal is not None:
        return False, [TraceStep("generation", f"generate's own cache, not a compiled static one: {refusal}")]
    size = (job.parameters or 0) * item_size(loaded.dtype or "bfloat16") / 1e9  # checked above: set
    why = (
        f"cache_implementation='static' (res.generate_kwargs(); res.prepare(model) sets it in the model's "
        f"generation_config): generate compiles its decode step with CUDA graphs, measured to repay the "
        f"compile after {COMPILE_PAYS_AFTER_STEPS} steps at most (0.1-1.1B Llamas on an H200, batch 1 and 4); "
        f"this job generates {new_tokens(job)} tokens a sequence, past {COMPILE_MARGIN}x that, with "
        f"{size:.2g} GB of linear weights at batch {job.batch_size or 1}"
    )
    return True, [TraceStep("generation", why)]


class Loaded(NamedTuple):
    """How the model loads, as resolved: what decides whether generate may compile it."""

    dtype: str | None
    attention: str | None
    device: str
    device_map: Any
    quantization: Any = None
    use_kernels: bool = False

    def unusual(self) -> str | None:
        """Why generate's compile is not handed over for this load (as transformers' own checks and
        what was measured have it), or None."""
        if self.quantization is not None:
            return "the weights are quantized, and not every method compiles (transformers checks each itself)"
        if self.device_map != self.device:
            return f"the model is not whole on {self.device} (device_map={self.device_map!r})"
        if self.use_kernels:
            return "Hub kernels replace layers, and were not measured compiled"
        return None


def _outside_measured(dtype: str | None, attention: str | None, model: ModelFacts | None, job: Job) -> str | None:
    """Why this load is outside what was measured (left to transformers), or None."""
    if model is None or job.parameters is None:
        return "pass model= (with safetensors weights) to have a compiled static cache considered"
    if model.adapter is not None:
        return "a PEFT adapter's layers wrap the model's, and were not measured compiled"
    if dtype not in _MEASURED_DTYPES:
        return f"measured for bf16 and fp16 weights, and these load as {dtype or 'the checkpoint stores them'}"
    if attention != _MEASURED_ATTENTION:
        return f"measured with sdpa attention, and this load runs {attention or 'what transformers picks'}"
    if (job.batch_size or 1) > MEASURED_BATCH:
        return f"measured up to batch {MEASURED_BATCH}, where a decode step is still bound by kernel launches"
    weights = job.parameters * item_size(dtype)
    if weights > MEASURED_WEIGHT_BYTES:
        return (
            f"its {weights / 1e9:.1f} GB of weights are more than the {MEASURED_WEIGHT_BYTES / 1e9:.1f} GB measured, "
            "and reading them may take longer than the launches a compile saves"
        )
    from whichdevice.model.support import support_of_config

    support = support_of_config(model.config)
    if support.unknown is not None:
        return f"whether its classes compile whole is not known ({support.unknown})"
    return support.not_compiling()


def _tokens_needed(job: Job) -> str | None:
    """Why the job is too short (or unsized) for the compile to pay, or None."""
    tokens = new_tokens(job)
    needed = math.ceil(COMPILE_PAYS_AFTER_STEPS * COMPILE_MARGIN)
    if tokens is None:
        return (
            f"the job's length is not known (pass max_new_tokens=; a compile pays after about "
            f"{COMPILE_PAYS_AFTER_STEPS} new tokens)"
        )
    if tokens < needed:
        return (
            f"{tokens} new tokens a sequence do not repay the compile (measured to pay after up to "
            f"{COMPILE_PAYS_AFTER_STEPS} steps; handed over from {needed})"
        )
    return None
