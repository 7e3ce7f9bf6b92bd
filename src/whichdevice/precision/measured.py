"""The CPU's dtype and decode attention from its measured speeds and the job (pure; see calibration).

A generation of ``batch`` sequences of ``max_length`` tokens is a prompt (``batch x prompt`` rows
through every weight, compute-bound) and then one decode step per new token (``batch`` rows, each
step reading every weight once). Its time in each dtype is estimated from the calibration's figures
and the model's size: a step whose weights in that dtype outgrow the last-level cache streams them
from memory (the "s1"/"s4" figures; bf16 at batch 1 also "g1", torch's own GEMV kernel), a smaller
one runs from the cache ("b1".."b8"); each figure's fp32 seconds per parameter scale to the model.
Without a size (no ``model=``) a model of ``ASSUMED_PARAMETERS`` is assumed, as users run.

A streamed batch-1 step is also a number of matmul calls, each with a fixed cost beside its bytes:
the same memory is timed as a few layer-sized matrices ("s1", "g1") and as many narrow ones ("sn1",
"gn1"), which separates each path's seconds per call from its seconds per weight, and the model's
step is its matmuls (from its headers; ``ASSUMED_MATMULS`` without them) times the one plus its
weights times the other. A 0.1B model's small projections make the calls a large part of a step
and move the dtypes' and kernels' ratios (oneDNN's bf16 path has the largest cost per call here).

At batch 2 and more, a step's weights may be packed ahead in oneDNN's blocked layout ("p4":
``whichdevice.precision.packed_weights``): its prompt runs faster packed too ("pp"), the packing is
paid once, at ``memory["pack"]`` GB/s, and both are counted against the job's tokens, so a long
generation gets it and a short one does not.

Hysteresis: the job keeps its default (the checkpoint's own half precision where it runs natively,
else fp32) unless another dtype is estimated at least ``MARGIN`` faster, so figures near a tie,
which move a few percent between runs, cannot flip the decision; upcasting a half-precision
checkpoint to fp32 needs fp32 estimated that much faster, and the trace quotes the figure. Training
is prompt-shaped throughout (forward and backward over whole sequences): the prompt figure decides.

Correctness first: fp16 is a candidate only for a checkpoint stored in fp16 whose architecture is
not fp16-unsafe; bf16 (fp32's range) always is; the measurement never turns on what the rules refuse.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from whichdevice.core.dtypes import item_size, short_name
from whichdevice.core.job import Job, new_tokens
from whichdevice.precision.packing_plan import PACK_MARGIN, PackingPlan

if TYPE_CHECKING:
    from whichdevice.hardware.calibration import Calibration

__all__ = [
    "ASSUMED_MATMULS",
    "ASSUMED_PARAMETERS",
    "ATTENTION_MARGIN",
    "DEFAULT_LENGTH",
    "MARGIN",
    "PACK_MARGIN",
    "PACK_SLOWER",
    "Job",
    "MeasuredChoice",
    "estimate_seconds",
    "lost_figures",
    "measured_attention",
    "measured_dtype",
    "measured_training",
]

# Another dtype must be estimated this much faster than the default to replace it: the figures of
# a shared machine move by a few percent between runs, and the default is exact or the checkpoint's.
MARGIN = 1.05
# whichdevice_sdpa's decode path must be measured this much faster than torch's fused kernel: the
# rest of a step (prompt attention, masks) runs sdpa either way.
ATTENTION_MARGIN = 1.10
# A model's weights pack this many times slower than the calibration's set did (see _packed_step).
PACK_SLOWER = 2.0
# Tokens per sequence assumed when max_length is not given: a 128-token prompt and 128 new tokens.
DEFAULT_LENGTH = 256
# Weights read per decode step assumed when the model is not given: the 0.3-8B models CPU users run
# stream from memory, as 1B does past any CPU's cache.
ASSUMED_PARAMETERS = 1_000_000_000
# Matmuls per decode step assumed with it: a 1.1B Llama's 22 layers of 7 projections, and its head.
ASSUMED_MATMULS = 155


class MeasuredChoice(NamedTuple):
    """The dtype, the sentence quoting why, whether its batch-1 steps run fastest through torch's
    own GEMV kernel (oneDNN off: ``whichdevice.precision.single_row``), and whether its weights
    are packed ahead for the job's batch (``whichdevice.precision.packed_weights``), within what time."""

    dtype: str
    why: str
    single_row: bool = False
    # The estimate's figures for packing the weights (prepare() packs, or hooks generate to decide
    # by each call's tokens where the count was not told); None where nothing is packed.
    packing: PackingPlan | None = None

    @property
    def packed(self) -> bool:
        return self.packing is not None


class _Step(NamedTuple):
    seconds: float  # one decode step for the model, in the calibration's fp32 seconds
    figure: str  # the figure it rests on, quoted
    streamed: bool
    single_row: bool
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


def lost_figures(calib: Calibration, job: Job, dtypes: tuple[str, ...]) -> list[str]:
    """The shapes the job's estimate in ``dtypes`` would read that were dropped as unsteady (see
    ``Calibration.steady_part``): where any is, the CPU's flags decide this job, never an estimate
    from a neighbouring figure (a streamed model read as cache-resident when "s1" moved)."""
    batch, parameters = job.batch_size or 1, job.parameters or ASSUMED_PARAMETERS
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


def _step(calib: Calibration, dtype: str, batch: int, parameters: int, matmuls: int) -> _Step | None:
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
    return _Step(per * parameters * rows / speed, figure, streamed, False)


def _one_row_step(calib: Calibration, dtype: str, parameters: int, matmuls: int) -> _Step | None:
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
    return _Step(seconds, figure, True, single)


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


def _packed_step(calib: Calibration, dtype: str, batch: int, parameters: int, step: _Step) -> _Step | None:
    """The streamed step of ``batch`` >= 2 rows with weights packed ahead; None: not timed, or not
    ``MARGIN`` faster per step than ``step`` (then the packing never pays)."""
    packed, plain = _packed_speed(calib, dtype), calib.speed(dtype, "s4") if dtype != "float32" else 1.0
    rate = calib.memory.get("pack")
    if not step.streamed or batch < 2 or packed is None or plain is None or not rate or packed < plain * MARGIN:
        return None
    # The rate is fp32's bytes per second on the calibration's set; per weight, bf16 packed as fast or
    # faster there. A model's packing measured up to half that rate per weight (1.1B bf16: 0.3 G
    # weights/s against 0.5-0.7 G on the set; its fresh memory is faulted in page by page), so the
    # estimate counts it at PACK_SLOWER times the calibration's time.
    pack_seconds = PACK_SLOWER * parameters * 4 / (rate * 1e9)
    figure = f"{step.figure}, {packed:.2f}x with its weights packed ahead (packing about {pack_seconds:.2g} s once)"
    return _Step(step.seconds * plain / packed, figure, True, False, True, pack_seconds)


def _tokens(job: Job) -> tuple[int, int]:
    """(prompt tokens, new tokens) per sequence: max_new_tokens new where given, else half of max_length.

    Counting a setup against fewer new tokens where none are given (a quarter of max_length) was
    tried: at 32 + 9 tokens and batch 4 with oneDNN capped it declined packing where packing ran
    1.3x (0.1B) and 2.7x (1.1B) the unpacked load, to spare one cell (0.4B, upcast) 0.84x."""
    length = job.max_length or DEFAULT_LENGTH
    new = new_tokens(replace(job, max_length=length)) or 1  # the rule resolve/generation.py counts by too
    if job.max_new_tokens is None:
        return length - new, new
    return max(length - new if job.max_length else DEFAULT_LENGTH // 2, 1), new


def estimate_seconds(calib: Calibration, dtype: str, job: Job, packing: bool = True) -> tuple[float, _Step] | None:
    """The job's estimated fp32-seconds in ``dtype`` (its prompt and new tokens: ``_tokens``) and its
    decode step; None where ``dtype`` was not timed. Packed weights are taken where the whole job,
    packing included, is estimated ``PACK_MARGIN`` faster with them."""
    batch = job.batch_size or 1
    parameters = job.parameters or ASSUMED_PARAMETERS
    # Without the headers' count, a model shaped like the assumed one.
    matmuls = job.matmuls or max(1, round(ASSUMED_MATMULS * parameters / ASSUMED_PARAMETERS))
    step = _step(calib, dtype, batch, parameters, matmuls)
    if step is None:
        return None
    prompt_tokens, new_tokens = _tokens(job)
    steps = max(new_tokens - 1, 0)  # the prompt's forward makes the first new token
    row = _per_parameter(calib, "prompt")
    speed = 1.0 if dtype == "float32" else calib.speed(dtype, "prompt")
    prompt = 0.0 if row is None or speed is None else batch * prompt_tokens * row * parameters / speed
    plain = prompt + steps * step.seconds
    packed = _packed_step(calib, dtype, batch, parameters, step) if packing else None
    if packed is not None:
        per_token = prompt / prompt_tokens if prompt_tokens else 0.0
        packed_prompt = prompt / _packed_prompt_gain(calib, dtype)
        plan = PackingPlan(
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


def _prompt(calib: Calibration, dtype: str) -> str:
    speed = calib.speed(dtype, "prompt")
    return "" if speed is None else f", prompt {speed:.2f}x"


def _sized(calib: Calibration, job: Job) -> str:
    llc = calib.memory.get("llc")
    cache = f", last-level cache {llc / 1024**2:.0f} MiB" if llc else ""
    if job.parameters is None:
        return f"model size unknown (pass model=): {ASSUMED_PARAMETERS / 1e9:.0f}B parameters assumed{cache}"
    calls = f" in {job.matmuls} matmuls" if job.matmuls else ""
    megabytes = job.parameters * 2 / 1024**2
    return f"{job.parameters / 1e6:.0f}M parameters read per step{calls}, {megabytes:.0f} MiB in bf16{cache}"


def measured_dtype(
    calib: Calibration, job: Job, candidates: tuple[str, ...], default: str = "float32"
) -> MeasuredChoice:
    """The fastest of fp32 and ``candidates`` for ``job`` by ``calib``, keeping ``default`` unless
    another is estimated ``MARGIN`` faster, with the sentence that quotes why."""
    assumed = [_sized(calib, job)]
    if job.batch_size is None:
        assumed.append("batch 1 assumed (pass batch_size=)")
    if job.max_length is None:
        assumed.append(f"{DEFAULT_LENGTH} tokens assumed (pass max_length=)")
    job_text = f" ({'; '.join(assumed)})"
    estimates = {d: e for d in ("float32", *candidates) if (e := estimate_seconds(calib, d, job)) is not None}
    if len(estimates) < 2:
        return MeasuredChoice("float32", f"measured: no half precision timed on this CPU{job_text}")
    # Every dtype's estimate is quoted against fp32 as torch runs it, unpacked.
    fp32 = plain[0] if (plain := estimate_seconds(calib, "float32", job, packing=False)) else estimates["float32"][0]
    tokens = f"{job.batch_size or 1} x {job.max_length or DEFAULT_LENGTH} tokens"
    quoted = [
        f"{short_name(d)} {step.figure}{_prompt(calib, d)}: {fp32 / seconds:.2f}x fp32 estimated for {tokens}"
        for d, (seconds, step) in estimates.items()
        if d != "float32" or "packed ahead" in step.figure
    ]
    default = default if default in estimates else "float32"
    best = min(estimates, key=lambda d: estimates[d][0])
    gain = estimates[default][0] / estimates[best][0]
    if best == default or gain < MARGIN:
        kept = f"the checkpoint's {short_name(default)} kept" if default != "float32" else "fp32 is exact"
        verdict = f"no other dtype estimated {MARGIN:.2f}x faster, {kept}"
        best = default
    else:
        verdict = f"{short_name(best)}: estimated {gain:.2f}x as fast as {short_name(default)}, the default"
    chosen = estimates[best][1]
    why = f"measured, {'; '.join(quoted)}; {verdict}{job_text}"
    if chosen.packed:
        why += f"; {short_name(best)} weights packed ahead: {chosen.figure.rpartition(', ')[2]}"
        if job.max_new_tokens is None:
            # A guessed count decided wrongly both ways (capped CPU, 9 of 41 tokens new: 0.85x of the
            # best with 21 counted, 1.00x told), so generate decides by each call's own count.
            of = "max_length" if job.max_length else f"the {DEFAULT_LENGTH} tokens assumed"
            why += (
                f", counted against {_tokens(job)[1]} new tokens, half of {of}: packed at the first generate() "
                "call whose own tokens repay it (pass max_new_tokens= to have prepare() pack)"
            )
    return MeasuredChoice(best, why, chosen.single_row, chosen.plan if chosen.packed else None)


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
