"""The precision stage's record: the weights' dtype, the mixed precision, TF32, and the CPU's measured job."""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.dtypes import from_short
from whichdevice.core.frozen import NamedTuple

if TYPE_CHECKING:
    from whichdevice.measure.estimate import CpuJob

__all__ = ["Precision"]


class Precision(NamedTuple):
    """The precision stage's answer. ``weights``: the dtype from_pretrained loads (None: the checkpoint's
    own); ``mixed``: TrainingArguments' mixed precision ("bf16", "fp16" or None for none); ``tf32``: True
    where training_kwargs() hands ``tf32=True`` over (precision/tf32.py), else None; ``measured``: the
    CPU's calibration with the job, which decided the CPU's dtype and decides its tunings (None elsewhere)."""

    weights: str | None
    mixed: str | None
    tf32: bool | None = None
    measured: CpuJob | None = None

    def computes_in(self, task: str) -> str | None:
        """The dtype the layers compute in: under mixed precision the autocast dtype, not the fp32 weights'."""
        if task == "training" and self.mixed is not None:
            return from_short(self.mixed)
        return self.weights
