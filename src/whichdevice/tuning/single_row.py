"""Batch-1 decode steps through torch's own GEMV kernel: oneDNN off for a model's forward passes of one token row.

On CPUs where torch sends bf16 matmuls to oneDNN, a decode step at batch 1 multiplies one row by
every weight, and oneDNN's kernel for that shape read bf16 weights at about half the memory
bandwidth here, where torch's own GEMV kernel read them near all of it (AMD EPYC, torch 2.13:
``benchmarks/real_sizes.py``); at two rows and more oneDNN was the faster. torch has one switch
for it, global: ``torch.backends.mkldnn`` enabled or not. So the switch is flipped only around the
forward passes that carry one row (a batch-1 decode step) and put back after each, prompts and
larger batches keep oneDNN.

The calibration measures both kernels ("bf16.g1" and "bf16.s1"); the resolver hands this over only
where the first is measured ``MARGIN`` faster, for a bf16 inference load on the CPU
(``Resolution.prepare(model)``). While such a forward runs, another thread's matmuls also run
without oneDNN: slower perhaps, never wrong.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HOOKED", "input_shape", "install_single_row", "onednn_held_off", "single_row_rows"]

# Set on a model that has the hooks, so installing twice adds nothing.
HOOKED = "_whichdevice_single_row"
# How many hooked forwards have turned oneDNN off and not yet put it back (nested models: one each).
# The decode attention's plain matmuls read it to turn oneDNN on for their own calls, never where a
# user turned it off: torch's own bf16 batched matmul is the slower there (whichdevice.attention.decode).
_HELD_OFF: list[int] = [0]


def onednn_held_off() -> bool:
    """Whether a single-row hook has turned oneDNN off for the forward pass now running."""
    return _HELD_OFF[0] > 0


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


def install_single_row(model: Any) -> bool:
    """Hook ``model`` so that its forward passes of one token row run with oneDNN off, restored after
    each (also when the forward raises). False: it was hooked already."""
    import torch

    if getattr(model, HOOKED, False):
        return False
    saved: list[tuple[bool, bool]] = []

    # torch.backends.mkldnn.enabled is torch's public, global switch (about 0.3 us to read or set);
    # torch types it as the descriptor it is, so it is reached through Any.
    switch: Any = torch.backends.mkldnn

    def before(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        turned_off = switch.enabled and single_row_rows(args, kwargs) == 1
        saved.append((switch.enabled, turned_off))
        if turned_off:
            switch.enabled = False
            _HELD_OFF[0] += 1

    def after(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if saved:
            enabled, turned_off = saved.pop()
            switch.enabled = enabled
            if turned_off:
                _HELD_OFF[0] -= 1

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    setattr(model, HOOKED, True)
    return True
