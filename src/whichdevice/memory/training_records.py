"""How a training job trains, and the plan over several devices: the records placement hands to the resolution.

``TrainingSetup`` is one way to train (full fine-tuning, LoRA, QLoRA; dtypes, checkpointing, the
optimizer), priced by memory/training_job.py; ``TrainingPlan`` every strategy for several devices
(``Strategy``: DDP, ZeRO, FSDP, LoRA, QLoRA), priced by memory/strategy.py, and the one chosen.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.sizes import format_bytes

__all__ = ["LORA_RANK", "OPTIMIZERS", "Strategy", "TrainingPlan", "TrainingSetup"]

# lora_training()'s default rank (training/lora.py): what a plan prices when the rank is not said.
LORA_RANK = 16
# Optimizer state per trained parameter: torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's
# dtype (2 x its size); bitsandbytes' 8-bit AdamW one byte each; the paged ones the same, paged.
OPTIMIZERS = {
    "adamw": ("x", 2.0, "AdamW (Trainer's default)"),
    "adamw_8bit": ("bytes", 2.0, "8-bit AdamW (bitsandbytes)"),
    "paged_adamw_8bit": ("bytes", 2.0, "paged 8-bit AdamW (bitsandbytes)"),
    "paged_adamw_32bit": ("bytes", 8.0, "paged 32-bit AdamW (bitsandbytes)"),
    "sgd": ("x", 0.0, "SGD"),
}


@frozen_record
class TrainingSetup:
    """How a job trains: what (``full``, ``lora``, ``qlora``), the trained or frozen weights' dtype, the
    autocast dtype (None: none), checkpointing, the optimizer, LoRA's rank, and whether a sharding
    strategy (FSDP, DeepSpeed) computes on 16-bit weights of its own instead of autocast copies."""

    train: str = "full"
    weights: str = "float32"
    compute: str | None = None
    # None: not decided (the job's sequences were not given, so its activations were not priced).
    checkpointing: bool | None = False
    optimizer: str = "adamw"
    lora_r: int = LORA_RANK
    sharded: bool = False
    bits: int = 4  # QLoRA's base: bitsandbytes' 4-bit NF4, or its 8-bit int8
    # Once chosen: the adapters' parameters it priced (LoRA, QLoRA), and what was passed over for it and why.
    adapters: int | None = field(default=None, compare=False)
    passed_over: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.train,
            "weights": "4bit"
            if self.train == "qlora" and self.bits == 4
            else "8bit"
            if self.train == "qlora"
            else self.weights,
            "compute_dtype": self.compute or (self.weights if self.train != "qlora" else "float32"),
            "gradient_checkpointing": self.checkpointing,
            "optimizer": self.optimizer,
            "lora_r": self.lora_r if self.train != "full" else None,
            "adapter_parameters": self.adapters,
            "instead_of": self.passed_over,
        }

    @property
    def paged(self) -> bool:
        return self.optimizer.startswith("paged_")

    def label(self) -> str:
        """A few words for a list of the ways priced."""
        name = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA" if self.bits == 4 else "8-bit LoRA"}
        return name[self.train] + (" checkpointed" if self.checkpointing else "")

    def describe(self) -> str:
        what = {
            "full": "full fine-tuning",
            "lora": "LoRA adapters",
            "qlora": f"{'QLoRA' if self.bits == 4 else 'LoRA'} ({self.bits}-bit base, LoRA adapters)",
        }
        base = (
            f" on {self.weights} weights"
            if self.train == "lora"
            else f" in {self.weights}"
            if self.train == "full"
            else ""
        )
        computes = f", computing in {self.compute}" if self.compute and self.compute != self.weights else ""
        ckpt = ", gradient checkpointing" if self.checkpointing else ""
        return f"{what[self.train]}{base}{computes}{ckpt}"


_NAMES = {
    "ddp": "DDP",
    "zero2": "DeepSpeed ZeRO-2",
    "fsdp": "FSDP full shard",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp_offload": "FSDP full shard with parameters and optimizer state offloaded to the CPU",
    "lora": "LoRA adapters on the frozen base",
    "qlora": "QLoRA (4-bit base, LoRA adapters)",
}


@frozen_record
class Strategy:
    """One way to train: its bytes per device, the formula, and whether (or why not) it can run here."""

    key: str
    per_device: int
    formula: str
    fits: bool
    unavailable: str | None = None  # why it cannot run at all (a package missing), None when it can
    cpu_bytes: int = 0  # host memory it needs per node (offload)
    label: str | None = None  # the name of a strategy the launch carries ("DeepSpeed ZeRO-3 ..."), else _NAMES'

    @property
    def name(self) -> str:
        return self.label or _NAMES[self.key]

    def line(self, budget: int) -> str:
        if self.unavailable:
            return f"{self.name}: not considered, {self.unavailable}"
        verdict = "fits" if self.fits else "does not fit"
        need = format_bytes(self.per_device)
        return f"{self.name}: {self.formula} = {need} per device, {verdict} {format_bytes(budget)}"


@frozen_record
class TrainingPlan:
    """Every strategy for ``devices`` devices, and the first that fits (``chosen``, None if none does)."""

    devices: int
    budget: int
    strategies: tuple[Strategy, ...]
    layer_classes: tuple[str, ...] = ()
    chosen: Strategy | None = None
    compute_dtype: str = "float32"
    notes: tuple[str, ...] = field(default=())
    # The variables the chosen strategy came from, where the launch carries it (None: whichdevice chose).
    launched: str | None = None
    # Whether the strategies were priced with gradient checkpointing (which training_kwargs() then hands
    # over); None: not decided (the job's sequences were not given, so no activations were priced).
    checkpointing: bool | None = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "budget_bytes": self.budget,
            "chosen": self.chosen.key if self.chosen else None,
            "launched": self.launched,
            "gradient_checkpointing": self.checkpointing,
            "strategies": [
                {"strategy": s.key, "bytes_per_device": s.per_device, "formula": s.formula, "fits": s.fits}
                for s in self.strategies
            ],
        }

    def totals(self) -> str:
        """Each strategy's total only (the formulas are in the trace): an error stays whole under its length limit."""
        table = "; ".join(
            f"{s.name}: not considered, {s.unavailable}" if s.unavailable else f"{s.name}: {format_bytes(s.per_device)}"
            for s in self.strategies
        )
        return f"On {self.devices} devices, per device against {format_bytes(self.budget)}: {table}"

    def kwargs(self) -> dict[str, Any]:
        """TrainingArguments keywords that run the chosen strategy (none for DDP, LoRA and QLoRA, and none
        for a strategy the launch carries: a keyword would replace it, launch_strategy.py says how)."""
        key = self.chosen.key if self.chosen and self.launched is None else None
        if key in ("fsdp", "fsdp_offload"):
            # transformers 5 takes fsdp=True with everything in fsdp_config (a string is deprecated).
            config: dict[str, Any] = {"version": 2, "reshard_after_forward": True}
            if self.layer_classes:
                config["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
                config["transformer_layer_cls_to_wrap"] = list(self.layer_classes)
            if key == "fsdp_offload":
                config["cpu_offload"] = True
            return {"fsdp": True, "fsdp_config": config}
        if key in ("zero2", "zero3"):
            zero: dict[str, Any] = {"stage": 2 if key == "zero2" else 3}
            return {"deepspeed": {"zero_optimization": zero, **_DEEPSPEED_AUTO}}
        return {}


# Trainer fills "auto" from TrainingArguments (transformers/integrations/deepspeed.py, trainer_config_process).
_DEEPSPEED_AUTO = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}
