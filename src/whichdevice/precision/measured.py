"""The CPU's dtype and decode attention from its measured speeds and the job (pure; see calibration).

A generation of ``batch`` sequences of ``max_length`` tokens is a prompt (``batch x prompt`` rows
through every weight, compute-bound) and then one decode step per new token (``batch`` rows,
bound by reading the weights). Its time in each dtype is estimated from the calibration's figures
for those two shapes; a half precision is chosen when it is estimated at least ``MARGIN`` faster
than fp32, which is exact. Training is prompt-shaped throughout (forward and backward over whole
sequences), so the prompt figure decides bf16 autocast.

Correctness first: fp16 is a candidate only for a checkpoint stored in fp16 whose architecture is
not fp16-unsafe; bf16 (fp32's range) always is; the measurement never turns on what the rules refuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.dtypes import short_name
from whichdevice.core.job import Job

if TYPE_CHECKING:
    from whichdevice.hardware.calibration import Calibration

__all__ = [
    "ATTENTION_MARGIN",
    "DEFAULT_LENGTH",
    "MARGIN",
    "Job",
    "measured_attention",
    "measured_dtype",
    "measured_training",
]

# A half precision must be estimated this much faster than fp32 to be chosen: the figures of a
# shared machine move by a few percent, and fp32 is exact.
MARGIN = 1.05
# whichdevice_sdpa's decode path must be measured this much faster than torch's fused kernel: the
# rest of a step (prompt attention, masks) runs sdpa either way.
ATTENTION_MARGIN = 1.10
# Tokens per sequence assumed when max_length is not given: a 128-token prompt and 128 new tokens.
DEFAULT_LENGTH = 256


def _decode_shape(batch: int) -> str:
    # Measured at 1, 2, 4 and 8 rows; larger batches are nearer the prompt's shape than a step's.
    if batch <= 8:
        return f"b{min(b for b in (1, 2, 4, 8) if b >= batch)}"
    return "prompt" if batch > 16 else "b8"


def _estimate(calib: Calibration, dtype: str, batch: int, length: int) -> float | None:
    """Estimated speed of ``dtype`` over fp32 for ``batch`` sequences of ``length`` tokens (half prompt)."""
    shape = _decode_shape(batch)
    decode, prompt = calib.speed(dtype, shape), calib.speed(dtype, "prompt")
    step, row = calib.fp32.get(shape), calib.fp32.get("prompt")
    if decode is None:
        return None
    if prompt is None or step is None or row is None:
        return decode
    prompt_tokens = length // 2
    new_tokens = max(length - prompt_tokens, 1)
    if shape == "prompt":
        step = row * batch
    fp32_time = batch * prompt_tokens * row + new_tokens * step
    time = batch * prompt_tokens * row / prompt + new_tokens * step / decode
    return fp32_time / time


def measured_dtype(calib: Calibration, job: Job, candidates: tuple[str, ...]) -> tuple[str, str]:
    """The fastest of fp32 and ``candidates`` for ``job`` by ``calib``, and the sentence that quotes why."""
    batch = job.batch_size or 1
    length = job.max_length or DEFAULT_LENGTH
    assumed = []
    if job.batch_size is None:
        assumed.append("batch 1 assumed (pass batch_size=)")
    if job.max_length is None:
        assumed.append(f"{DEFAULT_LENGTH} tokens assumed (pass max_length=)")
    shape = _decode_shape(batch)
    quoted = []
    best, best_speed = "float32", 1.0
    for dtype in candidates:
        speed = _estimate(calib, dtype, batch, length)
        if speed is None:
            continue
        decode, prompt = calib.speed(dtype, shape), calib.speed(dtype, "prompt")
        figures = f"{short_name(dtype)} decode {decode:.2f}x fp32 here at batch {batch}"
        if prompt is not None:
            figures += f", prompt {prompt:.2f}x"
        quoted.append(f"{figures}: {speed:.2f}x fp32 estimated for {batch} x {length} tokens")
        if speed >= MARGIN and speed > best_speed:
            best, best_speed = dtype, speed
    job_text = f" ({'; '.join(assumed)})" if assumed else ""
    if not quoted:
        return "float32", f"measured: no half precision timed on this CPU{job_text}"
    verdict = "fastest" if best != "float32" else f"no half precision {MARGIN:.2f}x faster, fp32 is exact"
    return best, f"measured, {'; '.join(quoted)}; {verdict}{job_text}"


def measured_training(calib: Calibration) -> tuple[bool, str]:
    """Whether bf16 autocast trains faster than fp32 here, by the prompt-sized matmul."""
    prompt = calib.speed("bfloat16", "prompt")
    if prompt is None:
        return False, "measured: bf16 not timed on this CPU"
    ok = prompt >= MARGIN
    return ok, f"measured: a prompt-sized bf16 matmul runs {prompt:.2f}x fp32 here, and training is prompt-shaped"


def measured_attention(calib: Calibration, dtype: str) -> tuple[bool | None, str]:
    """Whether whichdevice_sdpa's matmul decode path beats torch's fused kernel in ``dtype`` here
    (None: not measured, the unmeasured rule applies)."""
    ratio = calib.speed(dtype, "attention")
    if ratio is None:
        return None, ""
    text = f"a one-token {short_name(dtype)} attention by plain matmuls measured {ratio:.2f}x torch's fused kernel here"
    return ratio >= ATTENTION_MARGIN, text
