"""The record of the strategy a launch's variables carry: DeepSpeed ZeRO or FSDP, with its offloads.

Apart from :mod:`whichdevice.launch.launch_strategy`, which reads those variables on every resolve: a
process launched without DeepSpeed or FSDP never imports it (each module a fresh resolve imports
costs it a few tenths of a millisecond; docs/performance.md, the import profile).
``launch_strategy.LaunchStrategy`` still names it.
"""

from __future__ import annotations

from whichdevice.core.frozen import frozen_record

__all__ = ["LaunchStrategy"]


@frozen_record
class LaunchStrategy:
    """What the launch's variables make Trainer run: ``kind`` "deepspeed" (``stage`` 0-3) or "fsdp"
    (``sharding`` FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD), with its offloads."""

    kind: str
    said: str  # the variables (and file) it was read from, as the trace quotes them
    stage: int | None = None
    sharding: str = "FULL_SHARD"
    offload_optimizer: bool = False
    offload_params: bool = False
    problem: str | None = None  # a setting that could not be read (the rest was still read)
    # "ACCELERATE_USE_CPU='1'" where that variable is true: AcceleratorState is then a CPU run (cpu=True),
    # which takes neither DeepSpeed nor FSDP (state.py:876, :935); None: Trainer runs the strategy.
    cpu_forced: str | None = None

    @property
    def name(self) -> str:
        if self.kind == "deepspeed":
            parts = [f"DeepSpeed ZeRO-{self.stage}"]
        else:
            parts = ["FSDP" + ("" if self.sharding == "FULL_SHARD" else f" {self.sharding}")]
        offloaded = [
            what for what, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params)) if on
        ]
        if offloaded:
            parts.append(f"with {' and '.join(offloaded)} offloaded to the CPU")
        return " ".join(parts)
