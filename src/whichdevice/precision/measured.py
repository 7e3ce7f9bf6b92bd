"""The CPU's dtype and decode attention from its measured speeds and the job (pure; see calibration).

Each candidate dtype's job time comes from ``measure.estimate`` (prompt and decode steps priced
from the calibration, packing counted where it pays). Hysteresis: the job keeps its default (the
checkpoint's own half precision where it runs natively, else fp32) unless another dtype is estimated
at least ``MARGIN`` faster, so figures near a tie, which move a few percent between runs, cannot flip
the decision; upcasting a half-precision checkpoint to fp32 needs fp32 estimated that much faster, and
the trace quotes the figure. Training is prompt-shaped throughout (forward and backward over whole
sequences): the prompt figure decides.

Correctness first: fp16 is a candidate only for a checkpoint stored in fp16 whose architecture is
not fp16-unsafe; bf16 (fp32's range) always is; the measurement never turns on what the rules refuse.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from whichdevice.core.dtypes import short_name
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.job import Job
from whichdevice.measure.estimate import (
    ASSUMED_PARAMETERS,
    DEFAULT_LENGTH,
    MARGIN,
    estimate_seconds,
    estimated_tokens,
)

if TYPE_CHECKING:
    from whichdevice.measure.figures import Calibration
    from whichdevice.model.step_weights import StepWeights

__all__ = ["ATTENTION_MARGIN", "MARGIN", "MeasuredChoice", "measured_attention", "measured_dtype", "measured_training"]

# whichdevice_sdpa's decode path must be measured this much faster than torch's fused kernel: the
# rest of a step (prompt attention, masks) runs sdpa either way.
ATTENTION_MARGIN = 1.10


class MeasuredChoice(NamedTuple):
    """The dtype, and the sentence quoting why (the tunings the same estimate hands over are the
    tuning's to decide: whichdevice.tuning.decide)."""

    dtype: str
    why: str


def _prompt(calib: Calibration, dtype: str) -> str:
    speed = calib.speed(dtype, "prompt")
    return "" if speed is None else f", prompt {speed:.2f}x"


def _sized(calib: Calibration, weights: StepWeights | None) -> str:
    llc = calib.memory.get("llc")
    cache = f", last-level cache {llc / 1024**2:.0f} MiB" if llc else ""
    if weights is None:
        return f"model size unknown (pass model=): {ASSUMED_PARAMETERS / 1e9:.0f}B parameters assumed{cache}"
    calls = f" in {weights.matmuls} matmuls" if weights.matmuls else ""
    megabytes = weights.parameters * 2 / 1024**2
    return f"{weights.parameters / 1e6:.0f}M parameters read per step{calls}, {megabytes:.0f} MiB in bf16{cache}"


def measured_dtype(
    calib: Calibration,
    job: Job,
    candidates: tuple[str, ...],
    default: str = "float32",
    weights: StepWeights | None = None,
) -> MeasuredChoice:
    """The fastest of fp32 and ``candidates`` for ``job`` by ``calib`` (a model whose decode step reads
    ``weights``), keeping ``default`` unless another is estimated ``MARGIN`` faster, with the sentence
    that quotes why."""
    assumed = [_sized(calib, weights)]
    if job.batch_size is None:
        assumed.append("batch 1 assumed (pass batch_size=)")
    if job.max_length is None:
        assumed.append(f"{DEFAULT_LENGTH} tokens assumed (pass max_length=)")
    job_text = f" ({'; '.join(assumed)})"
    estimates = {d: e for d in ("float32", *candidates) if (e := estimate_seconds(calib, d, job, weights)) is not None}
    if len(estimates) < 2:
        return MeasuredChoice("float32", f"measured: no half precision timed on this CPU{job_text}")
    # Every dtype's estimate is quoted against fp32 as torch runs it, unpacked.
    unpacked = estimate_seconds(calib, "float32", job, weights, packing=False)
    fp32 = unpacked[0] if unpacked else estimates["float32"][0]
    tokens = f"{job.batch_size or 1} x {job.max_length or DEFAULT_LENGTH} tokens"
    if job.max_new_tokens is None:
        tokens += ", half of them new"
    quoted = [
        f"{short_name(d)} {step.figure}{_prompt(calib, d)}: {fp32 / seconds:.2f}x fp32 estimated for {tokens}"
        for d, (seconds, step) in estimates.items()
        if d != "float32" or "packed ahead" in step.figure
    ]
    default = default if default in estimates else "float32"
    if job.max_new_tokens is None:
        best, verdict = _over_splits(calib, job, weights, tuple(estimates), default)
    else:
        best, verdict = _for_the_split({d: e[0] for d, e in estimates.items()}, default)
    chosen = estimates[best][1]
    why = f"measured, {'; '.join(quoted)}; {verdict}{job_text}"
    if chosen.packed:
        why += f"; {short_name(best)} weights packed ahead: {chosen.figure.rpartition(', ')[2]}"
        if job.max_new_tokens is None:
            # A guessed count decided wrongly both ways (capped CPU, 9 of 41 tokens new: 0.85x of the
            # best with 21 counted, 1.00x told), so generate decides by each call's own count.
            of = "max_length" if job.max_length else f"the {DEFAULT_LENGTH} tokens assumed"
            why += (
                f", counted against {estimated_tokens(job)[1]} new tokens, half of {of}: packed at the first "
                "generate() call whose own tokens repay it (pass max_new_tokens= to have prepare() pack)"
            )
    return MeasuredChoice(best, why)


def _kept(default: str) -> str:
    return f"the checkpoint's {short_name(default)} kept" if default != "float32" else "fp32 is exact"


def _for_the_split(seconds: dict[str, float], default: str) -> tuple[str, str]:
    """The dtype estimated fastest for the told split (``MARGIN`` over the default), and the verdict."""
    best = min(seconds, key=lambda d: seconds[d])
    gain = seconds[default] / seconds[best]
    if best == default or gain < MARGIN:
        return default, f"no other dtype estimated {MARGIN:.2f}x faster, {_kept(default)}"
    return best, f"{short_name(best)}: estimated {gain:.2f}x as fast as {short_name(default)}, the default"


def _over_splits(
    calib: Calibration, job: Job, weights: StepWeights | None, dtypes: tuple[str, ...], default: str
) -> tuple[str, str]:
    """Where the new tokens were not told: the dtype whose worst case over the splits of the job's
    tokens (a pure prompt, a pure decode and three between) loses least against the best dtype of
    each split (``MARGIN`` over the default's), and the verdict with each dtype's ends."""
    length = job.max_length or DEFAULT_LENGTH
    splits = sorted({max(1, new) for new in (1, length // 4, length // 2, 3 * length // 4, length - 1)})
    times: dict[int, dict[str, float]] = {}
    for new in splits:
        told = replace(job, max_length=length, max_new_tokens=new)
        priced = {d: e[0] for d in dtypes if (e := estimate_seconds(calib, d, told, weights)) is not None}
        if len(priced) == len(dtypes):
            times[new] = priced
    worst = {d: max((t[d] / min(t.values()), new) for new, t in times.items()) for d in dtypes}
    best = min(dtypes, key=lambda d: worst[d][0])
    ends = "; ".join(
        f"{short_name(d)} at most {worst[d][0]:.2f}x the best dtype's time (at {worst[d][1]} new)"
        + (
            ""
            if d == "float32"
            else f", {times[splits[0]]['float32'] / times[splits[0]][d]:.2f}x fp32 for a pure prompt and "
            f"{times[splits[-1]]['float32'] / times[splits[-1]][d]:.2f}x for a pure decode"
        )
        for d in dtypes
    )
    assumed = (
        f"how the {length} tokens split into prompt and new tokens was not told (pass max_new_tokens= for the "
        f"exact answer), so each dtype is priced from a pure prompt ({length - 1} + 1) to a pure decode "
        f"(1 + {length - 1}): {ends}"
    )
    gain = worst[default][0] / worst[best][0]
    if best == default or gain < MARGIN:
        return default, f"{assumed}; no other dtype's worst case {MARGIN:.2f}x smaller, {_kept(default)}"
    return best, f"{assumed}; {short_name(best)}: its worst case {gain:.2f}x smaller than {short_name(default)}'s"


def measured_training(calib: Calibration) -> tuple[bool | None, str]:
    """Whether bf16 autocast trains faster than fp32 here, by the prompt-sized matmul (None: that
    figure moved while it was timed, and the flags decide)."""
    if calib.lost("prompt"):
        return None, "measured: the prompt-sized matmul could not be timed steadily, the CPU's flags decide"
    prompt = calib.speed("bfloat16", "prompt")
    if prompt is None:
        return False, "measured: bf16 not timed on this CPU"
    ok = prompt >= MARGIN
    return ok, f"measured: a prompt-sized bf16 matmul runs {prompt:.2f}x fp32 here, and training is prompt-shaped"


def measured_attention(calib: Calibration, dtype: str) -> tuple[bool | None, str]:
    """Whether whichdevice_sdpa's one-token path for a grouped-query model (its query heads grouped as
    rows of their key/value head, the "gqa" figure) beats torch's fused kernel as transformers calls
    it in ``dtype`` here; None: not measured, the unmeasured rule applies."""
    ratio = calib.speed(dtype, "gqa")
    if ratio is None:
        return None, ""
    text = (
        f"a one-token {short_name(dtype)} attention with the query heads grouped by key/value head measured"
        f" {ratio:.2f}x torch's fused kernel as transformers calls it here"
    )
    return ratio >= ATTENTION_MARGIN, text
