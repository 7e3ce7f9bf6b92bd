"""Batch-1 decode steps through torch's own GEMV kernel: oneDNN off for a model's forward passes of one token row.

On CPUs where torch sends bf16 matmuls to oneDNN, oneDNN's kernel for one row read bf16 weights at
about half the memory bandwidth where torch's own GEMV kernel read near all of it; at two rows and
more oneDNN was the faster (docs/backends/cpu.md, "The single-row switch"). torch's only switch
for it is global, so the model's ``forward`` is wrapped: a call that computes one token row runs
inside ``onednn.onednn_off()`` (the process-wide owner of the switch), every other call as before.
A wrapper rather than forward hooks: torch skips ``always_call`` hooks on KeyboardInterrupt, which
left the switch off for the whole process.

Others wrap ``model.forward`` too, at instance level, over ours: accelerate's ``Accelerator.prepare``
with mixed precision (``model._original_forward`` keeps ours, and ``unwrap_model`` keeps its wrapper by
default), peft, a user's decorator (through ``__wrapped__`` or only a closure). Theirs cannot be undone
from outside, so the wrapper that is installed is named on the model (``INSTALLED``), and a wrapper that
is not the one named there passes every call through: ``unprepare`` takes the name away wherever the
wrapper sits, and takes the wrapper itself off where it is on top.
"""

from __future__ import annotations

from typing import Any

from whichdevice.tuning.instance_wrapper import take_back
from whichdevice.tuning.onednn import onednn_off

__all__ = ["INSTALLED", "input_shape", "install_single_row", "remove_single_row", "single_row_rows"]

# The model's attribute naming the wrapper installed now (a deepcopy or pickle carries it with the wrapper).
INSTALLED = "_whichdevice_single_row"


def input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, tokens) of a forward or generate call's input_ids or inputs_embeds; None: neither."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return int(shape[0]), int(shape[1])


def single_row_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The token rows a forward pass computes: batch x new tokens of its input_ids or inputs_embeds,
    or, where an encoder-decoder is given its encoder's outputs (generate's decode steps: the encoder
    ran once, before them), of its decoder_input_ids or decoder_inputs_embeds."""
    if kwargs.get("encoder_outputs") is not None:
        decoder = {"input_ids": kwargs.get("decoder_input_ids"), "inputs_embeds": kwargs.get("decoder_inputs_embeds")}
        shape = input_shape((), decoder)
        if shape is not None:
            return shape[0] * shape[1]
    shape = input_shape(args, kwargs)
    return None if shape is None else shape[0] * shape[1]


class _OneRowForward:
    """``model.forward`` with oneDNN off for calls of one token row.

    A callable object bound to its model, not a closure: a deepcopy or pickle of the model carries it
    bound to the copy. ``inner`` is an instance-level forward that was there first (accelerate's hooks
    put one there), called in its place; None: the class's own. Only while the model names it
    (``INSTALLED``) does it turn oneDNN off; taken back under another's wrapper, it only passes calls on."""

    __slots__ = ("inner", "model")

    def __init__(self, model: Any, inner: Any = None) -> None:
        self.model, self.inner = model, inner

    def __reduce__(self) -> tuple[Any, ...]:
        return (_OneRowForward, (self.model, self.inner))

    @property
    def __wrapped__(self) -> Any:
        # transformers reads forward's signature (inspect follows __wrapped__) to decide what generate
        # passes (logits_to_keep, attention_mask): it must see the model's own.
        return self._forward()

    def _forward(self) -> Any:
        return self.inner if self.inner is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._forward()
        if vars(self.model).get(INSTALLED) is not self or single_row_rows(args, kwargs) != 1 or _compiling():
            return forward(*args, **kwargs)
        with onednn_off():
            return forward(*args, **kwargs)


def _compiling() -> bool:
    # torch.compile traces the forward: its graph's kernels are chosen when it compiles, not by the switch.
    import torch

    return bool(torch.compiler.is_compiling())


def install_single_row(model: Any) -> bool:
    """Wrap ``model.forward`` so that its calls of one token row run with oneDNN off. False: it was
    installed already (on top, or under another's wrapper)."""
    if isinstance(vars(model).get(INSTALLED), _OneRowForward):
        return False
    current = vars(model).get("forward")
    if isinstance(current, _OneRowForward):  # one of ours taken back earlier, left on top: take its place
        current = current.inner
    wrapper = _OneRowForward(model, current)
    model.forward = wrapper
    vars(model)[INSTALLED] = wrapper
    return True


def remove_single_row(model: Any) -> bool:
    """Take ``install_single_row``'s wrapper back from ``model``: off, where it is on top (an inner
    forward it wrapped goes back); passing calls through, where another's wrapper sits over it."""
    return take_back(model, "forward", INSTALLED, _OneRowForward)
