"""How to train a model on several devices: each strategy's memory per device, and the first that fits.

For ``task="training"`` with a model and N devices (this launch's ranks, or the devices one process
sees), every strategy is sized per device from memory/training_job.py's terms, P parameters, the weights'
dtype (``w`` bytes, float32 under mixed precision) and the compute dtype (``c`` bytes):

=================  ============================================================================
DDP                W + the job at its peak (G, O and A, memory/training_job.py) + G (DDP's buckets)
ZeRO-2             DeepSpeed's own figure: 2P + 18P/N + A (needs deepspeed)
FSDP full shard    (W + G + O) / N + (root unit + 2 layers) gathered in c + 2 x the largest unit's G + A
ZeRO-3             DeepSpeed's own figure: 4 x largest module's P + 18P/N + A (needs deepspeed)
FSDP + offload     the same gathered units + A on the device; W + G + O in CPU memory
LoRA               P x c (frozen base) + the adapters' job at its peak + their buckets
QLoRA              4-bit base + the same adapter terms
=================  ============================================================================

(W weights, G gradients, O optimizer state, A activations and workspace for the per-device batch, as
the sharded strategies compute it: on 16-bit weights of their own, without autocast's copies;
the DeepSpeed figures are the per-GPU bytes of ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` in deepspeed/runtime/zero (stage_1_and_2.py, stage3.py),
which ``..._all_cold`` prints: 2 bytes of 16-bit weights per parameter on every GPU, and 18 partitioned
(16-bit and fp32 gradients, fp32 weights, AdamW's two moments); ZeRO-3 keeps only 4 bytes per
parameter of the largest module gathered, DeepSpeed's "largest layer", the module with the most
parameters of its own: tests/memory/test_strategy.py checks the figures against deepspeed's.)

A strategy the launch carries (accelerate's ``ACCELERATE_USE_DEEPSPEED``/``ACCELERATE_USE_FSDP``
settings, whichdevice.launch.launch_strategy) is sized as launched, offloads and FSDP's sharding
included, and chosen whether or not it fits: its keywords are the launcher's, never whichdevice's.

The order is speed first, then memory, full fine-tuning before adapters: DDP communicates once per
step (one all-reduce); ZeRO-2 moves the same volume (reduce-scatter + all-gather) and keeps a 1/N
share of gradients and optimizer state; FSDP full shard gathers every layer's weights again in the
backward pass (1.5x DDP's volume) and is torch's own (no package); ZeRO-3 does the same through
deepspeed; FSDP with offload copies weights and gradients over the host link every step and runs
AdamW on the CPU (several times slower); LoRA and QLoRA train rank-r adapters (a few percent of the
parameters), which changes the result, so they come last.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from whichdevice.core.frozen import NamedTuple
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.job import JobMemory
from whichdevice.memory.training_records import Strategy, TrainingPlan
from whichdevice.model.shape import ModelShape

if TYPE_CHECKING:
    from whichdevice.launch.strategy_record import LaunchStrategy

__all__ = [
    "FULL",
    "ORDER",
    "Priced",
    "deepspeed_model_states",
    "layer_parameters",
    "plan_strategies",
]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
ORDER = ("ddp", "zero2", "fsdp", "zero3", "fsdp_offload", "lora", "qlora")
FULL = ("ddp", "zero2", "fsdp", "zero3", "fsdp_offload")


def deepspeed_model_states(
    stage: int, params: int, largest: int, devices: int, offload_optimizer: bool = False, offload_params: bool = False
) -> tuple[int, int, str]:
    """(bytes per GPU, bytes of CPU memory per node, the formula) of DeepSpeed's model states at ``stage``
    on ``devices`` GPUs of one node: estimate_zero2/3_model_states_mem_needs (additional_buffer_factor
    1.5, zero_init on) for stages 2 and 3; stages 0 and 1, which DeepSpeed has no estimator for, from
    the same per-parameter terms (ZeRO-1 partitions the fp32 state only, ZeRO-0 nothing)."""
    n, p = max(devices, 1), params
    if stage >= 3:
        gathered = 4 * largest  # DeepSpeed's largest_layer_memory
        one = f"4 x largest module ({largest / 1e6:.0f}M)"
        if offload_optimizer and offload_params:
            return gathered, int(p * 18 * 1.5), f"{one} (optimizer and weights in CPU memory)"
        if offload_optimizer:
            return gathered + int(2 * p / n), int(p * 16 * 1.5), f"{one} + 2P/{n} (optimizer on the CPU)"
        if offload_params:  # not one of DeepSpeed's options: its 16-bit weights leave, the fp32 state stays
            return gathered + int(16 * p / n), int(p * 2 * 1.5), f"{one} + 16P/{n} (weights on the CPU)"
        return gathered + int(18 * p / n), int(largest * 4 * n * 1.5), f"{one} + 18P/{n}"
    if stage == 2:
        if offload_optimizer:
            return 2 * p, int(p * max(4 * n, 16) * 1.5), "2P (optimizer on the CPU)"
        return 2 * p + int(18 * p / n), int(p * 4 * n * 1.5), f"2P + 18P/{n}"
    if stage == 1:
        if offload_optimizer:
            return 4 * p, int(p * max(4 * n, 16) * 1.5), "4P (optimizer on the CPU)"
        return 4 * p + int(16 * p / n), int(p * 4 * n * 1.5), f"4P + 16P/{n}"
    return 20 * p, int(p * 4 * n * 1.5), "20P (ZeRO-0 partitions nothing)"


def layer_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder layer: q, k, v, o, the gated MLP (3 matrices) and two norms."""
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    return attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden


class Priced(NamedTuple):
    """One way to train as every rank holds it: the weights' bytes and the job's memory besides them
    (memory/training_job.py: gradients, optimizer state and activations at their peak)."""

    weights: int
    memory: JobMemory


def plan_strategies(
    *,
    params: int,
    shape: ModelShape | None,
    dtype: str,
    compute_dtype: str,
    full: JobMemory,
    sharded: JobMemory,
    lora: Priced,
    qlora: Priced,
    devices: int,
    budget: int,
    cpu_memory: int | None,
    deepspeed: bool,
    layer_classes: tuple[str, ...] = (),
    no_fsdp: str | None = None,
    no_qlora: str | None = None,
    no_deepspeed: str | None = None,
    largest_module: int | None = None,
    launched: LaunchStrategy | None = None,
    local_devices: int | None = None,
    checkpointing: bool = False,
) -> TrainingPlan:
    """Size every strategy for ``devices`` devices of ``budget`` bytes each and choose the first that fits.

    ``full``: full training's memory besides the weights as one rank holds it (autocast over float32
    weights); ``sharded``: as FSDP and DeepSpeed compute it (their activations); ``lora``, ``qlora``: the
    adapters' ways; ``no_*``: why a strategy cannot run here; ``largest_module``: DeepSpeed's largest
    layer; ``launched``: the launch's strategy, sized as launched and chosen fit or not (``local_devices``:
    ranks per node, for hybrid sharding); ``checkpointing``: how every job was priced.
    """
    w, c, n = _ITEMSIZE.get(dtype, 4), _ITEMSIZE.get(compute_dtype, 4), max(devices, 1)
    weights, grads, optim = params * w, full.term("gradients"), full.term("optimizer state")
    act = sharded.term("activations") + sharded.term("workspace")
    gathered, units = _fsdp_gathered(shape, params, c, w)
    missing = no_deepspeed or (None if deepspeed else "deepspeed is not installed (pip install deepspeed)")
    state = weights + grads + optim
    buckets = grads if n > 1 else 0  # DDP's bucket copy of the gradients; no DDP in one process
    a = f"A {_b(act)}"
    largest = largest_module or (_largest_matrix(shape) if shape else params)
    zero2, _, zero2_said = deepspeed_model_states(2, params, largest, n)
    zero3, _, zero3_said = deepspeed_model_states(3, params, largest, n)
    rows = [
        ("ddp", weights + full.bytes + buckets,
         f"W {_b(weights)} + {_peak_of(full)} + buckets {_b(buckets)}", None, 0),
        ("zero2", zero2 + act, f"DeepSpeed's {zero2_said} {_b(zero2)} + {a}", missing, 0),
        ("fsdp", state // n + gathered + act, f"(W + G + O) {_b(state)} / {n} + gathered {units} + {a}", no_fsdp, 0),
        ("zero3", zero3 + act, f"DeepSpeed's {zero3_said} {_b(zero3)} + {a}", missing, 0),
        ("fsdp_offload", gathered + act, f"gathered {units} + {a}; CPU holds W + G + O {_b(state)}", no_fsdp, state),
        *_adapter_rows(lora, qlora, compute_dtype, n, no_qlora),
    ]  # fmt: skip
    strategies = tuple(_judged(*row, budget, cpu_memory) for row in rows)
    chosen = next((s for s in strategies if s.fits), None)
    plan = TrainingPlan(n, budget, strategies, layer_classes, chosen, compute_dtype, checkpointing=checkpointing)
    if launched is None:
        return plan
    sizes = _Sizes(params, largest, n, local_devices or n, weights, grads, optim, act, gathered, c, units, a)
    mine = _judged(*_launched_row(launched, sizes, missing, no_fsdp), budget, cpu_memory)
    mine = replace(mine, label=f"{launched.name} (the launch's)")
    return replace(plan, strategies=(mine, *strategies), chosen=mine, launched=launched.said)


def _peak_of(memory: JobMemory) -> str:
    """A job's memory besides the weights as a formula term: its peak, and which moment sets it."""
    where = (memory.phase or "").removeprefix("training peaks at ")
    return f"the job {_b(memory.bytes)}" + (f" (at {where.split(' (')[0]})" if where else "")


def _adapter_rows(
    lora: Priced, qlora: Priced, compute_dtype: str, n: int, no_qlora: str | None
) -> list[tuple[str, int, str, str | None, int]]:
    """LoRA's and QLoRA's rows: the frozen base (in ``compute_dtype``, or 4-bit), the adapters with their
    gradients, optimizer state and the activations at the step's peak, and with several devices DDP's
    bucket copy of the adapters' gradients."""
    rows = []
    for key, (base, memory), what, missing in (
        ("lora", lora, f"base {_b(lora.weights)} in {compute_dtype}", None),
        ("qlora", qlora, f"4-bit base {_b(qlora.weights)}", no_qlora),
    ):
        buckets = memory.term("gradients") if n > 1 else 0
        said = f"{what} + {_peak_of(memory)}" + (f" + buckets {_b(buckets)}" if buckets else "")
        rows.append((key, base + memory.bytes + buckets, said, missing, 0))
    return rows


def _fsdp_gathered(shape: ModelShape | None, params: int, c: int, w: int) -> tuple[int, str]:
    """FSDP's gathered bytes per device, and how they are said: FSDP2 gathers the root unit (embeddings,
    head) and prefetches the next layer while one computes, in the compute dtype (``c`` bytes); in backward
    a unit's unsharded gradients (``w`` bytes) are copied into one flat reduce-scatter buffer
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce): two copies."""
    layer = layer_parameters(shape) if shape else params
    root = max(0, params - layer * shape.layers) if shape else 0
    units = f"(root {root / 1e6:.0f}M + 2 x layer {layer / 1e6:.0f}M params) x {c} + 2 x largest unit's G"
    return (root + 2 * layer) * c + 2 * max(root, layer) * w, units


class _Sizes(NamedTuple):
    params: int
    largest: int
    devices: int
    local: int
    weights: int
    grads: int
    optim: int
    act: int
    gathered: int
    compute: int
    units: str
    a: str


def _launched_row(
    launched: LaunchStrategy, z: _Sizes, missing: str | None, no_fsdp: str | None
) -> tuple[str, int, str, str | None, int]:
    """The row (key, bytes per device, formula, why it cannot run, CPU bytes) of the launch's strategy."""
    if launched.kind == "deepspeed":
        stage = launched.stage if launched.stage is not None else 2
        gpu, cpu, said = deepspeed_model_states(
            stage, z.params, z.largest, z.devices, launched.offload_optimizer, launched.offload_params
        )
        offloaded = launched.offload_optimizer or launched.offload_params
        key = "zero3" if stage >= 3 else "zero2"
        return key, gpu + z.act, f"DeepSpeed's {said} {_b(gpu)} + {z.a}", missing, cpu if offloaded else 0
    state = z.weights + z.grads + z.optim
    if launched.sharding == "NO_SHARD":
        return "ddp", state + z.act, f"NO_SHARD: W + G + O {_b(state)} on every rank + {z.a}", no_fsdp, 0
    shards = z.local if launched.sharding.startswith("HYBRID") else z.devices
    gathered, said = z.gathered, f"gathered {z.units}"
    if launched.sharding in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"):
        # The layers stay gathered from forward to backward: the whole weights in the compute dtype.
        gathered, said = z.params * z.compute, f"all weights gathered in the compute dtype {_b(z.params * z.compute)}"
    if launched.offload_params:
        return "fsdp_offload", gathered + z.act, f"{said} + {z.a}; CPU holds W + G + O {_b(state)}", no_fsdp, state
    formula = f"(W + G + O) {_b(state)} / {shards} + {said} + {z.a}"
    return "fsdp", state // shards + gathered + z.act, formula, no_fsdp, 0


def _largest_matrix(shape: ModelShape) -> int:
    """The parameters of the largest single module a config's shape implies: the embedding (vocabulary x
    hidden), or an MLP projection (hidden x intermediate). Used where no checkpoint names its tensors."""
    return max(
        shape.vocab * shape.hidden, shape.hidden * shape.intermediate, shape.hidden * shape.head_dim * shape.heads
    )


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
