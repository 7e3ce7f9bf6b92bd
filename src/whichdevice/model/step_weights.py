"""What one decode step reads: the weights a CPU estimate prices a step by, and a GPU's compiled static
cache is sized by."""

from __future__ import annotations

from whichdevice.core.frozen import NamedTuple

__all__ = ["StepWeights"]


class StepWeights(NamedTuple):
    """What one decode step reads: ``parameters`` weights in ``matmuls`` matrix multiplications (0:
    not counted). The CPU's estimate prices a step by them, the GPU's static cache sizes its compile."""

    parameters: int
    matmuls: int = 0
