"""What a Hogwild-style worker does to a model's weights in shared memory: scales them in place, from
another process. Imported by a spawned child (torch only), called directly by a forked one."""

from __future__ import annotations

from typing import Any


def scale_in_place(weights: list[Any], factor: float) -> None:
    """Multiply each of ``weights`` (tensors in shared memory) by ``factor`` where they live."""
    import torch

    with torch.no_grad():
        for weight in weights:
            weight.mul_(factor)
