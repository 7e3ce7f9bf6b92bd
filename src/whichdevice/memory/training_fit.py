"""Training in one process: full fine-tuning, then LoRA, then QLoRA, each without and then with gradient
checkpointing, and the first that fits.

Each way is priced whole (memory/training_job.py: gradients, optimizer state and the activations autograd
keeps, at the step's peak) against what the device offers (memory/fit.py's margin), and the order is the
order of what changes a user's result least: full fine-tuning before adapters, and checkpointing (one more
forward pass per step, the same result) before giving up full fine-tuning. ``gradient_checkpointing=``
pins it on or off; a class that cannot checkpoint is priced without it, and the trace says why.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.fit import JobFit
from whichdevice.memory.job import JobMemory
from whichdevice.memory.training_job import TrainingAsk, checkpointing_choices, setup_weights, training_memory
from whichdevice.memory.training_records import TrainingSetup
from whichdevice.model.facts import estimate_model_size, model_shape

if TYPE_CHECKING:
    from whichdevice.core.job import Job
    from whichdevice.device.target import Target
    from whichdevice.memory.largest_record import LargestFit
    from whichdevice.model.size import ModelSize

__all__ = [
    "CHECKPOINTING_COST",
    "Tried",
    "first_need",
    "ladder",
    "lora_step",
    "passed_over",
    "priced_lines",
    "sized_training",
    "training_ask",
    "training_limits",
    "ways_out",
]

CHECKPOINTING_COST = "each layer's forward runs again in backward: about one more forward pass per step"


def training_ask(checkpointing: bool | None, target: Target, model: Any, dtype: str, computes: str) -> TrainingAsk:
    """What decides how a training job trains besides its size: checkpointing as asked (and whether the
    model's classes can), the autocast dtype, the dtype QLoRA computes in (the mixed precision's 16-bit
    dtype: bf16 where the device runs it natively, fp16 where only fp16; float32 only where it has
    neither), whether bitsandbytes pages optimizer state here (CUDA unified memory: bitsandbytes'
    get_paged allocates managed memory on the first CUDA device), and whether the optimizer steps in
    place (torch's fused AdamW, Trainer's default from torch 2.8)."""
    from whichdevice.core import packages
    from whichdevice.core.errors import ConfigConflictError

    refusal = None
    if model is not None and checkpointing is not False:
        from whichdevice.model.facts import attention_support

        refusal = attention_support(model).no_checkpointing()
    if refusal is not None and checkpointing is True:
        raise ConfigConflictError(f"gradient_checkpointing=True: {refusal}; pass None or False")
    from whichdevice.memory.quantization import bitsandbytes_supports

    half = computes if computes in ("bfloat16", "float16") else dtype if dtype in ("bfloat16", "float16") else "float32"
    torch_version = packages.package_version("torch")
    supported, why = bitsandbytes_supports(target)
    if supported and packages.package_version("bitsandbytes") is None:
        supported, why = False, "bitsandbytes is not installed (pip install bitsandbytes)"
    return TrainingAsk(
        checkpointing=checkpointing,
        no_checkpointing=refusal,
        compute=computes if computes != dtype else None,
        quantized_compute=half,
        paged=target.name == "cuda" and target.variant != "rocm",
        fused_step=torch_version is None or packages.version_at_least(torch_version, "2.8"),
        no_bitsandbytes=None if supported else why,
    )


def ladder(dtype: str, ask: TrainingAsk, quantize: str | None) -> list[TrainingSetup]:
    """The ways to train, in the order they are tried: full fine-tuning in ``dtype`` (the mixed precision
    computing in ``ask.compute``), LoRA on the base in the compute dtype, QLoRA (``quantize`` allowing);
    each without checkpointing first where the caller left it open."""
    ckpts = checkpointing_choices(ask)
    compute = ask.compute if ask.compute != dtype else None
    base = ask.compute or dtype
    four = "4bit" if quantize != "8bit" else "8bit"
    half = ask.quantized_compute if ask.quantized_compute != "float32" else None
    optimizer = "paged_adamw_8bit" if ask.paged else "adamw"
    quantized = [
        TrainingSetup("qlora", ask.quantized_compute, half, c, optimizer, bits=8 if four == "8bit" else 4)
        for c in ckpts
    ]
    if quantize in ("4bit", "8bit"):
        return quantized  # asked for: placement refuses it with the reason where bitsandbytes cannot
    full = [TrainingSetup("full", dtype, compute, c) for c in ckpts]
    lora = [TrainingSetup("lora", base, ask.compute, c) for c in ckpts]
    return full + lora + (quantized if quantize is not None and ask.no_bitsandbytes is None else [])


def sized_training(model: Any, job: Job, setup: TrainingSetup, ask: TrainingAsk) -> tuple[ModelSize, int, JobMemory]:
    """(the model's size, its weights as ``setup`` holds them, the job's memory besides them)."""
    size = estimate_model_size(model)
    memory = training_memory(size, model_shape(model), job, setup, fused_step=ask.fused_step, attention=ask.attention)
    return size, setup_weights(size, setup), memory


Tried = tuple[TrainingSetup, int, JobMemory]


def _against(fit: JobFit, weights: int, memory: JobMemory) -> str:
    """A way's need beside what the device has for it: its budget, or its memory less what it keeps back."""
    cap = next(iter(fit.caps.values()))
    need = format_bytes(weights + memory.bytes)
    if fit.budget_given:
        return f"{need}, over the {format_bytes(cap)} budget of {fit.device}"
    return f"{need}, over {fit.device}'s {format_bytes(cap)} ({fit.margin.held_back(cap, memory.bytes)})"


def first_need(tried: list[Tried], fit: JobFit | None = None) -> str | None:
    """The first way's need (and what the device has), as a reason (None where nothing was tried before)."""
    if not tried:
        return None
    setup, weights, memory = tried[0]
    need = _against(fit, weights, memory) if fit is not None else format_bytes(weights + memory.bytes)
    return f"{setup.describe()} needs {need}"


def priced_lines(size: ModelSize, setup: TrainingSetup, weights: int, memory: JobMemory) -> list[TraceStep]:
    """The chosen way's trace lines: the model's size as it holds it, what it needs and what it assumed."""
    return [
        TraceStep(
            "model",
            f"{size.parameters / 1e6:.1f}M parameters = {format_bytes(weights)} for {setup.describe()} "
            f"(from {size.source})",
        ),
        TraceStep("memory", f"{setup.describe()}: {memory.describe(weights)}"),
        *(TraceStep("memory", note) for note in memory.assumed),
    ]


def passed_over(tried: list[Tried], fit: JobFit, chosen: TrainingSetup) -> list[TraceStep]:
    """Why the ways before the chosen one were passed over, and what checkpointing costs where it is on."""
    steps = [
        TraceStep("memory", f"{setup.describe()} does not fit: it needs {_against(fit, weights, memory)}")
        for setup, weights, memory in tried
    ]
    if chosen.checkpointing:
        steps.append(
            TraceStep(
                "training",
                f"gradient checkpointing on ({CHECKPOINTING_COST}): training_kwargs() hands over "
                "gradient_checkpointing=True with use_reentrant=False",
            )
        )
    return steps


def lora_step(setup: TrainingSetup) -> TraceStep:
    return TraceStep(
        "warning",
        f"full fine-tuning does not fit; LoRA adapters on the {setup.weights} weights do: wrap the model with "
        "whichdevice.lora_training(model, resolution) (peft) before training",
    )


def training_limits(
    model: Any,
    size: ModelSize,
    job: Job,
    setup: TrainingSetup,
    ask: TrainingAsk,
    fit: JobFit,
    weights: int,
) -> LargestFit | None:
    """The longest length and largest batch the chosen way fits (a sized job only)."""
    from whichdevice.memory.largest import largest_fit

    shape = model_shape(model)
    if shape is None or (job.batch_size is None and job.max_length is None):
        return None

    def need(batch: int, tokens: int) -> int:
        asked = replace(job, batch_size=batch, max_length=tokens)
        return training_memory(size, shape, asked, setup, fused_step=ask.fused_step, attention=ask.attention).bytes

    def fits(extra: int) -> bool:
        return replace(fit, extra=extra).plan(weights).fits

    return largest_fit(shape, job, need, fits, plan=f"for {setup.describe()}")


def ways_out(
    model: Any, job: Job, ask: TrainingAsk, target: Target, fit: JobFit, tried: list[Tried]
) -> DoesNotFitError:
    """Every way that was priced and what it needs, then the ways out that run on this device (no
    bitsandbytes advice where bitsandbytes does not run, no sharding on a device that is not split)."""
    import math

    from whichdevice.memory.quantization import bitsandbytes_supports

    backend = target.backend
    priced_ways = ", ".join(f"{s.label()} {format_bytes(w + m.bytes)}" for s, w, m in tried)
    ways = []
    supported, _ = bitsandbytes_supports(target)
    if supported and not any(s.train == "qlora" for s, _, _ in tried):
        ways.append("quantize='auto' (a 4-bit base with LoRA adapters: QLoRA)")
    full = next(((s, w) for s, w, _ in tried if s.train == "full"), None)
    if supported and full is not None:
        eight = replace(full[0], optimizer="adamw_8bit")
        need = full[1] + sized_training(model, job, eight, ask)[2].bytes
        ways.append(f"an 8-bit optimizer for full fine-tuning (optim='adamw_bnb_8bit': about {format_bytes(need)})")
    if ask.checkpointing is False and ask.no_checkpointing is None:
        ways.append("gradient_checkpointing=True (each layer's activations computed again in backward)")
    one = next(iter(fit.caps.values()))
    # FSDP and DeepSpeed run over a collective library of their own (accelerate's MULTI_* types): not
    # over XLA (TPU) or Neuron's, not in a single shared device.
    shards = backend.distributed_backend not in (None, "xla", "neuron", "gloo") and not backend.shared_device
    if one and not backend.memory_by_name and tried and shards:
        need = min(w + m.bytes for _, w, m in tried)
        count = max(2, math.ceil(need / max(fit.usable(), 1)))
        ways.append(
            f"{count} {backend.name} devices like this one ({format_bytes(one)} each), sharded with FSDP or "
            "DeepSpeed ZeRO-3"
        )
    ways.append("a shorter max_length or a smaller batch_size")
    if not tried:
        return DoesNotFitError(f"The model does not fit {fit.device}. Ways out: {'; '.join(ways)}")
    setup, weights, memory = min(tried, key=lambda t: t[1] + t[2].bytes)
    found = training_limits(
        model, estimate_model_size(model), job, setup, ask, replace(fit, extra=memory.bytes), weights
    )
    said = f" On these devices, {found.text()}." if found is not None else ""
    return DoesNotFitError(
        f"The model does not fit: the lightest way, {setup.describe()}, needs {_against(fit, weights, memory)} "
        f"({memory.figures(weights)}). Every way priced: {priced_ways}.{said} Ways out: {'; '.join(ways)}"
    )
