"""The rules the safetensors library checks a header by, so whichdevice accepts no file it refuses.

Matched against the installed ``safetensors`` (0.8) by building each bad file and opening it with
``safe_open``: ``__metadata__`` must be absent, null or a map of string to string ("invalid JSON in
header: invalid type"); the tensors, sorted by their data offsets, must follow one another with no
gap and no overlap ("invalid offset for tensor"); the last must end where the file ends ("file not
fully covered"); and a shape's size in bits must fit in 64 bits ("overflow computing buffer size").
Each problem is returned as text, for :func:`whichdevice.model.files.read_header` to raise.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["layout_problem", "metadata_problem", "size_problem"]

_BITS_LIMIT = 2**64  # safetensors computes elements x bits in a usize and refuses an overflow


def metadata_problem(metadata: Any) -> str | None:
    """Why ``__metadata__`` is not what safetensors reads (a map of string to string), or None."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return f"its __metadata__ is a JSON {type(metadata).__name__}, not a map of text to text (corrupt)"
    for key, value in metadata.items():
        if not isinstance(value, str):
            return f"its __metadata__[{key!r}] is {type(value).__name__}, not text (corrupt)"
    return None


def size_problem(name: str, shape: list[int], bits: int, dtype: str) -> str | None:
    """Why a tensor of ``shape`` cannot exist in any file (its size overflows), or None."""
    elements = math.prod(shape)
    if elements * bits < _BITS_LIMIT:
        return None
    exabytes = elements * bits / 8 / 1e18
    return (
        f"tensor {name!r} has shape {shape}: {elements:.3g} {dtype} elements, {exabytes:.3g} EB, more than "
        "any machine holds and more than safetensors can address, so the header is corrupt"
    )


def layout_problem(tensors: dict[str, dict[str, Any]], data: int) -> str | None:
    """Why the tensors' data offsets (already checked one by one against ``data``, the bytes after the
    header) do not tile the data exactly as safetensors requires, or None."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        start, stop = info["data_offsets"]
        if start != end:
            what = "overlaps the tensor before it" if start < end else f"leaves bytes {end} to {start} unused"
            return f"tensor {name!r} starts at byte {start} of the data and {what} (corrupt)"
        end = stop
    if end != data:
        return f"its tensors end at byte {end} of the data, but the file holds {data} bytes of data (corrupt)"
    return None
