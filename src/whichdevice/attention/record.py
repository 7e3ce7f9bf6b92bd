"""The attention stage's records: the implementation a model runs with, and what continuous batching takes."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from whichdevice.core.frozen import NamedTuple, frozen_record

__all__ = ["Attention", "Serving"]


@frozen_record
class Serving:
    """The continuous-batching answer: whether it applies, and the ContinuousBatchingConfig fields
    whichdevice checked (``config``), which ``Resolution.generate_batch_kwargs()`` hands over."""

    applies: bool
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"applies": self.applies, "continuous_batching_config": dict(self.config)}


class Attention(NamedTuple):
    """The attention stage's answer: what the loaded model runs with, whether model_kwargs() passes it,
    and whether ``prepare()`` runs whichdevice's decode attention under it (``decode``: ``name`` is
    "sdpa"); then, decided once the model is placed, whether Hub kernels replace its layers (``use_kernels``,
    under ``kernels_key``: attention/kernels.py) and what continuous batching takes (``serving``:
    attention/serving.py, None for a job that serves no requests)."""

    name: str | None  # None: transformers decides, and whichdevice cannot tell what (no model= to read)
    passed: bool
    decode: bool = False
    use_kernels: bool = False
    kernels_key: str | None = None
    serving: Serving | None = None
