"""A sampled fingerprint of a packed weight: the bits at a few hundred places spread over it, read again at each call.

A packed copy serves a forward only while its weight holds the values it was packed from. The
version counter and ``.data`` (``packed_weights``) see every write made through the weight or
autograd's views of it, but not one made through a tensor that shares its storage and was taken
before the packing (``w.data``, ``[p.data for p in model.parameters()]``, ``w.untyped_storage()``),
nor one made by another process writing shared memory. The fingerprint sees those where they
change one of ``SAMPLES`` elements spread evenly over the weight (one in each 1/``SAMPLES`` of it,
at a varying column): a write to the whole weight (an optimizer step, an EMA update, a scale, a
load) always does; a write to a few elements may fall between the samples.

The bits are compared, not the values: a NaN equals itself, and -0.0 differs from 0.0. Read
through a NumPy view made once (about a microsecond a layer), or torch's indexing where NumPy is
absent. The view is read only after the weight's address was checked unchanged, so it never reads
memory the weight no longer owns.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SAMPLES", "Fingerprint"]

# Elements read per call. 256 spread over a 2048 x 5632 weight: one in every 45,000 elements.
SAMPLES = 256
# Integer dtypes of each element size: the weight's bits, read without rounding.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Fingerprint:
    """``weight``'s bits at ``SAMPLES`` places, and a cheap way to read them again."""

    __slots__ = ("_expected", "_read")

    def __init__(self, weight: Any) -> None:
        bits = weight.detach().view(_BITS[weight.element_size()])
        rows, cols = bits.shape
        count = min(SAMPLES, rows * cols)
        stride = rows * cols // count
        # Evenly spread, each at a varying offset within its stride: rows and columns both vary.
        flat = torch.arange(count) * stride + (torch.arange(count) * 7919) % stride
        # A contiguous weight is read through one flat index (about half the time of two).
        source = bits.view(-1) if bits.is_contiguous() else bits
        index = (flat,) if bits.is_contiguous() else (flat // cols, flat % cols)
        try:
            view, where = source.numpy(), tuple(i.numpy() for i in index)
            self._read: Any = lambda: view[where].tobytes()
        except (RuntimeError, TypeError):  # torch without NumPy
            self._read = lambda: source[index].tolist()
        self._expected = self._read()

    def unchanged(self) -> bool:
        """Whether the sampled bits are those read when the fingerprint was made."""
        return bool(self._read() == self._expected)
