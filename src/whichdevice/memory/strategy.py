"""How to train a model on several devices: each strategy's memory per device, and the first that fits.

For ``task="training"`` with a model and N devices (this launch's ranks, or the devices one process
sees), every strategy is sized per device from memory/job.py's terms, P parameters, the weights'
dtype (``w`` bytes, float32 under mixed precision) and the compute dtype (``c`` bytes):

=================  ============================================================================
DDP                W + G + G (DDP's gradient buckets) + O + A: every rank holds the whole job
ZeRO-2             W + (G + O) / N + A; DeepSpeed's own figure: 4P + 16P/N (needs deepspeed)
FSDP full shard    (W + G + O) / N + (root unit + 2 layers) gathered in c + 2 x the largest unit's G + A
ZeRO-3             DeepSpeed's own figure: 4 x largest layer + 18P/N + A (needs deepspeed)
FSDP + offload     the same gathered units + A on the device; W + G + O in CPU memory
LoRA               P x c (frozen base) + adapters' weights, gradients, AdamW state + A
QLoRA              4-bit base + the same adapter terms + A
=================  ============================================================================

(W weights, G gradients, O optimizer state, A activations and workspace for the per-device batch;
the DeepSpeed figures are ``estimate_zero2/3_model_states_mem_needs`` in deepspeed/runtime/zero.)

The order is speed first, then memory, full fine-tuning before adapters: DDP communicates once per
step (one all-reduce); ZeRO-2 moves the same volume (reduce-scatter + all-gather) and keeps a 1/N
share of gradients and optimizer state; FSDP full shard gathers every layer's weights again in the
backward pass (1.5x DDP's volume) and is torch's own (no package); ZeRO-3 does the same through
deepspeed; FSDP with offload copies weights and gradients over the host link every step and runs
AdamW on the CPU (several times slower); LoRA and QLoRA train about 2% of the parameters, which
changes the result, so they come last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from whichdevice.core.sizes import format_bytes
from whichdevice.memory.job import ADAPTER_FRACTION, JobMemory
from whichdevice.model.shape import ModelShape

__all__ = ["FULL", "ORDER", "Strategy", "TrainingPlan", "layer_parameters", "plan_strategies"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
ORDER = ("ddp", "zero2", "fsdp", "zero3", "fsdp_offload", "lora", "qlora")
FULL = ("ddp", "zero2", "fsdp", "zero3", "fsdp_offload")
_NAMES = {
    "ddp": "DDP",
    "zero2": "DeepSpeed ZeRO-2",
    "fsdp": "FSDP full shard",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp_offload": "FSDP full shard with parameters and optimizer state offloaded to the CPU",
    "lora": "LoRA adapters on the frozen base",
    "qlora": "QLoRA (4-bit base, LoRA adapters)",
}


@dataclass(frozen=True)
class Strategy:
    """One way to train: its bytes per device, the formula, and whether (or why not) it can run here."""

    key: str
    per_device: int
    formula: str
    fits: bool
    unavailable: str | None = None  # why it cannot run at all (a package missing), None when it can
    cpu_bytes: int = 0  # host memory it needs per node (offload)

    @property
    def name(self) -> str:
        return _NAMES[self.key]

    def line(self, budget: int) -> str:
        if self.unavailable:
            return f"{self.name}: not considered, {self.unavailable}"
        verdict = "fits" if self.fits else "does not fit"
        need = format_bytes(self.per_device)
        return f"{self.name}: {self.formula} = {need} per device, {verdict} {format_bytes(budget)}"


@dataclass(frozen=True)
class TrainingPlan:
    """Every strategy for ``devices`` devices, and the first that fits (``chosen``, None if none does)."""

    devices: int
    budget: int
    strategies: tuple[Strategy, ...]
    layer_classes: tuple[str, ...] = ()
    chosen: Strategy | None = None
    compute_dtype: str = "float32"
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "budget_bytes": self.budget,
            "chosen": self.chosen.key if self.chosen else None,
            "strategies": [
                {"strategy": s.key, "bytes_per_device": s.per_device, "formula": s.formula, "fits": s.fits}
                for s in self.strategies
            ],
        }

    def kwargs(self) -> dict[str, Any]:
        """TrainingArguments keywords that run the chosen strategy (none for DDP, LoRA and QLoRA)."""
        key = self.chosen.key if self.chosen else None
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


def layer_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder layer: q, k, v, o, the gated MLP (3 matrices) and two norms."""
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    return attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden


def _term(memory: JobMemory, name: str) -> int:
    return sum(t.bytes for t in memory.terms if t.name == name)


def plan_strategies(
    *,
    params: int,
    shape: ModelShape | None,
    dtype: str,
    compute_dtype: str,
    full: JobMemory,
    adapters: JobMemory,
    qlora_base: int,
    devices: int,
    budget: int,
    cpu_memory: int | None,
    deepspeed: bool,
    layer_classes: tuple[str, ...] = (),
    no_fsdp: str | None = None,
    no_qlora: str | None = None,
) -> TrainingPlan:
    """Size every strategy for ``devices`` devices of ``budget`` bytes each and choose the first that fits.

    ``full`` and ``adapters`` are job_memory()'s terms for full training and for LoRA adapters
    (per device: the per-device batch); ``qlora_base`` the 4-bit weights' bytes; ``no_fsdp`` says
    why FSDP cannot run here, ``no_qlora`` why QLoRA may not (None where they can).
    """
    w, c, n = _ITEMSIZE.get(dtype, 4), _ITEMSIZE.get(compute_dtype, 4), max(devices, 1)
    weights, grads, optim = params * w, _term(full, "gradients"), _term(full, "optimizer state")
    act = _term(full, "activations") + _term(full, "workspace")
    layer = layer_parameters(shape) if shape else params
    root = max(0, params - layer * shape.layers) if shape else 0
    # FSDP2 gathers the root unit (embeddings, head) and prefetches the next layer while one computes, in the
    # compute dtype; in backward a unit's unsharded gradients (in w) are copied into one flat reduce-scatter
    # buffer (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce): two copies.
    gathered = (root + 2 * layer) * c + 2 * max(root, layer) * w
    units = f"(root {root / 1e6:.0f}M + 2 x layer {layer / 1e6:.0f}M params) x {c} + 2 x largest unit's G"
    missing = None if deepspeed else "deepspeed is not installed (pip install deepspeed)"
    state = weights + grads + optim
    base = params * c
    buckets = grads if n > 1 else 0  # DDP's bucket copy of the gradients; no DDP in one process
    small = adapters.bytes - _term(adapters, "activations") - _term(adapters, "workspace")
    adapter_weights = int(params * ADAPTER_FRACTION) * 4
    a = f"A {_b(act)}"
    lora_extra = small + (_term(adapters, "gradients") if n > 1 else 0)  # the adapters' DDP buckets
    adapters_said = f"adapters {_b(adapter_weights)} + their G and O"
    rows = [
        ("ddp", weights + grads + buckets + optim + act,
         f"W {_b(weights)} + G {_b(grads)} + buckets {_b(buckets)} + O {_b(optim)} + {a}", None, 0),
        ("zero2", 4 * params + 16 * params // n + act, f"4P + 16P/{n} + {a}", missing, 0),
        ("fsdp", state // n + gathered + act, f"(W + G + O) {_b(state)} / {n} + gathered {units} + {a}", no_fsdp, 0),
        ("zero3", 4 * layer * 4 + 18 * params // n + act, f"4 x largest layer x 4 + 18P/{n} + {a}", missing, 0),
        ("fsdp_offload", gathered + act, f"gathered {units} + {a}; CPU holds W + G + O {_b(state)}", no_fsdp, state),
        ("lora", base + adapter_weights + lora_extra + act,
         f"base {_b(base)} in {compute_dtype} + {adapters_said} + {a}", None, 0),
        ("qlora", qlora_base + adapter_weights + lora_extra + act,
         f"4-bit base {_b(qlora_base)} + {adapters_said} + {a}", no_qlora, 0),
    ]  # fmt: skip
    strategies = tuple(_judged(*row, budget, cpu_memory) for row in rows)
    chosen = next((s for s in strategies if s.fits), None)
    return TrainingPlan(n, budget, strategies, layer_classes, chosen, compute_dtype)


def _judged(
    key: str, need: int, formula: str, unavailable: str | None, cpu: int, budget: int, cpu_memory: int | None
) -> Strategy:
    """The strategy with its verdict: runnable here, under the device budget, and within CPU memory (offload)."""
    host_ok = cpu == 0 or (cpu_memory is not None and cpu <= cpu_memory)
    if cpu and not host_ok:
        formula += f" (the CPU has {format_bytes(cpu_memory) if cpu_memory else 'an unknown amount'})"
    return Strategy(key, int(need), formula, unavailable is None and need <= budget and host_ok, unavailable, cpu)


def _b(value: int) -> str:
    return format_bytes(value)
