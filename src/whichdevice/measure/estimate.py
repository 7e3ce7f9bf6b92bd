"""The CPU's estimate of a generation's time in each dtype, from its calibration and the job (pure).

A generation of ``batch`` sequences is a prompt (``batch x prompt`` rows through every weight,
compute-bound) and then one decode step per new token (``batch`` rows, each step reading every
weight once). Each part is priced from the calibration's figures (fp32 seconds per parameter of a
timed set, and each dtype's speed over fp32) scaled to the model: a step whose weights outgrow the
last-level cache streams them from memory ("s1"/"s4"; bf16 at one row also "g1", torch's own GEMV
kernel), a smaller one runs from the cache ("b1".."b8"). A streamed one-row step is also a number of
matmul calls, each with a fixed cost: the same memory timed as layer-sized and as narrow matrices
("s1"/"sn1", "g1"/"gn1") separates the two. At batch 2 and more a step may run with the weights packed
ahead in oneDNN's layout ("p4", its prompt "pp"), the packing paid once at ``memory["pack"]`` GB/s:
``PackingPlan`` holds those figures for the tuning (whichdevice.tuning), which hands packing over
where the whole job, packing counted, is ``PACK_MARGIN`` faster. Where bf16 arithmetic is slow here
and the prompt-sized matmul ran ``MARGIN`` faster in fp32 from the bf16 weights ("up", the upcast
counted), ``upcast_rows`` is the row count above which a forward is cheaper that way: a bf16 load's
forwards of more rows (its prompt) are priced, and run (``tuning.upcast``), so. The measurements
behind each constant are in docs/backends/cpu.md ("The estimate").

The dtype choice (``precision.measured``) and the tuning both read this module; neither repeats it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from whichdevice.core.dtypes import item_size
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.job import Job, new_tokens
from whichdevice.measure.figures import PROMPT_ROWS
from whichdevice.measure.packing_plan import PACK_MARGIN, PackingPlan

if TYPE_CHECKING:
    from whichdevice.measure.figures import Calibration
    from whichdevice.model.step_weights import StepWeights

__all__ = [
    "ASSUMED_MATMULS",
    "ASSUMED_PARAMETERS",
    "DEFAULT_LENGTH",
    "MARGIN",
    "PACK_MARGIN",
    "PACK_SLOWER",
    "CpuJob",
    "PackingPlan",
    "StepEstimate",
    "estimate_seconds",
    "estimated_tokens",
    "lost_figures",
    "upcast_rows",
]


class CpuJob(NamedTuple):
    """What a CPU estimate is made from: the calibration, the job as told, and the weights a decode step
    reads (from the checkpoint's headers; None without model=)."""

    calibration: Calibration
    job: Job
    weights: StepWeights | None = None


# Another dtype must be estimated this much faster than the default to replace it: the figures of
# a shared machine move by a few percent between runs, and the default is exact or the checkpoint's.
MARGIN = 1.05
# A model's weights pack this many times slower than the calibration's set did (see _packed_step).
PACK_SLOWER = 2.0
# Tokens per sequence assumed when max_length is not given: a 128-token prompt and 128 new tokens.
DEFAULT_LENGTH = 256
# Weights read per decode step assumed when the model is not given: the 0.3-8B models CPU users run
# stream from memory, as 1B does past any CPU's cache.
ASSUMED_PARAMETERS = 1_000_000_000
# The largest crossover looked for: a forward of more rows is a prompt, priced by the prompt's figures.
_UPCAST_MAX_ROWS = 4096
# Matmuls per decode step assumed with it: a 1.1B Llama's 22 layers of 7 projections, and its head.
ASSUMED_MATMULS = 155


class StepEstimate(NamedTuple):
    """One decode step as the estimate prices it, and whether the CPU tunings pay for it."""

    seconds: float  # one decode step for the model, in the calibration's fp32 seconds
    figure: str  # the figure it rests on, quoted
    streamed: bool
    single_row: bool  # its batch-1 steps run fastest through torch's own GEMV kernel (oneDNN off)
    packed: bool = False
    pack_seconds: float = 0.0  # packing the weights once, in seconds
    plan: PackingPlan | None = None  # where packing was estimated to pay for the job


def _resident_shape(batch: int) -> str:
    # Measured at 1, 2, 4 and 8 rows; larger batches are nearer the prompt's shape than a step's.
    if batch <= 8:
        return f"b{min(b for b in (1, 2, 4, 8) if b >= batch)}"
    return "prompt" if batch > 16 else "b8"


def _per_parameter(calib: Calibration, shape: str) -> float | None:
    """fp32 seconds per parameter of ``shape``'s timed set (relative seconds without the set's size)."""
    seconds = calib.fp32.get(shape)
    size = calib.memory.get("stream" if shape.startswith("s") else "cache")
    if seconds is None:
        return None
    return seconds / size if size else seconds / ASSUMED_PARAMETERS


def _streams(calib: Calibration, dtype: str, parameters: int) -> bool:
    llc = calib.memory.get("llc")
    timed = calib.fp32.get("s1") is not None and (dtype == "float32" or calib.speed(dtype, "s1") is not None)
    return timed and llc is not None and parameters * item_size(dtype) > llc


def lost_figures(calib: Calibration, job: Job, weights: StepWeights | None, dtypes: tuple[str, ...]) -> list[str]:
    """The shapes the job's estimate in ``dtypes`` would read that were dropped as unsteady (see
    ``Calibration.steady_part``): where any is, the CPU's flags decide this job, never an estimate
    from a neighbouring figure (a streamed model read as cache-resident when "s1" moved)."""
    batch, parameters = job.batch_size or 1, weights.parameters if weights else ASSUMED_PARAMETERS
    llc = calib.memory.get("llc")
    stream_shape = "s1" if batch <= 1 else "s4"
    needed = {"prompt"}
    for dtype in dtypes:
        streamed = llc is not None and parameters * item_size(dtype) > llc
        timed = calib.lost(stream_shape) or _streams(calib, dtype, parameters)
        needed.add(stream_shape if streamed and timed else _resident_shape(batch))
    return sorted(shape for shape in needed if calib.lost(shape))


def _per_call(calib: Calibration, dtype: str, shapes: tuple[str, str]) -> tuple[float, float] | None:
    """(seconds per matmul call, seconds per weight) of ``dtype``'s one-row streamed step on the path
    the (layer-sized, narrow) ``shapes`` timed; None without both sets' figures. The two sets cover
    the same memory in different numbers of calls, so the difference in time is the calls' cost."""
    figures = [1.0 if dtype == "float32" else calib.speed(dtype, shape) for shape in shapes]
    figures += [calib.fp32.get("s1"), calib.fp32.get("sn1")]
    figures += [calib.memory.get(k) for k in ("calls", "narrow", "stream", "narrow_stream")]
    known = [f for f in figures if f is not None]
    if len(known) < len(figures):
        return None
    speed, narrow_speed, seconds, narrow_seconds, calls, narrow, weights, narrow_weights = known
    big, small = seconds / speed, narrow_seconds / narrow_speed
    determinant = narrow * weights - calls * narrow_weights
    if determinant <= 0:  # a narrow set with no more calls than the large one separates nothing
        return None
    call = (small * weights - big * narrow_weights) / determinant
    if call <= 0:  # the narrow set ran as fast per weight (noise): the bytes alone decide
        return 0.0, big / weights
    return call, (big - calls * call) / weights


def _streamed_one_row(calib: Calibration, dtype: str, parameters: int, matmuls: int, shape: str) -> float | None:
    """A one-row streamed step of ``parameters`` weights in ``matmuls`` calls on the path ``shape``
    ("s1" the default, "g1" torch's GEMV kernel) timed, in seconds; by the layer-sized set alone
    where the narrow one was not timed (a calibration of an older format, a simulation)."""
    split = _per_call(calib, dtype, (shape, "sn1" if shape == "s1" else "gn1"))
    if split is not None and split[1] > 0:
        return matmuls * split[0] + parameters * split[1]
    speed = 1.0 if dtype == "float32" else calib.speed(dtype, shape)
    per = _per_parameter(calib, "s1")
    return None if speed is None or per is None else per * parameters / speed


def _step(calib: Calibration, dtype: str, batch: int, parameters: int, matmuls: int) -> StepEstimate | None:
    """One decode step's estimated fp32-seconds in ``dtype`` for ``parameters`` weights in ``matmuls``."""
    streamed = _streams(calib, dtype, parameters)
    shape = ("s1" if batch <= 1 else "s4") if streamed else _resident_shape(batch)
    if shape == "s1":
        return _one_row_step(calib, dtype, parameters, matmuls)
    speed = 1.0 if dtype == "float32" else calib.speed(dtype, shape)
    per = _per_parameter(calib, shape)
    if speed is None or per is None:
        return None
    rows = (batch if shape == "prompt" else 1) * (batch / 4 if streamed and batch > 4 else 1)
    where = "streamed from memory" if streamed else "in the cache"
    figure = f"decode {speed:.2f}x fp32 here at batch {batch} with weights {where}"
    return StepEstimate(per * parameters * rows / speed, figure, streamed, False)


def _one_row_step(calib: Calibration, dtype: str, parameters: int, matmuls: int) -> StepEstimate | None:
    """The batch-1 streamed step, on torch's GEMV kernel where that is ``MARGIN`` faster for bf16."""
    seconds = _streamed_one_row(calib, dtype, parameters, matmuls, "s1")
    fp32 = _streamed_one_row(calib, "float32", parameters, matmuls, "s1")
    if seconds is None or fp32 is None:
        return None
    calls = ", its matmul calls counted" if calib.fp32.get("sn1") else ""
    figure = f"decode {fp32 / seconds:.2f}x fp32 here at batch 1 with weights streamed from memory{calls}"
    gemv = _streamed_one_row(calib, dtype, parameters, matmuls, "g1") if dtype == "bfloat16" else None
    single = gemv is not None and seconds >= gemv * MARGIN
    if single and gemv is not None:
        seconds = gemv
        figure += f", {fp32 / gemv:.2f}x through torch's GEMV kernel"
    return StepEstimate(seconds, figure, True, single)


def _packed_speed(calib: Calibration, dtype: str) -> float | None:
    """``dtype``'s streamed batch-4 step with packed weights, over fp32's unpacked one."""
    if dtype == "float32":
        packed, plain = calib.fp32.get("p4"), calib.fp32.get("s4")
        return plain / packed if packed and plain else None
    return calib.speed(dtype, "p4")


def _packed_prompt_gain(calib: Calibration, dtype: str) -> float:
    """How much faster ``dtype``'s prompt runs with the weights packed (fp32 measured 1.3-1.45x here);
    1.0 where the packed prompt was not timed (a calibration of an older format, a simulation)."""
    if dtype == "float32":
        packed, plain = calib.fp32.get("pp"), calib.fp32.get("prompt")
        return plain / packed if packed and plain else 1.0
    packed, plain = calib.speed(dtype, "pp"), calib.speed(dtype, "prompt")
    return packed / plain if packed and plain else 1.0


def _packed_step(
    calib: Calibration, dtype: str, batch: int, parameters: int, step: StepEstimate
) -> StepEstimate | None:
    """The streamed step of ``batch`` >= 2 rows with weights packed ahead; None: not timed, or not
    ``MARGIN`` faster per step than ``step`` (then the packing never pays)."""
    packed, plain = _packed_speed(calib, dtype), calib.speed(dtype, "s4") if dtype != "float32" else 1.0
    rate = calib.memory.get("pack")
    if not step.streamed or batch < 2 or packed is None or plain is None or not rate or packed < plain * MARGIN:
        return None
    # A model's fresh memory packs slower per weight than the calibration's set (docs/backends/cpu.md,
    # "Packed weights for batches of several rows"): a dtype chosen for its packing is priced at PACK_SLOWER.
    pack_seconds = PACK_SLOWER * parameters * 4 / (rate * 1e9)
    figure = f"{step.figure}, {packed:.2f}x with its weights packed ahead (packing about {pack_seconds:.2g} s once)"
    return StepEstimate(step.seconds * plain / packed, figure, True, False, True, pack_seconds)


def _upcast(calib: Calibration) -> tuple[int, float] | None:
    """(``upcast_rows``, seconds per parameter of copying a bf16 weight into the fp32 buffer), or None."""
    row, up, own = _per_parameter(calib, "prompt"), calib.speed("bfloat16", "up"), calib.speed("bfloat16", "prompt")
    packed = calib.speed("bfloat16", "pp") or 0.0
    if row is None or up is None or own is None or own >= 1.0 or up < MARGIN * max(own, packed):
        return None
    copy = PROMPT_ROWS * row * max(1.0 / up - 1.0, 0.0)
    rate = calib.memory.get("upcast")
    if calib.memory.get("cache") and rate:
        # The prompt's figure copies weights that sit in the cache; a model's stream from memory.
        copy = max(copy, 4.0 / (rate * 1e9))
    # Per parameter at r rows: bf16 takes its streamed step (a few rows read the weights, at most) or
    # r prompt rows, whichever is longer; the fp32 path the copy, then fp32's streamed step or r rows.
    fp32_step, speed = _per_parameter(calib, "s4"), calib.speed("bfloat16", "s4")
    streamed = (fp32_step, fp32_step / speed) if fp32_step and speed else (0.0, 0.0)
    for rows in range(1, _UPCAST_MAX_ROWS + 1):
        if copy + max(streamed[0], rows * row) < max(streamed[1], rows * row / own):
            return max(1, rows - 1), copy
    return None


def upcast_rows(calib: Calibration) -> int | None:
    """The rows above which a bf16 linear layer's forward runs faster in fp32 from its weights copied
    into a reused fp32 buffer (the copy paid per call) than in bf16, by the calibration's prompt-sized
    figures ("prompt", "up"); None where bf16's prompt is not measured slower here, or the fp32 path
    not ``MARGIN`` faster than bf16's own (packed or not) at the prompt's size."""
    upcast = _upcast(calib)
    return None if upcast is None else upcast[0]


def _upcast_step(
    calib: Calibration, batch: int, parameters: int, matmuls: int, step: StepEstimate, threshold: int, upcast: float
) -> StepEstimate:
    """A bf16 decode step whose ``batch`` rows are above ``threshold``: fp32's step and the copy."""
    fp32 = _step(calib, "float32", batch, parameters, matmuls) if batch > threshold else None
    if fp32 is None:
        return step._replace(figure=f"{step.figure}, prompts over {threshold} rows in fp32 from the bf16 weights")
    return fp32._replace(
        seconds=fp32.seconds + upcast * parameters,
        figure=f"{fp32.figure}, in fp32 from the bf16 weights (over {threshold} rows)",
    )


def estimated_tokens(job: Job) -> tuple[int, int]:
    """(prompt tokens, new tokens) per sequence: max_new_tokens new where given, else half of max_length
    (a quarter was tried and declined packing where it paid: docs/backends/cpu.md)."""
    length = job.max_length or DEFAULT_LENGTH
    new = new_tokens(replace(job, max_length=length)) or 1  # the rule the GPU's static cache counts by too
    if job.max_new_tokens is None:
        return length - new, new
    return max(length - new if job.max_length else DEFAULT_LENGTH // 2, 1), new


def estimate_seconds(
    calib: Calibration, dtype: str, job: Job, weights: StepWeights | None = None, packing: bool = True
) -> tuple[float, StepEstimate] | None:
    """The job's estimated fp32-seconds in ``dtype`` (its prompt and new tokens: ``estimated_tokens``)
    and its decode step, for a model whose decode step reads ``weights`` (None: ``ASSUMED_PARAMETERS``);
    None where ``dtype`` was not timed. Packed weights are taken where the whole job, packing
    included, is estimated ``PACK_MARGIN`` faster with them."""
    batch = job.batch_size or 1
    parameters = weights.parameters if weights else ASSUMED_PARAMETERS
    # Without the headers' count, a model shaped like the assumed one.
    matmuls = (
        weights.matmuls if weights and weights.matmuls else round(ASSUMED_MATMULS * parameters / ASSUMED_PARAMETERS)
    )
    matmuls = max(1, matmuls)
    step = _step(calib, dtype, batch, parameters, matmuls)
    if step is None:
        return None
    prompt_tokens, new_tokens = estimated_tokens(job)
    steps = max(new_tokens - 1, 0)  # the prompt's forward makes the first new token
    row = _per_parameter(calib, "prompt")
    speed = 1.0 if dtype == "float32" else calib.speed(dtype, "prompt")
    prompt = 0.0 if row is None or speed is None else batch * prompt_tokens * row * parameters / speed
    upcast = _upcast(calib) if dtype == "bfloat16" else None
    in_fp32 = upcast is not None and row is not None and batch * prompt_tokens > upcast[0]
    if in_fp32 and upcast is not None and row is not None:
        prompt = batch * prompt_tokens * row * parameters + upcast[1] * parameters  # in fp32, the copy once
        step = _upcast_step(calib, batch, parameters, matmuls, step, *upcast)
    plain = prompt + steps * step.seconds
    # Steps of more rows than the crossover run in fp32 too, never the packed copy.
    every_call = upcast is not None and batch > upcast[0]
    packed = _packed_step(calib, dtype, batch, parameters, step) if packing and not every_call else None
    if packed is not None:
        per_token = prompt / prompt_tokens if prompt_tokens else 0.0
        # A prompt computed in fp32 from the weights does not run the packed copy.
        packed_prompt = prompt if in_fp32 else prompt / _packed_prompt_gain(calib, dtype)
        plan = PackingPlan(
            dtype,
            batch,
            step.seconds,
            packed.seconds,
            packed.pack_seconds / PACK_SLOWER,  # the calibration's rate: the packing's own clock stops a slower one
            per_token,
            packed_prompt / prompt_tokens if prompt_tokens else 0.0,
            prompt_tokens,
            new_tokens,
            job.max_new_tokens is not None,
        )
        if plan.budget_s(prompt_tokens, new_tokens) is not None:
            # A dtype is chosen at the slower price: unlike a packing, a load in it is not undone.
            return packed_prompt + steps * packed.seconds + packed.pack_seconds, packed._replace(plan=plan)
        counted = "" if job.max_new_tokens else " (half of max_length; pass max_new_tokens=)"
        return plain, step._replace(figure=f"{packed.figure}, not paid back by {new_tokens} new tokens{counted}")
    return plain, step
