"""A tuned linear layer's ``forward``: the one object through which both CPU settings that act per layer run.

A layer may carry a packed copy of its weight (``tuning.packed_weights``, for decode steps of several
rows) and the setting that computes its forwards of many bf16 rows in fp32 (``tuning.upcast``, for
prompts), each an attribute of the layer; its ``forward`` is one ``LayerForward`` that asks the
second, then the first, then runs torch's linear. Either installs it (``attach``) and each takes it
off only when the other is gone too (``detach``), so they compose in any order.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PACKED", "UPCAST", "LayerForward", "attach", "detach"]

PACKED = "_whichdevice_packed"  # the layer's packed copy (packed_weights._Packed)
UPCAST = "_whichdevice_upcast"  # the layer's setting for forwards of many rows (upcast.Upcast)


def _packed_forward(module: Any, x: Any) -> Any:
    """The layer's packed copy where it holds the weight's current values and the call may use it,
    else torch's linear."""
    packed = vars(module).get(PACKED)
    weight = module.weight
    if packed is None:
        return torch.nn.functional.linear(x, weight, module.bias)
    if (
        x.dtype == weight.dtype
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        # torch.compile traces torch's own linear (its inductor packs weights itself when freezing):
        # an opaque oneDNN tensor is not something its tracer can hold.
        and not torch.compiler.is_compiling()
    ):
        tensor = packed.tensor
        if tensor is not None and packed.holds(weight):
            return packed.linear(x, tensor, module.bias)
        packed.drop()  # the weight changed since: the copy is stale for good, its memory freed
    return torch.nn.functional.linear(x, weight, module.bias)


class LayerForward:
    """A tuned layer's ``forward``: its forward of many bf16 rows in fp32 where ``UPCAST`` is set and
    takes the call, else its packed copy, else torch's linear. An object rather than a bound method: a
    pickled model (``torch.save(model)``) restores a bound method by name, and the layer has none."""

    __slots__ = ("module",)

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, x: Any) -> Any:
        upcast = vars(self.module).get(UPCAST)
        if upcast is not None:
            out = upcast(self.module, x)
            if out is not None:
                return out
        return _packed_forward(self.module, x)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LayerForward, (self.module,))


def attach(module: Any) -> None:
    """Make ``module``'s forward a ``LayerForward`` (kept where it is one already)."""
    if not isinstance(vars(module).get("forward"), LayerForward):
        module.forward = LayerForward(module)


def detach(module: Any) -> None:
    """Give ``module`` its class's forward back once neither setting is on it."""
    if isinstance(vars(module).get("forward"), LayerForward) and not (PACKED in vars(module) or UPCAST in vars(module)):
        del module.forward
