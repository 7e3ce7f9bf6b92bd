"""The load's own peak: what from_pretrained reserves on a device while it loads, beside what the model then holds.

transformers warms up torch's caching allocator before it loads a weight. In 5.25,
``_load_pretrained_model`` calls ``caching_allocator_warmup`` whenever a device_map is given
(modeling_utils.py:4570-4572). The warm-up sums the bytes of the parameters each accelerator will
hold (``get_total_byte_count``, l.5201-5226: tied weights once, a quantizer's
``param_element_size`` for the weights it quantizes: 0.5 byte for bitsandbytes 4-bit,
quantizer_bnb_4bit.py:53-54, 1 for 8-bit, quantizer_bnb_8bit.py:53-54) and allocates the sum in
one ``torch.empty`` (l.5311), freed at once into torch's cache, where the weights then land. On
``cuda`` and ``xpu`` that block is capped at the device's total memory less 1.2 GiB (l.5259, l.5300);
``mps`` and ``neuron`` are skipped (l.5301-5309); any other device gets the whole sum. In a fresh
process nothing is reserved yet, so the branch for reserved but unused memory (l.5272-5298) leaves
the sum as it is.

The block holds the tensors over 1 MiB. torch's CUDA and XPU caching allocators serve smaller ones
from a pool of their own 2 MiB segments (kSmallSize and kSmallBuffer in c10/core/AllocatorConfig.h,
which ships with torch: ``torch/include/c10/core/AllocatorConfig.h``; torch/xpu/memory.py documents
the same small pool), so their bytes are reserved twice: unused in the block, and in those segments.
Tensors past a capped block get segments of their own. A model loaded on the CPU and moved
(``model.to(device)``) allocates tensor by tensor: no block, so it peaks at the weights. bitsandbytes'
quantization on load puts each weight on the device in its 16-bit dtype before quantizing it, one
weight at a time (core_model_loading.py:1862-1874 loads synchronously for it), so the largest linear
weight's 16-bit copy comes on top. The load's peak on a device is then

    round_up(max(warm-up, tensors over 1 MiB), 2 MiB) + round_up(tensors of 1 MiB or less, 2 MiB) + transient

and it is checked against the device's free memory, all of it, where the steady state is checked
against its usable share (memory/fit.py): the KV cache and activations come after the load. Not
counted: the CUDA context this process makes at its first CUDA call (a few hundred MiB, outside
torch's allocator) and the transient of transformers' weight converters (experts merged on load).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Protocol

from whichdevice.core.dtypes import item_size
from whichdevice.core.frozen import frozen_record
from whichdevice.core.sizes import format_bytes

__all__ = [
    "CAPPED",
    "SKIPPED",
    "WARMUP_MARGIN",
    "LoadPeak",
    "Weights",
    "installed_warmup",
    "load_peak",
    "warmup_bytes",
]

# modeling_utils.py:5300 (transformers 5.25): byte_count = min(byte_count, total_device_memory - 1.2 * 1024**3)
WARMUP_MARGIN = 1.2 * 1024**3
# The device types whose block is capped by their memory (l.5259), and those with no warm-up (l.5301-5309).
CAPPED = ("cuda", "xpu")
SKIPPED = ("mps", "neuron")
# c10/core/AllocatorConfig.h: kSmallSize (the largest allocation of the small pool), kSmallBuffer (a
# small-pool segment) and kRoundLarge (what larger segments round up to).
SMALL_TENSOR = 1024**2
SMALL_SEGMENT = 2 * 1024**2
ROUND_LARGE = 2 * 1024**2


class Weights(Protocol):
    """What a load is sized from: whichdevice.model.size.ModelSize (named here by its fields alone, so
    that this module stays below the model readers)."""

    @property
    def float_params(self) -> int: ...
    @property
    def linear_params(self) -> int: ...
    @property
    def other_bytes(self) -> int: ...
    @property
    def tensors(self) -> tuple[int, ...]: ...
    @property
    def largest_linear(self) -> int: ...
    @property
    def quantized(self) -> Any: ...
    def bytes_in(self, dtype: str) -> int: ...


def warmup_bytes(device_type: str, weights: int, total: int | None) -> int:
    """What ``caching_allocator_warmup`` allocates on a ``device_type`` device that will hold
    ``weights`` bytes of parameters (as ``get_total_byte_count`` sums them), in a fresh process. (On
    a cuda or xpu device of under 1.2 GiB, transformers asks torch.empty for a negative size, which
    raises; 0 here.)"""
    if device_type in SKIPPED:
        return 0
    count: float = weights
    if device_type in CAPPED and total is not None:
        count = min(weights, total - WARMUP_MARGIN)  # the same float arithmetic as l.5300
    # int(byte_count // 2) float16 elements (l.5311)
    return max(0, int(count // 2)) * 2


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@frozen_record
class LoadPeak:
    """The load's peak on ``device`` (a from_pretrained with a device_map), and the free memory it meets."""

    device: str
    weights: int  # the parameters' bytes there, as the warm-up sums them
    warmup: int  # the block caching_allocator_warmup allocates
    small: int  # the bytes of tensors of 1 MiB or less, served from the allocator's small segments
    transient: int  # a weight's 16-bit copy before bitsandbytes quantizes it (0 without quantization on load)
    free: int | None  # what the device has free (None: not reported)
    # The remedy handed over where only the load does not fit: "cpu" (load on the CPU, then move it),
    # "split" (a lower max_memory spreads the weights), or None.
    remedy: str | None = None

    @property
    def peak(self) -> int:
        large = max(self.warmup, self.weights - self.small)
        return _round_up(large, ROUND_LARGE) + _round_up(self.small, SMALL_SEGMENT) + self.transient

    @property
    def moved(self) -> int:
        """The peak of moving the loaded model there from the CPU: the same tensors, without the block."""
        return _round_up(self.weights - self.small, ROUND_LARGE) + _round_up(self.small, SMALL_SEGMENT)

    @property
    def fits(self) -> bool:
        return self.free is None or self.peak <= self.free

    def text(self) -> str:
        quantizing = f" + {format_bytes(self.transient)} for a weight before it is quantized" if self.transient else ""
        block = (
            f"transformers' allocator warm-up reserves {format_bytes(self.warmup)} on {self.device} in one block"
            if self.warmup
            else f"transformers skips the allocator warm-up on {self.device.split(':')[0]}"
        )
        small = f", {format_bytes(self.small)} of tensors of 1 MiB or less in 2 MiB segments of their own"
        small = small if self.small else ""
        free = f"{format_bytes(self.free)} free" if self.free is not None else "free memory not reported"
        verdict = "" if self.free is None else (": fits" if self.fits else ": does not fit")
        return f"{block}{small}{quantizing}: the load peaks at {format_bytes(self.peak)}, {free}{verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "weights": self.weights,
            "warmup": self.warmup,
            "small": self.small,
            "transient": self.transient,
            "peak": self.peak,
            "moved": self.moved,
            "free": self.free,
            "fits": self.fits,
            "remedy": self.remedy,
        }


def load_peak(
    size: Weights, dtype: str, device: str, free: int | None, total: int | None, bits: int | None = None, *, kind: str
) -> LoadPeak:
    """The peak of loading ``size`` in ``dtype`` onto one ``device``, of backend ``kind`` ("cuda": its
    allocator decides the warm-up; ``bits``: bitsandbytes quantization on load, 4 or 8)."""
    per = item_size(dtype)
    if bits is None:
        weights = size.bytes_in(dtype)
        transient = 0
    else:
        # get_total_byte_count's sum: quantized linear weights at bits / 8 bytes, the rest in the dtype.
        weights = int(size.linear_params * bits / 8) + (size.float_params - size.linear_params) * per + size.other_bytes
        transient = size.largest_linear * per
    # The small pool is the CUDA and XPU allocators'; elsewhere the small tensors are not counted twice.
    small = sum(n * per for n in size.tensors if n * per <= SMALL_TENSOR) if kind in CAPPED else 0
    return LoadPeak(device, weights, warmup_bytes(kind, weights, total), small, transient, free)


def installed_warmup(
    model: Any, device_map: Mapping[str, Any], memory: Mapping[str, tuple[int, int]], hf_quantizer: Any = None
) -> dict[str, int]:
    """Device -> the bytes the installed transformers' ``caching_allocator_warmup`` allocates for
    ``model`` (built on the meta device) and ``device_map`` (parameter name -> device). It runs that
    function as installed, with its ``torch`` answering the device queries from ``memory`` (device
    -> (free, total) bytes; nothing reserved yet) and recording the allocation instead of making it,
    so a figure computed here, on a machine without the device, is the installed code's own."""
    import torch
    from transformers import modeling_utils

    warmup = modeling_utils.caching_allocator_warmup
    made: dict[str, int] = {}

    class _Runtime:  # torch.cuda / torch.xpu, as the warm-up asks them
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def current_device(self) -> int:
            return 0

        def mem_get_info(self, index: int) -> tuple[int, int]:
            return memory[f"{self.kind}:{index}"]

        def memory_reserved(self, index: int) -> int:
            return 0

        def memory_allocated(self, index: int) -> int:
            return 0

    class _Torch:
        cuda, xpu = _Runtime("cuda"), _Runtime("xpu")

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        def empty(self, count: int, *, dtype: Any, device: Any, requires_grad: bool = False) -> None:
            if count < 0:  # what torch.empty says to a negative size
                raise RuntimeError(f"Trying to create tensor with negative dimension {count}: [{count}]")
            made[str(device)] = made.get(str(device), 0) + int(count) * torch.finfo(dtype).bits // 8

    scoped = types.FunctionType(warmup.__code__, {**warmup.__globals__, "torch": _Torch()}, warmup.__name__)
    scoped(model, dict(device_map), hf_quantizer)
    return made
