"""What a training job needs besides the weights: gradients, optimizer state and activations, at their peak.

A step of Trainer has three moments that can peak, and the job needs the highest:

* the loss and the head's backward: every activation the forward kept, the loss's own (memory/activations.py
  measured them), the head's gradients, and the optimizer state from the step before;
* the layers' backward: the activations still kept, the gradients made so far (they grow as the kept
  activations are freed, so the two ends are the candidates: the first layer's backward with the head's
  gradients, the last with every gradient);
* the optimizer step: every gradient and the whole optimizer state (bitsandbytes' paged optimizers page
  their state to CPU memory through CUDA unified memory, so it is counted there, and on the device only a
  tensor's state at a time).

What is trained decides the rest: full fine-tuning trains every parameter; LoRA (``lora_training``) trains
rank-r adapters on every linear layer but the head (r x their rows plus columns parameters, kept in
float32 by peft) on a frozen base in the compute dtype; QLoRA does the same on a 4-bit base whose other
weights peft's ``prepare_model_for_kbit_training`` upcasts to float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.dtypes import item_size
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.activations import ActivationMode, Activations, training_activations
from whichdevice.memory.job import WORKSPACE, JobMemory, Term
from whichdevice.memory.training_records import OPTIMIZERS, TrainingSetup

if TYPE_CHECKING:
    from whichdevice.core.job import Job
    from whichdevice.model.shape import ModelShape
    from whichdevice.model.size import ModelSize

__all__ = [
    "TrainingAsk",
    "adapter_parameters",
    "checkpointing_choices",
    "setup_weights",
    "training_memory",
]

# Where bitsandbytes could not say what a rank-r adapter adds (no linear layout read): at most this share.
_ADAPTER_FALLBACK = 0.02


class TrainingAsk(NamedTuple):
    """What decides how a job trains besides its size: ``checkpointing`` as the caller set it (None:
    decide), why the model cannot checkpoint (None: it can), the autocast dtype the mixed precision runs
    (None: none), the dtype QLoRA's 4-bit layers compute in, and whether bitsandbytes pages its
    optimizer state on this device (CUDA unified memory: an NVIDIA GPU)."""

    checkpointing: bool | None = None
    no_checkpointing: str | None = None
    compute: str | None = None
    quantized_compute: str = "float32"
    paged: bool = False
    fused_step: bool = True
    # Why bitsandbytes cannot quantize here (its own device list, Gaudi 1, not installed); None where it can.
    no_bitsandbytes: str | None = None
    # The attention the model runs ("eager" keeps its T x T scores; None or another name is priced as sdpa).
    attention: str | None = None


def checkpointing_choices(ask: TrainingAsk) -> list[bool]:
    """Gradient checkpointing as the ways are tried: off then on where it is open, else as pinned."""
    if ask.no_checkpointing is not None or ask.checkpointing is False:
        return [False]
    return [True] if ask.checkpointing else [False, True]


def adapter_parameters(size: ModelSize, rank: int) -> tuple[int, str]:
    """The parameters rank-``rank`` LoRA adapters add on every linear layer but the head, and how that
    was counted."""
    if size.lora_fan:
        return rank * size.lora_fan, f"rank {rank} on every linear layer but the head"
    return int(size.parameters * _ADAPTER_FALLBACK), "up to 2% of the parameters (the linear layers were not read)"


def setup_weights(size: ModelSize, setup: TrainingSetup) -> int:
    """The weights' bytes as the setup holds them: the trained or frozen weights in their dtype, or the
    4-bit base with everything bitsandbytes leaves unquantized in float32 (peft's k-bit preparation)."""
    if setup.train == "qlora":
        return size.bytes_quantized(setup.bits, "float32")
    return size.bytes_in(setup.weights)


def _activation_mode(setup: TrainingSetup, attention: str | None) -> ActivationMode:
    eager = "eager" if attention == "eager" else "sdpa"
    ckpt = bool(setup.checkpointing)
    if setup.train == "full" and setup.sharded:
        return ActivationMode("full", setup.compute or setup.weights, None, eager, ckpt)
    return ActivationMode(setup.train, setup.weights, setup.compute, eager, ckpt)


class _State(NamedTuple):
    """What training holds besides activations: the trained parameters, their gradients' item size and
    bytes, the optimizer's bytes per parameter and in all, and the terms that say so."""

    trained: int
    grad_size: int
    grads: int
    per: float
    optim: int
    terms: list[Term]


def _state(size: ModelSize, setup: TrainingSetup) -> _State:
    terms = []
    if setup.train == "full":
        trained, who, grad_size = size.parameters, "every parameter", item_size(setup.weights)
    else:
        trained, how = adapter_parameters(size, setup.lora_r)
        who = f"the LoRA adapters ({trained / 1e6:.1f}M parameters: {how})"
        grad_size = 4  # peft keeps adapters in float32 (autocast_adapter_dtype)
        terms.append(Term("adapters", trained * 4, f"{who} in float32"))
    unit, factor, name = OPTIMIZERS[setup.optimizer]
    per = factor * grad_size if unit == "x" else factor
    paged = " (paged: in CPU memory while the device is short, so counted at the step only)" if setup.paged else ""
    grads, optim = trained * grad_size, int(trained * per)
    terms += [
        Term("gradients", grads, f"{who} in {'float32' if setup.train != 'full' else setup.weights}"),
        Term("optimizer state", optim, f"{name}: {per:g} bytes per trained parameter{paged}"),
    ]
    return _State(trained, grad_size, grads, per, optim, terms)


def _activations(
    size: ModelSize, shape: ModelShape, job: Job, setup: TrainingSetup, attention: str | None
) -> tuple[Term, Activations, list[str]]:
    """The activations' term, as measured, and what its pricing assumed."""
    assumed: list[str] = []
    batch = job.batch_size or 1
    tokens = job.max_length or min(shape.max_positions or 2048, 2048)
    if job.batch_size is None:
        assumed.append("batch_size=1 assumed")
    if job.max_length is None:
        assumed.append(f"max_length={tokens} assumed (the model's context, at most 2048)")
    if setup.train == "qlora" and setup.bits != 4:
        assumed.append("activations: an 8-bit base priced with the 4-bit base's measured activations")
    largest = size.largest_linear or shape.hidden * max(shape.intermediate, shape.hidden)
    mode = _activation_mode(setup, attention)
    acts = training_activations(shape, mode, batch, tokens, params=size.parameters, largest_weight=largest)
    if acts.note:
        assumed.append(f"activations: {acts.note}")
    ckpt = "; checkpointed: each layer keeps its input and is computed again in backward" if setup.checkpointing else ""
    why = (
        f"{batch} x {tokens} tokens, measured on transformers' {acts.family} ({acts.mode}): the forward keeps "
        f"{format_bytes(acts.kept)}, the loss and head peak at {format_bytes(acts.head_peak)}, the layers' "
        f"backward at {format_bytes(acts.layers_peak)}{ckpt}"
    )
    return Term("activations", acts.peak, why), acts, assumed


def training_memory(
    size: ModelSize,
    shape: ModelShape | None,
    job: Job,
    setup: TrainingSetup,
    *,
    fused_step: bool = True,
    attention: str | None = None,
) -> JobMemory:
    """The memory ``job`` trained as ``setup`` needs besides the weights (``setup_weights``), at its peak.
    ``fused_step``: the optimizer updates in place (torch's fused AdamW, Trainer's default from torch 2.8);
    else its foreach step makes one float32 copy of the trained parameters. ``attention``: what the model
    runs ("eager" keeps its T x T scores; anything else is priced as sdpa)."""
    state = _state(size, setup)
    terms = list(state.terms)
    if shape is None or (job.batch_size is None and job.max_length is None):
        why = "the config does not give layers and heads" if shape is None else "pass max_length= (and batch_size=)"
        return JobMemory(tuple(terms), (f"activations not counted: {why}",))
    term, acts, assumed = _activations(size, shape, job, setup, attention)
    terms += [term, Term("workspace", WORKSPACE, "the runtime's allocator caches and kernels' scratch")]
    adapters = state.trained * 4 if setup.train != "full" else 0
    # The head's gradients are made first in backward (a tied head's are the embedding's).
    head_grads = shape.vocab * shape.hidden * state.grad_size if setup.train == "full" else 0
    resident = 0 if setup.paged else state.optim
    phases = (acts.head_peak + head_grads, acts.layers_peak + head_grads, acts.layers_end + state.grads)
    backward = resident + max(phases)
    # Paged state comes to the device a layer's tensors at a time; a foreach step copies the parameters.
    step = state.grads + (state.optim // max(shape.layers, 1) if setup.paged else state.optim)
    step += 0 if fused_step or state.per == 0 else state.trained * 4
    where = (
        "the optimizer step (every gradient and the optimizer state)"
        if step > backward
        else "backward (the activations, the gradients made so far and the optimizer state of the step before)"
    )
    peak = adapters + WORKSPACE + max(backward, step)
    return JobMemory(tuple(terms), tuple(assumed), peak=peak, phase=f"training peaks at {where}")
