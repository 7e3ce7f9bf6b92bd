"""LoRA fine-tuning of a (quantized) model: the PEFT model and the TrainingArguments that suit it.

A model too big to train in full is loaded in 4-bit (``resolve_device(model=..., quantize="auto")``)
and trained through LoRA adapters (QLoRA). :func:`lora_training` does the PEFT half of that:
``prepare_model_for_kbit_training`` for a k-bit model, a ``LoraConfig`` whose target modules come
from the model's own layers, and :meth:`LoraTraining.training_arguments` with the settings k-bit
training wants. peft is imported only when this is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.import_noise import quiet_import_noise
from whichdevice.resolve.arguments import check_checkpointing, check_lora_arguments
from whichdevice.training.arguments import _CHECKPOINTING, check_resolution

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from whichdevice.resolve.resolver import Resolution

__all__ = ["LoraTraining", "kbit_training_kwargs", "lora_target_modules", "lora_training"]

# Heads that get trained in full (PEFT's modules_to_save) or not at all, never through LoRA:
# PEFT's SEQ_CLS_HEAD_NAMES plus the question-answering head.
_HEAD_NAMES = ("lm_head", "score", "classifier", "qa_outputs")

# transformers class-name suffix -> PEFT TaskType
_TASK_TYPES = (
    ("ForCausalLM", "CAUSAL_LM"),
    ("LMHeadModel", "CAUSAL_LM"),
    ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
    ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"),
    ("ForSequenceClassification", "SEQ_CLS"),
    ("ForTokenClassification", "TOKEN_CLS"),
    ("ForQuestionAnswering", "QUESTION_ANS"),
)


@frozen_record
class LoraTraining:
    """A PEFT LoRA model ready for ``Trainer`` and the settings that go with it.

    ``model`` is the ``peft.PeftModel``; pass ``training_arguments(output_dir, ...)`` to Trainer.
    """

    model: Any
    lora_config: Any
    resolution: Resolution
    target_modules: tuple[str, ...] | str
    target_source: str
    task_type: str | None
    bits: int | None
    gradient_checkpointing: bool
    trainable_parameters: int
    total_parameters: int
    notes: tuple[str, ...] = field(default=())

    def training_kwargs(self) -> dict[str, Any]:
        """TrainingArguments keywords for this model: the resolution's device and precision
        settings plus what k-bit/LoRA training wants (see :func:`kbit_training_kwargs`)."""
        return {
            **self.resolution.training_kwargs(),
            **kbit_training_kwargs(self.resolution, self.bits, gradient_checkpointing=self.gradient_checkpointing),
        }

    def training_arguments(self, output_dir: str | None = None, **kwargs: Any) -> TrainingArguments:
        """A real ``TrainingArguments``: every keyword you pass is kept as passed; whichdevice adds
        the device, precision and k-bit settings you left out (and refuses conflicting ones)."""
        from whichdevice.training.arguments import training_arguments

        ours = kbit_training_kwargs(self.resolution, self.bits, gradient_checkpointing=self.gradient_checkpointing)
        for pair in _CHECKPOINTING:
            if any(name in kwargs for name in pair):
                # The user's choice under either name: do not put ours beside it under the other.
                for name in pair:
                    ours.pop(name, None)
        return training_arguments(output_dir, resolution=self.resolution, **{**ours, **kwargs})

    def explain(self) -> str:
        share = 100 * self.trainable_parameters / max(self.total_parameters, 1)
        what = f"{self.bits}-bit" if self.bits else "unquantized"
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        lines = [
            f"LoRA on a {what} model on {self.resolution.device} (task {self.task_type or 'unknown'})",
            f"  target modules: {targets} ({self.target_source})",
            f"  trainable: {self.trainable_parameters:,} of {self.total_parameters:,} parameters ({share:.2f}%)",
            f"  gradient checkpointing: {'on (use_reentrant=False)' if self.gradient_checkpointing else 'off'}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.resolution.device,
            "bits": self.bits,
            "task_type": self.task_type,
            "target_modules": (
                self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
            ),
            "target_source": self.target_source,
            "r": getattr(self.lora_config, "r", None),
            "lora_alpha": getattr(self.lora_config, "lora_alpha", None),
            "gradient_checkpointing": self.gradient_checkpointing,
            "trainable_parameters": self.trainable_parameters,
            "total_parameters": self.total_parameters,
            "notes": list(self.notes),
        }


def _quantized_bits(model: Any) -> int | None:
    if getattr(model, "is_loaded_in_4bit", False):
        return 4
    if getattr(model, "is_loaded_in_8bit", False):
        return 8
    return None


def _task_type(model: Any) -> str | None:
    name = type(model).__name__
    for suffix, task in _TASK_TYPES:
        if name.endswith(suffix):
            return task
    return None


def _is_linear(module: Any) -> bool:
    import torch

    if isinstance(module, torch.nn.Linear):  # also bitsandbytes' Linear4bit and Linear8bitLt
        return True
    return type(module).__name__ == "Conv1D"  # GPT-2 style: transformers.pytorch_utils.Conv1D


def lora_target_modules(model: Any) -> tuple[tuple[str, ...], str]:
    """(LoRA target module names, where they came from) for ``model``'s architecture.

    Every linear layer (QLoRA: adapting all of them is what matches full fine-tuning), named by
    its last component ("q_proj", "down_proj", ...), except the output head. When the model has no
    linear layers PEFT recognises, PEFT's own default for the model type.
    """
    heads: set[int] = set()
    get_output = getattr(model, "get_output_embeddings", None)
    if callable(get_output):
        output = get_output()
        if output is not None:
            heads.add(id(output))
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if head is not None:
            heads.add(id(head))
    keep: set[str] = set()
    skipped: set[str] = set()
    for full_name, module in model.named_modules():
        if not full_name or not _is_linear(module):
            continue
        leaf = full_name.rsplit(".", 1)[-1]
        (skipped if id(module) in heads else keep).add(leaf)
    refused = {leaf for leaf in keep if _peft_refuses(model, leaf)}
    keep -= refused
    if keep and refused:
        why = f"every linear layer except those peft refuses for this architecture ({', '.join(sorted(refused))})"
        if skipped:
            why += f" and the output head ({', '.join(sorted(skipped))})"
        return tuple(sorted(keep)), why
    if keep:
        if keep & skipped:
            # A head shares its leaf name with a body layer: name the body layers in full instead.
            full = sorted(n for n, m in model.named_modules() if n and _is_linear(m) and id(m) not in heads)
            return tuple(full), f"every linear layer except the output head ({', '.join(sorted(skipped))})"
        why = "every linear layer of the model"
        if skipped:
            why += f" except the output head ({', '.join(sorted(skipped))})"
        return tuple(sorted(keep)), why
    mapping = _peft().utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    default = mapping.get(model_type or "")
    if default:
        return tuple(default), f"PEFT's default for model type {model_type!r}"
    raise DeviceError(
        f"cannot find layers for LoRA in {type(model).__name__} (no linear layers, and PEFT has no default "
        f"for model type {model_type!r}); pass target_modules=[...]"
    )


def _peft_refuses(model: Any, leaf: str) -> bool:
    """Whether peft's own check refuses LoRA on layers named ``leaf`` in this model (Mamba's out_proj and
    conv1d, peft/tuners/tuners_utils.py); False where the installed peft has no such check."""
    import peft
    from peft.tuners import tuners_utils

    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return False
    try:
        check(peft.LoraConfig(target_modules=[leaf]), model, leaf)
    except ValueError:
        return True
    return False


def kbit_training_kwargs(
    resolution: Resolution, bits: int | None, *, gradient_checkpointing: bool | None = None
) -> dict[str, Any]:
    """TrainingArguments keywords for LoRA on a ``bits``-bit model (None: unquantized).

    Gradient (activation) checkpointing without the reentrant variant where it is on
    (``gradient_checkpointing``; None: as the resolution's plan priced it, on where it has no plan, as
    PEFT does for k-bit training); a paged 8-bit AdamW (QLoRA) on NVIDIA GPUs, where bitsandbytes' paged
    optimizers work (and the plan priced it); ``ddp_find_unused_parameters=False`` under DDP, which
    checkpointing needs. The keyword names follow the installed transformers (``activation_checkpointing``
    in 5.x).
    """
    from whichdevice.launch.trainer_kwargs import checkpointing_kwargs

    check_resolution(resolution)
    if bits not in (None, 4, 8) or isinstance(bits, bool):
        raise DeviceError(f"bits={bits!r}: 4, 8, or None for an unquantized model")
    check_checkpointing(gradient_checkpointing)
    checkpointing = planned_checkpointing(resolution) if gradient_checkpointing is None else gradient_checkpointing
    kwargs: dict[str, Any] = checkpointing_kwargs(checkpointing)
    # bitsandbytes' paged optimizers page through CUDA unified memory: NVIDIA GPUs only.
    if bits is not None and resolution.backend.name == "cuda" and resolution.probe.variant != "rocm":
        kwargs["optim"] = "paged_adamw_8bit"
    if resolution.distributed is not None and checkpointing:
        kwargs["ddp_find_unused_parameters"] = False
    return kwargs


def planned_checkpointing(resolution: Resolution) -> bool:
    """Gradient checkpointing as the resolution's plan priced it; on where it has no plan (PEFT's default
    for k-bit training)."""
    planned = resolution.gradient_checkpointing
    return True if planned is None else planned


def _enable_checkpointing(model: Any) -> None:
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def _model_device(model: Any) -> str:
    # PreTrainedModel.device: where the first parameter is (the first device of a split model).
    device = getattr(model, "device", None)
    if device is None:
        raise DeviceError(f"cannot tell which device {type(model).__name__} is on; pass resolution=")
    return str(device)


def lora_training(
    model: Any,
    resolution: Resolution | None = None,
    *,
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    target_modules: Sequence[str] | str | None = None,
    task_type: str | None = None,
    gradient_checkpointing: bool | None = None,
    **lora_kwargs: Any,
) -> LoraTraining:
    """Wrap a loaded (usually k-bit quantized) transformers model in PEFT LoRA adapters for training.

    ``resolution`` is what the model was loaded with (``resolve_device(model=..., task="training")``);
    without one, the model's own device is resolved. A 4-/8-bit model goes through PEFT's
    ``prepare_model_for_kbit_training`` (frozen base, norms and head upcast to fp32). Target modules
    default to every linear layer except the output head (see :func:`lora_target_modules`);
    ``target_modules``, ``task_type`` and any other ``LoraConfig`` keyword you pass are used as
    passed. ``gradient_checkpointing`` (non-reentrant): None does what the resolution's plan priced (on
    where the job fits only with it; on without a plan). ``notes`` says what differs from the plan.
    """
    check_lora_arguments(r, lora_alpha, lora_dropout, target_modules, gradient_checkpointing)
    check_resolution(resolution)
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        raise ConfigConflictError(
            f"{type(model).__name__} already has PEFT adapters; pass the base model loaded with from_pretrained"
        )
    if resolution is None:
        from whichdevice.resolve.resolver import resolve_device

        resolution = resolve_device(_model_device(model), task="training")
    bits = _quantized_bits(model)
    notes = _resolution_notes(resolution, bits)
    if gradient_checkpointing is None:
        gradient_checkpointing = planned_checkpointing(resolution)
    notes += _prepare(peft, model, bits, gradient_checkpointing)
    chosen, source = _targets(model, target_modules)
    task = task_type or _task_type(model)
    if task is None:
        notes.append(f"task type unknown for {type(model).__name__}; pass task_type= if PEFT needs it")
    config = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=chosen if isinstance(chosen, str) else list(chosen),
        task_type=task,
        **lora_kwargs,
    )
    peft_model = peft.get_peft_model(model, config)
    trainable, total = peft_model.get_nb_trainable_parameters()
    notes += _priced_notes(resolution, int(trainable), r, gradient_checkpointing)
    return LoraTraining(
        model=peft_model,
        lora_config=config,
        resolution=resolution,
        target_modules=chosen,
        target_source=source,
        task_type=task,
        bits=bits,
        gradient_checkpointing=gradient_checkpointing,
        trainable_parameters=int(trainable),
        total_parameters=int(total),
        notes=tuple(notes),
    )


def _peft() -> Any:
    try:
        with quiet_import_noise():  # peft imports bitsandbytes
            import peft
    except ImportError as exc:  # pragma: no cover - peft is a declared extra
        raise DeviceError(f"LoRA training needs peft ({exc}): pip install peft") from exc
    return peft


def _resolution_notes(resolution: Resolution, bits: int | None) -> list[str]:
    """What does not match between the resolution and the model as loaded."""
    notes = []
    planned = resolution.quantization
    if planned is not None and bits != planned.bits:
        loaded = f"{bits}-bit" if bits else "without quantization"
        notes.append(
            f"the resolution planned {planned.bits}-bit weights but the model was loaded {loaded}; load it "
            "with from_pretrained(..., **resolution.model_kwargs())"
        )
    if resolution.task != "training":
        notes.append("the resolution is for inference; resolve_device(..., task='training') matches training")
    return notes


def _priced_notes(resolution: Resolution, trainable: int, r: int, checkpointing: bool) -> list[str]:
    """What differs from the plan the resolution priced: the adapters' parameters (rank, targets), and
    checkpointing, each with what it changes."""
    from whichdevice.core.sizes import format_bytes
    from whichdevice.memory.training_records import OPTIMIZERS

    setup = resolution.training_setup
    if setup is None or setup.train == "full" or setup.adapters is None:
        return []
    notes = []
    if abs(trainable - setup.adapters) > 0.05 * setup.adapters:
        unit, factor, _ = OPTIMIZERS[setup.optimizer]
        per = 4 + 4 + (factor * 4 if unit == "x" else factor)  # fp32 weight and gradient, the optimizer's state
        delta = int((trainable - setup.adapters) * per)
        more = "more" if delta > 0 else "less"
        notes.append(
            f"the resolution priced {setup.adapters:,} adapter parameters (rank {setup.lora_r}); these are "
            f"{trainable:,} (r={r}): {format_bytes(abs(delta))} {more} for their weights, gradients and "
            "optimizer state"
        )
    if setup.checkpointing is not None and checkpointing != setup.checkpointing:
        said = "on" if setup.checkpointing else "off"
        notes.append(
            f"the resolution priced gradient checkpointing {said}; it is {'on' if checkpointing else 'off'} here"
            + (": the activations it priced no longer bound the step" if not checkpointing else "")
        )
    return notes


def _prepare(peft: Any, model: Any, bits: int | None, gradient_checkpointing: bool) -> list[str]:
    """Freeze the base model (PEFT's k-bit preparation for a quantized one); checkpoint activations."""
    notes = []
    if bits is not None:
        # Checkpointing is switched on below, non-reentrant, through the non-deprecated method.
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        notes.append(f"{bits}-bit base frozen by prepare_model_for_kbit_training; norms and head upcast to fp32")
    else:
        for param in model.parameters():
            param.requires_grad_(False)
    if gradient_checkpointing:
        _enable_checkpointing(model)
    return notes


def _targets(model: Any, target_modules: Sequence[str] | str | None) -> tuple[tuple[str, ...] | str, str]:
    """(the LoRA target modules, where they came from): yours as passed, else the model's linear layers."""
    if target_modules is None:
        return lora_target_modules(model)
    chosen = target_modules if isinstance(target_modules, str) else tuple(target_modules)
    return chosen, "as you passed"
