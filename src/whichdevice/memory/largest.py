"""The largest job that fits: the longest ``max_length`` at the given batch, the largest batch at the given length.

vLLM (``--max-model-len auto``) and llama.cpp (``--fit``) answer this before a long-context run; here
it is the same fit placement makes (:class:`whichdevice.memory.fit.JobFit`: one device, or the
split over several), with the same terms (KV cache and activations for inference; gradients,
optimizer state and activations for training), searched by bisection since every term grows with
the tokens and the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from whichdevice.core.job import Job
from whichdevice.core.records import TraceStep
from whichdevice.model.shape import ModelShape

__all__ = ["largest_fit", "limits_steps", "whole_job_plan"]

# Searched up to these; a model's own context (max_position_embeddings) caps the length first.
_MAX_TOKENS = 1 << 24
_MAX_BATCH = 1 << 16


@dataclass(frozen=True)
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


def _bisect(ok: Callable[[int], bool], high: int) -> int:
    """The largest n in [1, high] with ok(n), assuming ok is monotone; 0 when ok(1) is False."""
    if not ok(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def largest_fit(
    shape: ModelShape,
    job: Job,
    need: Callable[[int, int], int],
    fits: Callable[[int], bool],
    *,
    plan: str = "",
) -> LargestFit:
    """Search ``job``'s length and batch against ``fits(bytes besides the weights) -> bool``, where
    ``need(batch, tokens)`` prices the job at that size; ``plan`` names the plan the limits are of."""
    context = shape.max_positions if isinstance(shape.max_positions, int) and shape.max_positions > 0 else None
    batch = job.batch_size or 1
    tokens = job.max_length or min(context or 2048, 2048)

    longest = _bisect(lambda t: fits(need(batch, t)), context or _MAX_TOKENS)
    largest_batch = _bisect(lambda b: fits(need(b, tokens)), _MAX_BATCH)
    said = shape.context.text() if shape.context is not None else ""
    return LargestFit(batch, tokens, longest or None, largest_batch or None, context, plan, said)


def whole_job_plan(job: Job, dtype: str) -> str:
    """The plan the whole job's limits are of (LargestFit.plan)."""
    return "for " + ("full fine-tuning" if job.task == "training" else job.task) + f" in {dtype}"


def limits_steps(largest: LargestFit | None) -> list[TraceStep]:
    """The limits of the chosen plan, said in the trace (the placement carries them to the resolution).

    They are of the plan placement chooses (memory/placement.py's place_model): the whole job's where it
    fits (or nothing does), LoRA's where LoRA is chosen; a quantized plan's are not searched, and the
    whole job's are named as such."""
    return [TraceStep("limits", largest.text())] if largest is not None else []
