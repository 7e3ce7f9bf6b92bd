"""A bf16 model's forwards of many rows (its prompts) in fp32 from its weights, where bf16 arithmetic is slow.

Where bf16 matmuls are emulated (no AVX-512 BF16, AMX or Arm BF16), a decode step of a few rows runs
faster in bf16 (half the bytes to stream) and a prompt of hundreds of rows runs several times slower
(the arithmetic). One load serves both: each plain ``torch.nn.Linear`` with bf16 weights computes a
forward of more than ``rows`` rows in fp32, its weight copied into an fp32 buffer (one per weight
shape, reused from call to call, allocated at the first such forward, freed by ``remove_upcast``),
and a forward of ``rows`` or fewer in bf16 as loaded. The result is rounded back to bf16: the next
layer gets what it gets without this, computed from the same bf16 weights in fp32 arithmetic.

No copy outlives its call: the buffer is refilled from the weight at every forward, so no write to a
weight (in place, through an alias, from another process) can leave it stale. Two threads running
the same shape at once each get a buffer (only one is kept). Gradients, another dtype, ``torch.compile``
tracing and forwards of ``rows`` or fewer run torch's own linear. ``rows`` comes from the
calibration (``measure.estimate.upcast_rows``); the figures are in docs/backends/cpu.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from whichdevice.hardware.probes.locks import ForkSafeLock
from whichdevice.tuning.layer_forward import UPCAST as ATTRIBUTE
from whichdevice.tuning.layer_forward import attach, detach

__all__ = ["ATTRIBUTE", "Upcast", "forward_in_fp32", "install_upcast", "remove_upcast", "upcast_layers"]

# Guards the pools' free lists: held only to take or give back a buffer, never across a call; a forked
# child gets a new one (a fork may leave it held).
_lock = ForkSafeLock()


class _Pool:
    """The fp32 buffers of one model, by weight shape: one kept per shape, more made while threads overlap."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, ...], Any] = {}
        self.closed = False

    @contextmanager
    def buffer(self, shape: tuple[int, ...]) -> Iterator[Any]:
        with _lock:
            tensor = self.free.pop(shape, None)
        if tensor is None:
            # Never an inference tensor: one made under inference_mode could not be written outside it.
            with torch.inference_mode(False):
                tensor = torch.empty(shape, dtype=torch.float32)
        try:
            yield tensor
        finally:
            with _lock:
                if not self.closed:
                    self.free.setdefault(shape, tensor)

    def close(self) -> int:
        """Drop every buffer (a forward in flight keeps its own until it returns); the bytes dropped."""
        with _lock:
            self.closed = True
            dropped = int(sum(t.numel() * t.element_size() for t in self.free.values()))
            self.free.clear()
        return dropped

    def __deepcopy__(self, memo: dict[int, Any]) -> _Pool:
        return _Pool()  # a copy's buffers are its own, made at its first forward

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Pool, ())


class Upcast:
    """One layer's setting: forwards of more than ``rows`` rows in fp32, from buffers of ``pool``."""

    __slots__ = ("pool", "rows")

    def __init__(self, rows: int, pool: _Pool) -> None:
        self.rows, self.pool = rows, pool

    def __call__(self, module: Any, x: Any) -> Any:
        return forward_in_fp32(module, x, self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Upcast, (self.rows, self.pool))


def forward_in_fp32(module: Any, x: Any, upcast: Upcast) -> Any:
    """``module``'s forward of ``x`` in fp32 from its bf16 weight, rounded back to bf16; None where the
    call is not one it takes (``rows`` or fewer rows, another dtype or device, gradients, compiling)."""
    if x.dim() == 0 or x.numel() <= upcast.rows * x.shape[-1]:
        return None  # a decode step, the common call: answered before anything else is read
    weight, bias = module.weight, module.bias
    if (
        x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        or torch.compiler.is_compiling()
    ):
        return None
    with upcast.pool.buffer(tuple(weight.shape)) as buffer:
        buffer.copy_(weight)
        out = torch.nn.functional.linear(x.float(), buffer, None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def upcast_layers(model: Any) -> list[Any]:
    """``model``'s plain ``torch.nn.Linear`` layers (not subclasses: quantized layers are those) with
    bf16 weights on the CPU."""
    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16
    ]


def install_upcast(model: Any, rows: int) -> tuple[int, str]:
    """Compute ``model``'s bf16 linear layers' forwards of more than ``rows`` rows in fp32; (layers, what was done)."""
    layers = upcast_layers(model)
    previous = next((vars(m)[ATTRIBUTE] for m in layers if ATTRIBUTE in vars(m)), None)
    pool = previous.pool if previous is not None and not previous.pool.closed else _Pool()
    for module in layers:
        setattr(module, ATTRIBUTE, Upcast(rows, pool))
        attach(module)
    largest = sum(_distinct_shapes(layers).values()) * 4
    return len(layers), (
        f"{len(layers)} bf16 linear layers compute forwards of more than {rows} rows in fp32 "
        f"(buffers up to {largest / 1024**3:.2f} GiB, one per weight shape, made at the first such forward)"
    )


def _distinct_shapes(layers: list[Any]) -> dict[tuple[int, ...], int]:
    return {tuple(m.weight.shape): m.weight.numel() for m in layers}


def remove_upcast(model: Any) -> int:
    """Take the setting off every layer of ``model`` and free its buffers; the number of layers."""
    count = 0
    for module in model.modules():
        upcast = vars(module).pop(ATTRIBUTE, None)
        if upcast is None:
            continue
        upcast.pool.close()
        detach(module)
        count += 1
    return count
