"""The placement record: where a job's weights go, in every resolution, and the shares of a device it is fitted to.

Apart from :mod:`whichdevice.memory.fit`, which fits weights into devices and is imported only where a
model is sized: a resolution without a model still carries a Placement, and importing fit.py for it
would cost a fresh resolve that module and what it imports (docs/performance.md, the import profile).
"""

from __future__ import annotations

from whichdevice.core.frozen import frozen_record

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from whichdevice.memory.largest_record import LargestFit
    from whichdevice.memory.load_peak import LoadPeak
    from whichdevice.memory.quantization_plan import QuantizationPlan
    from whichdevice.memory.training_records import TrainingPlan, TrainingSetup

__all__ = ["FIT_FRACTION", "SPLIT_FRACTION", "Placement"]

# A model "fits" one device when its weights take at most this share of the memory; the rest is
# for activations, the KV cache and the runtime's own allocations.
FIT_FRACTION = 0.8

# When a model must be split, each device offers this share to accelerate's max_memory.
SPLIT_FRACTION = 0.9


@frozen_record
class Placement:
    """Where a job's weights go and what placement decided with them: the one placement record, for
    inference and training alike. ``device_map`` and, when split, ``max_memory`` as from_pretrained takes
    them; ``fits`` and ``note`` as the fit found them; then what a placement may add: bitsandbytes'
    quantization, the offload folder, the dtype the weights load in where placement chose it (LoRA's
    16-bit base), the multi-device training plan and the way a job trains, the largest job that fits,
    the load's peak, and the index of the device placement took where the job fits it alone and not
    the one detected (memory/room.py's whole_job_device; None: the target's own device)."""

    device_map: str | dict[str, Any]
    max_memory: dict[int | str, str] | None = None
    note: str = ""
    fits: bool = True
    quantization: QuantizationPlan | None = None
    offload_folder: str | None = None
    weights: str | None = None
    plan: TrainingPlan | None = None
    setup: TrainingSetup | None = None
    limits: LargestFit | None = None
    load: LoadPeak | None = None
    index: int | None = None
