"""The TrainingArguments keywords for a device, a mixed precision, a process group and compile."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.launch.distributed import process_group_backend

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.launch.context import DistributedContext

__all__ = ["checkpointing_kwargs", "training_kwargs_for"]


def training_kwargs_for(
    backend: Backend,
    mixed_precision: str | None,
    distributed: DistributedContext | None,
    *,
    torch_compile: bool = False,
) -> dict[str, Any]:
    """TrainingArguments keywords for training on ``backend`` with ``mixed_precision`` ("bf16", "fp16"
    or None), see ``Resolution.training_kwargs``. Both precision flags are always stated: TRL's
    SFTConfig, DPOConfig and GRPOConfig default to ``bf16=True``."""
    kwargs: dict[str, Any] = {}
    if backend.name == "cpu":
        # use_cpu is TrainingArguments' switch for the CPU itself (no other row has one); it is
        # also what lets bf16=True pass TrainingArguments' own check on CPU.
        kwargs["use_cpu"] = True
    kwargs["bf16"] = mixed_precision == "bf16"
    kwargs["fp16"] = mixed_precision == "fp16"
    ddp_backend = process_group_backend(backend, distributed)
    if ddp_backend:
        # Only when really distributed: any ddp_backend in a single process makes
        # TrainingArguments fail with "Default process group has not been initialized".
        kwargs["ddp_backend"] = ddp_backend
    if torch_compile:
        kwargs["torch_compile"] = True
        if backend.compile_backend and backend.compile_backend != "inductor":
            kwargs["torch_compile_backend"] = backend.compile_backend
    return kwargs


def checkpointing_kwargs(on: bool = True) -> dict[str, Any]:
    """TrainingArguments keywords that turn gradient checkpointing on, non-reentrant (as peft and
    transformers recommend; the reentrant variant needs inputs that require grad), or state it off,
    under the names the installed transformers uses (``activation_checkpointing`` from transformers
    5.x, where ``gradient_checkpointing`` is its deprecated alias). Imports transformers."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {flag: True, f"{flag}_kwargs": {"use_reentrant": False}} if on else {flag: False}
