"""The one record a Resolution carries for what ``prepare()`` installs: ``Tuning``, or None where nothing is tuned."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.attention.decode_forward import ATTENTION_NAME as DECODE_ATTENTION
from whichdevice.core.frozen import frozen_record

if TYPE_CHECKING:
    from whichdevice.measure.packing_plan import PackingPlan

__all__ = ["Tuning"]


@frozen_record
class Tuning:
    """What ``prepare(model)`` installs, each decided in ``tuning.decide`` with a trace line.

    ``single_row``: batch-1 decode steps (one token row) run with oneDNN off, through torch's own GEMV
    kernel (CPU, bf16 weights streamed from memory, measured faster). ``packing``: the linear weights
    get a copy packed ahead in oneDNN's layout for ``packing.batch`` rows (CPU, measured faster for the
    job, packing counted); at ``prepare`` where the job's new tokens were told, else at the first
    ``generate`` call whose own tokens repay it. ``static_cache``: generate gets
    ``cache_implementation="static"``, which it compiles (NVIDIA GPU, a job long enough to repay it).
    ``decode_attention``: the model, loaded with the sdpa the keywords name, runs whichdevice's CPU decode
    attention (``whichdevice_sdpa``) instead (CPU inference in bf16/fp16 for a verified grouped-query
    architecture, or asked for). ``upcast_above``: each bf16 linear layer computes a forward of more
    rows than this (a prompt) in fp32 from its weights, copied per call into a reused fp32 buffer,
    and fewer (decode steps) in bf16 (CPU whose bf16 arithmetic measured slow and its bf16 decode
    steps fast; None: every forward as loaded)."""

    single_row: bool = False
    packing: PackingPlan | None = None
    static_cache: bool = False
    decode_attention: bool = False
    upcast_above: int | None = None

    @property
    def packed_for_batch(self) -> int | None:
        return self.packing.batch if self.packing is not None else None

    @property
    def packing_at_generate(self) -> bool:
        """Whether the packing waits for a generate call (the job's new tokens were not told)."""
        return self.packing is not None and not self.packing.told

    @property
    def packing_budget_s(self) -> float | None:
        """The seconds a packing at prepare() may take (priced at its own rate as it runs); None: no packing."""
        return self.packing.budget_for_job if self.packing is not None else None

    def attention_after_prepare(self, handed: str | None) -> str | None:
        """The attention a model loaded with ``handed`` (the keywords' attn_implementation) runs once
        prepared: whichdevice's decode attention in place of sdpa, else ``handed``."""
        return DECODE_ATTENTION if self.decode_attention and handed == "sdpa" else handed

    def generate_kwargs(self) -> dict[str, Any]:
        """Keywords for ``model.generate`` (or a text-generation pipeline's call)."""
        return {"cache_implementation": "static"} if self.static_cache else {}

    def to_dict(self) -> dict[str, Any]:
        budget = self.packing_budget_s
        return {
            "single_row": self.single_row,
            "packed_for_batch": self.packed_for_batch,
            "packing_budget_s": None if budget is None or self.packing_at_generate else round(budget, 3),
            "packing_at_generate": self.packing_at_generate,
            "static_cache": self.static_cache,
            "decode_attention": self.decode_attention,
            "upcast_above": self.upcast_above,
        }
