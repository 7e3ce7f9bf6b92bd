"""The largest job that fits: the longest ``max_length`` at the given batch, the largest batch at the given length.

vLLM (``--max-model-len auto``) and llama.cpp (``--fit``) answer this before a long-context run; here
it is the same fit placement makes (:class:`whichdevice.memory.fit.JobFit`: one device, or the
split over several), with the same terms (KV cache and activations for inference; gradients,
optimizer state and activations for training), searched by bisection since every term grows with
the tokens and the batch.
"""

from __future__ import annotations

from collections.abc import Callable

from whichdevice.core.job import Job
from whichdevice.core.records import TraceStep
from whichdevice.memory.largest_record import LargestFit
from whichdevice.model.shape import ModelShape

__all__ = ["largest_fit", "limits_steps", "whole_job_plan"]

# Searched up to these; a model's own context (max_position_embeddings) caps the length first.
_MAX_TOKENS = 1 << 24
_MAX_BATCH = 1 << 16


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
