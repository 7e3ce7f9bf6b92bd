"""Generate's compiled static cache on an NVIDIA GPU: when it repays its compile, and whether it can compile here.

With ``cache_implementation="static"``, transformers' ``generate`` compiles its decode step on CUDA
(``CompileConfig``'s default, ``mode="reduce-overhead"``: CUDA graphs). That removes the per-kernel
launch cost that bounds decode of small models there, and costs a compile first, so it is handed over
only for a job long enough to repay it, only inside what was measured (docs/backends/cuda.md,
"Generation"), and only where torch.compile can build CUDA code: without triton, on a GPU below
inductor's floor, or with ``TORCH_COMPILE_DISABLE=1``, the first ``generate`` would raise inside the
compile or run the static cache uncompiled and slower. Everything else is left to transformers, and
the trace says why.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from whichdevice.core.dtypes import item_size
from whichdevice.core.job import Job, new_tokens
from whichdevice.core.records import TraceStep
from whichdevice.tuning.compile_support import cannot_compile_here

if TYPE_CHECKING:
    from whichdevice.attention.record import Attention
    from whichdevice.device.target import Target
    from whichdevice.memory.record import Placement
    from whichdevice.model.facts import ModelFacts

__all__ = [
    "COMPILE_MARGIN",
    "COMPILE_PAYS_AFTER_STEPS",
    "MEASURED_BATCH",
    "MEASURED_WEIGHT_BYTES",
    "static_cache_step",
]

# The decode steps after which generate's compiled static cache had paid for its compile, the most of
# 0.1-1.1B bf16 Llamas at batch 1 and 4 on an H200 (docs/backends/cuda.md, "Generation"): both the
# compile and the launches it saves grow with the layers, so a count of steps carries over between sizes.
COMPILE_PAYS_AFTER_STEPS = 3682
# Handed over only past this multiple of it: another GPU, host or model is not the one measured.
COMPILE_MARGIN = 1.25
# Outside what was measured the answer is transformers' default (no static cache): a model whose
# weights take longer to read than the launches it saves (a larger model, a slower GPU) or a larger
# batch moves the step from launch-bound to GPU-bound, where the compile may never pay.
# The 1.1B Llama's linear weights and lm_head in bf16 (1.03e9 parameters), as StoredWeights.step_weights() counts.
MEASURED_WEIGHT_BYTES = 2.07e9
MEASURED_BATCH = 4
_MEASURED_DTYPES = ("bfloat16", "float16")  # bf16 measured; fp16 reads the same bytes per step
_MEASURED_ATTENTION = "sdpa"


def static_cache_step(
    target: Target,
    task: str,
    model: ModelFacts | None,
    job: Job,
    placement: Placement,
    attention: Attention,
    quantized: bool,
) -> tuple[bool, list[TraceStep]]:
    """Whether generate gets ``cache_implementation="static"`` (compiled by generate on CUDA): an
    inference job on one NVIDIA GPU, long enough to repay the compile, for a model inside the measured
    range whose classes transformers marks as compiling whole."""
    if target.name != "cuda" or target.variant != "cuda" or task != "inference" or not job.generation:
        # Measured on NVIDIA alone (a CPU's settings are measured by its calibration), and only
        # for a job that says its sequences: a resolution that knows nothing of one says nothing.
        return False, []
    dtype = placement.weights
    refusal = (
        _unusual(target, placement, attention, quantized)
        or _outside_measured(dtype, attention.name, model, job)
        or _tokens_needed(job)
        or cannot_compile_here(target.probe)
    )
    if refusal is not None:
        return False, [TraceStep("generation", f"generate's own cache, not a compiled static one: {refusal}")]
    size = (_step_parameters(model) or 0) * item_size(dtype or "bfloat16") / 1e9  # checked above: set
    why = (
        "cache_implementation='static' (res.generate_kwargs(); res.prepare(model) passes it to the model's "
        "generate calls that set no cache of their own): generate compiles its decode step with CUDA graphs, "
        f"measured to repay the compile after {COMPILE_PAYS_AFTER_STEPS} steps at most (0.1-1.1B Llamas on an "
        "H200, batch 1 and 4); "
        f"this job generates {new_tokens(job)} tokens a sequence, past {COMPILE_MARGIN}x that, with "
        f"{size:.2g} GB of linear weights at batch {job.batch_size or 1}"
    )
    return True, [TraceStep("generation", why)]


def _unusual(target: Target, placement: Placement, attention: Attention, quantized: bool) -> str | None:
    """Why generate's compile is not handed over for this load (as transformers' own checks and what was
    measured have it), or None."""
    if quantized:
        return "the weights are quantized, and not every method compiles (transformers checks each itself)"
    if placement.device_map != target.device:
        return f"the model is not whole on {target.device} (device_map={placement.device_map!r})"
    if attention.use_kernels:
        return "Hub kernels replace layers, and were not measured compiled"
    return None


def _step_parameters(model: ModelFacts | None) -> int | None:
    """The weights a decode step reads, from the checkpoint's safetensors headers (None: not known)."""
    stored = model.stored if model is not None else None
    return stored.step_weights().parameters if stored is not None else None


def _outside_measured(dtype: str | None, attention: str | None, model: ModelFacts | None, job: Job) -> str | None:
    """Why this load is outside what was measured (left to transformers), or None."""
    parameters = _step_parameters(model)
    if model is None or parameters is None:
        return "pass model= (with safetensors weights) to have a compiled static cache considered"
    if model.adapter is not None:
        return "a PEFT adapter's layers wrap the model's, and were not measured compiled"
    if dtype not in _MEASURED_DTYPES:
        return f"measured for bf16 and fp16 weights, and these load as {dtype or 'the checkpoint stores them'}"
    if attention != _MEASURED_ATTENTION:
        return f"measured with sdpa attention, and this load runs {attention or 'what transformers picks'}"
    if (job.batch_size or 1) > MEASURED_BATCH:
        return f"measured up to batch {MEASURED_BATCH}, where a decode step is still bound by kernel launches"
    weights = parameters * item_size(dtype)
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
