"""A CPU model's linear weights packed ahead in oneDNN's blocked layout, for decode steps of several rows.

A decode step at batch 4 multiplies four rows by every weight. With the weights in torch's plain
layout, each matmul reorders them for oneDNN (bf16) or runs a kernel made for larger shapes (fp32),
and reads them at a fraction of the memory bandwidth; packed once in oneDNN's layout (the op
torch's inductor uses when it freezes a model), they are read near all of it. Measured here (AMD
EPYC, 2 cores, torch 2.13, 1.1B Llama, batch 4, 32-token prompt): fp32 decode 7.1 -> 25.4 tokens/s,
bf16 25.6 -> 45.1, the same tokens; packing took 3.0 s (bf16) and 8.2 s (fp32). The calibration
times it ("p4", "pack"), the estimate counts the packing against the job's new tokens, and
``Resolution.prepare(model)`` packs where the resolver chose it.

The packing's own speed is measured as it runs: the calibration's rate is a guess for a model's
fresh memory (a 0.4B model's packing took 0.4-1.3 s from an fp32 checkpoint and up to 1.8 s after an
upcast from bf16 on this VM, against 0.4 s at the calibration's rate), so once ``PROBE_SHARE`` of the
copy is made, a packing whose rate prices the whole copy above what the job repays (``budget_s``:
the whole job still ``PACK_MARGIN`` faster) is stopped. The time already spent is not in that price:
each weight packed speeds its share of every step, so the rest of the copy repays its share of the
budget exactly when the whole would at that rate, and what was spent (the first calls' one-time
costs included) is spent either way. The layers packed by then are kept: each runs faster for the
whole job, which repays part of the time spent (undoing them wasted all of it: a 0.4B model's
stopped packing cost 0.28 s of a 1.5 s job here).

Do no harm: the packed copy sits beside the weights (state_dict, saving and training see the
weights as they were), so it is made only while it takes at most ``HEADROOM`` of the memory
available. A layer runs its packed copy only for inference on the CPU in the packed dtype with its
weight unchanged since packing; anything else (gradients, another dtype, a weight loaded or moved
since, a deepcopy, a torch.compile trace) runs ``torch.nn.functional.linear`` as before. ``unpack`` takes it all back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from whichdevice.core import progress
from whichdevice.core.errors import printable

__all__ = [
    "HEADROOM",
    "PACKED_DTYPES",
    "PROBE_MIN_S",
    "PROBE_SHARE",
    "available_memory",
    "install_packed_weights",
    "packable_layers",
    "unpack",
]

# The packed copy may take at most this share of the memory available when prepare() runs.
HEADROOM = 0.5
# The share of the copy, after its first weight, whose rate prices the whole copy (checked after every
# weight from then on). The first weight is timed but not taken as the rate: it carries the first
# call's one-time costs. A try is priced at the calibration's rate, and a model's fresh memory
# faulted in page by page ran up to 4x slower on this VM (1.1B fp32 after an upcast from bf16:
# 3.9-5.5 s against 1.6 s), so a wrong try must stop early. Replayed on the per-weight times of 20
# fresh 0.1-1.1B packings here (quiet and at load 2) against the 1.1B job's budget (3.07 s, scaled
# by size for the smaller models): reading the rate from 1% of the copy after the first weight,
# packings slow from the start stopped at 2% (0.06-0.09 s), those that slowed part-way (bf16 upcasts)
# at 29-40% with the part packed fast repaying its time, and none within its budget stopped; from
# 3% of the copy after the first weight of each shape (a whole layer, 176 MB at 1.1B, though a
# shape's first call ran no slower than its later ones: 7 against 6 ms for 16 MB), the slow ones
# stopped at 6% (0.21-0.26 s), and a packing of 2.05 s stopped at 20%, on a slow stretch early on.
PROBE_SHARE = 0.01
# Nor before that rate has run this long: a packing this short costs too little to be worth
# stopping, and a shorter time is one hiccup's (with 0.02 s, one of three fresh 0.1B packings
# stopped 0.03 s in, at 14 of 57 layers, where the other two packed whole in 0.12-0.13 s).
PROBE_MIN_S = 0.05
PACKED_DTYPES = ("float32", "bfloat16")
_ATTRIBUTE = "_whichdevice_packed"


class _Packed:
    """One layer's packed weight and the weight it was packed from (its version and address)."""

    __slots__ = ("linear", "pointer", "tensor", "version")

    def __init__(self, tensor: Any, linear: Any, version: int | None, pointer: int) -> None:
        self.tensor, self.linear, self.version, self.pointer = tensor, linear, version, pointer

    def __deepcopy__(self, memo: dict[int, Any]) -> _Packed:
        # A copy's weights are other tensors: it runs unpacked rather than share this copy.
        return _Packed(None, None, None, -1)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Packed, (None, None, None, -1))


def _version(tensor: Any) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor keeps no version counter: its address is checked
        return None


def _forward(self: Any, x: Any) -> Any:
    import torch

    packed: _Packed | None = getattr(self, _ATTRIBUTE, None)
    weight = self.weight
    usable = (
        packed is not None
        and packed.tensor is not None
        and x.dtype == weight.dtype
        and x.device.type == "cpu"
        and weight.data_ptr() == packed.pointer
        and _version(weight) == packed.version
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        # torch.compile traces torch's own linear (its inductor packs weights itself when freezing):
        # an opaque oneDNN tensor is not something its tracer can hold.
        and not torch.compiler.is_compiling()
    )
    if usable:
        return packed.linear(x, packed.tensor, self.bias)  # type: ignore[union-attr]
    return torch.nn.functional.linear(x, weight, self.bias)


class _PackedForward:
    """A layer's ``forward``: ``_forward`` bound to it. An object rather than a bound method: a pickled
    model (``torch.save(model)``) restores a bound method by name, and the layer has no ``_forward``."""

    __slots__ = ("module",)

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, x: Any) -> Any:
        return _forward(self.module, x)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_PackedForward, (self.module,))


def packable_layers(model: Any, dtype: str) -> list[Any]:
    """``model``'s plain ``torch.nn.Linear`` layers (not subclasses: quantized layers are those) whose
    weights are on the CPU in ``dtype``."""
    import torch

    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and str(m.weight.dtype).removeprefix("torch.") == dtype
    ]


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the kernel says are available (MemAvailable), or None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable" and value.split() and value.split()[0].isdigit():
                return int(value.split()[0]) * 1024
    except OSError:
        return None
    return None


class _Clock:
    """The packing's price as it runs: the whole copy at the rate of the weights after the first
    (``PROBE_SHARE``, ``PROBE_MIN_S``). The whole copy, not the time so far plus the rest: a weight's
    gain and its packing both scale with its bytes, so the rest of the copy repays if and only if the
    whole would at that rate, whatever the start cost (spent either way)."""

    def __init__(self, size: int) -> None:
        self.size, self.done, self.start = size, 0, time.perf_counter()
        self.first: tuple[float, int] | None = None  # (time, bytes) once the first weight is packed

    def add(self, size: int) -> float | None:
        """Count one weight of ``size`` bytes packed; the whole copy's price in seconds at the rate read
        so far, or None before the rate is read."""
        now = time.perf_counter()
        self.done += size
        if self.first is None:
            self.first = (now, self.done)
            return None
        seconds, packed = now - self.first[0], self.done - self.first[1]
        if packed < PROBE_SHARE * self.size or seconds < PROBE_MIN_S:
            return None
        return self.size * seconds / packed


def install_packed_weights(model: Any, dtype: str, batch: int, budget_s: float | None = None) -> tuple[int, str]:
    """Pack ``model``'s ``dtype`` linear weights for ``batch`` rows; (layers packed, what was done).
    ``budget_s``: the seconds the whole packing may take (priced at its own rate once ``PROBE_SHARE``
    of it is done); priced past it, the packing stops, and the layers packed by then stay so."""
    import torch

    from whichdevice.hardware.probes.cpu_memory import packing_ops

    if dtype not in PACKED_DTYPES:
        return 0, f"not packed: {dtype} weights are not packed (only {' and '.join(PACKED_DTYPES)})"
    ops = packing_ops(torch)
    if ops is None:
        return 0, "not packed: this torch has no oneDNN packing ops"
    # A layer packed already is left; one whose copy came from a deepcopy or pickle (no tensor) packs again.
    layers = [m for m in packable_layers(model, dtype) if getattr(getattr(m, _ATTRIBUTE, None), "tensor", None) is None]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    available = available_memory()
    if available is not None and size > HEADROOM * available:
        return 0, (
            f"not packed: the packed copy ({size / 1024**3:.2f} GiB) would take more than "
            f"{HEADROOM:.0%} of the {available / 1024**3:.2f} GiB available"
        )
    pack, linear = ops
    clock = _Clock(size)
    with progress.working("packing the model's weights"), torch.no_grad():
        try:
            for count, module in enumerate(layers, start=1):
                weight = module.weight
                packed = _Packed(pack(weight.detach(), batch), linear, _version(weight), weight.data_ptr())
                setattr(module, _ATTRIBUTE, packed)
                module.forward = _PackedForward(module)
                price = clock.add(weight.numel() * weight.element_size())
                if budget_s is not None and price is not None and price > budget_s:
                    return count, (
                        f"packing stopped after {clock.done / size:.0%} of the copy ({count} of {len(layers)} "
                        f"linear layers, kept packed, {time.perf_counter() - clock.start:.2g} s): at the rate it "
                        f"ran, the whole copy would take {price:.2g} s, more than the {budget_s:.2g} s the "
                        "job's tokens repay, so the rest would cost more than it saves"
                    )
        except RuntimeError as exc:  # a oneDNN that cannot pack this dtype: the model stays as it was
            unpack(model)
            first = (str(exc).splitlines() or [""])[0][:200]
            return 0, f"not packed: oneDNN could not pack {dtype} weights ({printable(first)})"
    took = time.perf_counter() - clock.start
    return len(layers), f"{len(layers)} linear layers packed for batch {batch} ({size / 1024**3:.2f} GiB, {took:.2g} s)"


def unpack(model: Any) -> int:
    """Drop every packed copy ``install_packed_weights`` made in ``model``; the layers run as before."""
    count = 0
    for module in model.modules():
        if getattr(module, _ATTRIBUTE, None) is not None:
            delattr(module, _ATTRIBUTE)
            if "forward" in vars(module):
                del module.forward
            count += 1
    return count
