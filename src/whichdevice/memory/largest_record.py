"""The record of the largest job that fits: the longest length at a batch, the largest batch at a length.

Its own module, importing nothing of whichdevice's: ``memory/record.py`` names it in the Placement it
annotates, and memory/largest.py, which computes it, reads the model's shape (a longer chain of imports
that a placement's record should not pull in). ``memory.largest.LargestFit`` and ``memory.fit.LargestFit``
still name it.
"""

from __future__ import annotations

from typing import Any

from whichdevice.core.frozen import frozen_record

__all__ = ["LargestFit"]


@frozen_record
class LargestFit:
    """At ``batch_size``, ``max_length`` tokens at most; at ``max_length``, ``batch`` sequences at most
    (None: not even one token or one sequence fits, so there is no value resolve_device() would take;
    ``context`` is the model's own limit). ``plan`` names what they are the limits of: the plan the
    resolution chose ("full fine-tuning in float32", "LoRA adapters on bfloat16 weights", ...)."""

    batch_size: int
    max_length: int
    longest: int | None
    largest_batch: int | None
    context: int | None
    plan: str = ""
    # How the context was read (model/context.py's Context.text()): said where the limit is the context.
    context_said: str = ""

    def text(self) -> str:
        whole = f": {self.context_said}" if self.context_said else ""
        capped = (
            f" (the model's whole context{whole})"
            if self.context and self.longest and self.longest >= self.context
            else ""
        )
        longest = (
            f"max_length={self.longest}{capped} at batch_size={self.batch_size}"
            if self.longest
            else f"not one token at batch_size={self.batch_size}"
        )
        batch = (
            f"batch_size={self.largest_batch} at max_length={self.max_length}"
            if self.largest_batch
            else f"not one sequence of max_length={self.max_length}"
        )
        of = f" {self.plan}" if self.plan else ""
        return f"the largest that fit{of}: {longest}; {batch}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "largest_max_length": self.longest,
            "largest_batch_size": self.largest_batch,
            "model_context": self.context,
            "plan": self.plan,
        }
