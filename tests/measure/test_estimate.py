"""The CPU's estimate of a job (measure.estimate): each path's cost per call and per weight from the
two timed sets, torch's GEMV kernel at one row by its own figure, and packed weights where the job's
tokens repay the packing. Figures are pinned: no test here depends on this machine's speed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import pytest

from epyc_figures import BILLION, EPYC
from whichdevice.core.job import Job
from whichdevice.measure.calibration import Calibration, parse_figures
from whichdevice.measure.estimate import MARGIN, _per_call, estimate_seconds
from whichdevice.measure.packing_plan import PackingPlan
from whichdevice.model.step_weights import StepWeights
from whichdevice.precision.measured import measured_dtype


class _Chosen(NamedTuple):
    dtype: str
    why: str
    single_row: bool
    packing: PackingPlan | None

    @property
    def packed(self) -> bool:
        return self.packing is not None


def _chosen(
    calib: Calibration, job: Job, candidates: tuple[str, ...], default: str = "float32", weights: StepWeights = BILLION
) -> _Chosen:
    """The measured dtype, and what the estimate says of its decode steps (what the tuning hands over)."""
    choice = measured_dtype(calib, job, candidates, default, weights)
    estimate = estimate_seconds(calib, choice.dtype, job, weights)
    assert estimate is not None
    return _Chosen(choice.dtype, choice.why, estimate[1].single_row, estimate[1].plan)


def test_the_single_row_kernel_is_chosen_by_its_own_figure_at_batch_one_only():
    calib = parse_figures(EPYC)
    job = Job(batch_size=1, max_length=64)
    one = _chosen(calib, job, ("bfloat16",), "bfloat16")
    assert one.single_row and "3.50x through torch's GEMV kernel" in one.why
    four = _chosen(calib, Job(batch_size=4, max_length=64), ("bfloat16",), "bfloat16")
    assert not four.single_row
    slower = parse_figures(EPYC.replace("bf16.g1:3.5", "bf16.g1:1.9"))  # no gain over oneDNN: not handed over
    assert not _chosen(slower, job, ("bfloat16",), "bfloat16").single_row


def _two_sets(costs: dict[str, tuple[float, float]]) -> Calibration:
    """Figures of a CPU whose one-row step costs (seconds per call, seconds per weight) on each path
    ("float32", "bfloat16", "gemv"): the layer-sized set is 4 matrices, the narrow set 168 of the
    same memory, as cpu_memory times them with a 32 MiB cache."""
    calls, narrow, weights, narrow_weights = 4, 168, 4 * 4096 * 2048, 168 * 256 * 768

    def seconds(path: str, count: int, size: int) -> float:
        return count * costs[path][0] + size * costs[path][1]

    big = {path: seconds(path, calls, weights) for path in costs}
    small = {path: seconds(path, narrow, narrow_weights) for path in costs}
    base = parse_figures(EPYC)
    speeds = dict(base.speeds) | {
        "bf16.s1": big["float32"] / big["bfloat16"],
        "bf16.g1": big["float32"] / big["gemv"],
        "bf16.sn1": small["float32"] / small["bfloat16"],
        "bf16.gn1": small["float32"] / small["gemv"],
    }
    fp32 = dict(base.fp32) | {"s1": big["float32"], "sn1": small["float32"]}
    memory = dict(base.memory) | {
        "stream": float(weights),
        "calls": float(calls),
        "narrow": float(narrow),
        "narrow_stream": float(narrow_weights),
    }
    return Calibration(speeds, fp32, memory)


# Per call and per weight as measured here with oneDNN capped below bf16 (4 December): oneDNN's bf16
# path pays about 40 us a call, torch's GEMV kernel 15 and fp32 20, while per weight the GEMV kernel
# is a little slower than oneDNN. On the layer-sized set alone the GEMV kernel then reads about 1.0x
# oneDNN (the capped calibration read 1.04x and did not hand it over), on a 0.1B Llama 1.75x.
PER_WEIGHT = 2.5e-10
COSTS = {"float32": (20e-6, PER_WEIGHT), "bfloat16": (40e-6, PER_WEIGHT / 3), "gemv": (15e-6, PER_WEIGHT / 2.9)}


def test_the_two_sets_separate_each_paths_cost_per_call_from_its_cost_per_weight():
    calib = _two_sets(COSTS)
    for dtype, shapes, path in [
        ("float32", ("s1", "sn1"), "float32"),
        ("bfloat16", ("s1", "sn1"), "bfloat16"),
        ("bfloat16", ("g1", "gn1"), "gemv"),
    ]:
        call, weight = _per_call(calib, dtype, shapes)
        assert call == pytest.approx(COSTS[path][0], rel=1e-9) and weight == pytest.approx(COSTS[path][1], rel=1e-9)
    # Noise that makes the narrow set cheaper per weight leaves the bytes alone to decide.
    cheap = replace(calib, fp32=dict(calib.fp32) | {"sn1": calib.fp32["s1"] / 2})
    assert _per_call(cheap, "float32", ("s1", "sn1")) == (0.0, cheap.fp32["s1"] / cheap.memory["stream"])
    assert _per_call(parse_figures(EPYC), "bfloat16", ("s1", "sn1")) is None  # no narrow set timed


def test_a_small_models_many_calls_hand_over_the_single_row_kernel_the_large_set_alone_would_not():
    calib = _two_sets(COSTS)
    assert calib.speed("bfloat16", "g1") / calib.speed("bfloat16", "s1") < MARGIN  # the large set alone: no
    job = Job(batch_size=1, max_length=64)
    small = StepWeights(74_900_000, 57)  # a 0.1B Llama, lm_head counted
    large = StepWeights(1_034_000_000, 155)  # a 1.1B Llama
    chosen = _chosen(calib, job, ("bfloat16",), "bfloat16", small)
    assert chosen.single_row and "its matmul calls counted" in chosen.why and "in 57 matmuls" in chosen.why
    assert not _chosen(calib, job, ("bfloat16",), "bfloat16", large).single_row  # bytes dominate there
    without = replace(calib, speeds={k: v for k, v in calib.speeds.items() if not k.endswith("n1")})
    assert not _chosen(without, job, ("bfloat16",), "bfloat16", small).single_row  # the old, large-set estimate


# The same CPU with the batch-4 step also timed with its weights packed ahead (p4) and the packing's rate.
PACKING = f"{EPYC}/bf16.p4:7.0/fp32.p4:0.0076/mem.pack:2"


def test_packing_is_chosen_where_the_jobs_new_tokens_pay_for_it():
    calib = parse_figures(PACKING)
    job = Job(batch_size=4, max_length=1024, max_new_tokens=768)
    long = _chosen(calib, job, ("bfloat16",), "bfloat16")
    assert long.dtype == "bfloat16" and long.packed
    assert "7.00x with its weights packed ahead (packing about 4 s once)" in long.why
    short = replace(job, max_length=64, max_new_tokens=32)
    assert not _chosen(calib, short, ("bfloat16",), "bfloat16").packed
    assert "not paid back by 32 new tokens" in _chosen(calib, short, ("bfloat16",), "bfloat16").why


def test_the_new_tokens_told_decide_the_packing_and_unsaid_are_half_of_max_length():
    # The same 1024 tokens: 768 of them new pay for the packing, 128 do not; unsaid, half are
    # counted, and the line says so and what to pass.
    calib = parse_figures(PACKING)
    job = Job(batch_size=4, max_length=1024)
    assert _chosen(calib, replace(job, max_new_tokens=768), ("bfloat16",), "bfloat16").packed
    few = _chosen(calib, replace(job, max_new_tokens=128), ("bfloat16",), "bfloat16")
    assert not few.packed and "not paid back by 128 new tokens, " in few.why
    guessed = _chosen(calib, job, ("bfloat16",), "bfloat16")
    assert guessed.packed  # 512 new pay for it too, and the line says the count was a guess
    assert guessed.why.endswith(
        "counted against 512 new tokens, half of max_length: packed at the first generate() call whose own "
        "tokens repay it (pass max_new_tokens= to have prepare() pack)"
    )
    assert guessed.packing is not None and not guessed.packing.told and guessed.packing.new_tokens == 512
    told = _chosen(calib, replace(job, max_new_tokens=512), ("bfloat16",), "bfloat16")
    assert told.packed and "max_new_tokens" not in told.why
    assumed = _chosen(calib, replace(job, max_length=None), ("bfloat16",), "bfloat16")  # 128 new pay for it
    assert assumed.packed and "half of the 256 tokens assumed: packed at the first generate() call" in assumed.why
    unsaid = _chosen(calib, replace(job, max_length=128), ("bfloat16",), "bfloat16")
    assert not unsaid.packed and "64 new tokens (half of max_length; pass max_new_tokens=)" in unsaid.why


def test_packing_needs_its_figures_and_two_rows():
    job = Job(batch_size=4, max_length=1024, max_new_tokens=768)
    assert not _chosen(parse_figures(EPYC), job, ("bfloat16",), "bfloat16").packed  # not timed packed
    no_rate = parse_figures(PACKING.replace("/mem.pack:2", ""))
    assert not _chosen(no_rate, job, ("bfloat16",), "bfloat16").packed
    one = _chosen(parse_figures(PACKING), Job(batch_size=1, max_length=1024), ("bfloat16",))
    assert not one.packed and one.single_row
    slower = parse_figures(PACKING.replace("bf16.p4:7.0", "bf16.p4:4.9"))  # under MARGIN over the plain 4.8x
    assert not _chosen(slower, job, ("bfloat16",), "bfloat16").packed


def test_fp32_packed_is_quoted_against_fp32_as_torch_runs_it():
    # A CPU without a fast bf16: fp32 with packed weights wins, and its line says how much over plain fp32.
    figures = PACKING.replace("bf16.s4:4.8", "bf16.s4:1.2").replace("bf16.p4:7.0", "bf16.p4:1.3")
    job = Job(batch_size=4, max_length=1024, max_new_tokens=768)
    choice = _chosen(parse_figures(figures), job, ("bfloat16",))
    assert choice.dtype == "float32" and choice.packed
    fp32_line = next(part for part in choice.why.split("; ") if part.startswith("measured, fp32"))
    assert "3.29x with its weights packed ahead" in fp32_line
    ratio = float(fp32_line.rsplit(": ", 1)[1].split("x")[0])
    assert 2.0 < ratio < 3.29  # the packing and the prompt are counted in the whole job's estimate


def test_a_prompt_that_runs_faster_packed_counts_toward_the_packing():
    # The fp32 CPU above, its prompt timed packed at 1.4x (this machine's fp32 measured 1.3-1.45x):
    # fewer new tokens after a 512-token prompt repay the packing, and the plan carries the figure.
    figures = PACKING.replace("bf16.s4:4.8", "bf16.s4:1.2").replace("bf16.p4:7.0", "bf16.p4:1.3")

    def fewest(spec: str) -> tuple[int, Any]:
        calib = parse_figures(spec)
        for new in range(2, 4000):
            job = Job(batch_size=4, max_length=512 + new, max_new_tokens=new)
            choice = _chosen(calib, job, ("bfloat16",))
            if choice.packed:
                return new, choice.packing
        raise AssertionError("never packed")

    plain, plan = fewest(figures)
    faster, packed_plan = fewest(f"{figures}/fp32.pp:{0.00009 / 1.4}")
    assert faster < plain and plan.packed_prompt_token_s == plan.prompt_token_s
    assert packed_plan.packed_prompt_token_s == pytest.approx(packed_plan.prompt_token_s / 1.4)


def test_a_bf16_prompt_computed_in_fp32_from_the_weights_where_bf16_arithmetic_is_slow():
    from epyc_figures import AVX2
    from whichdevice.measure.estimate import upcast_rows

    capped, without = parse_figures(AVX2), parse_figures(AVX2.replace("bf16.up:0.93/", ""))
    # The crossover: where the copy (the prompt figure's, or the streamed copy's rate, the larger) equals the
    # arithmetic saved, bf16's streamed step and fp32's bounding the few-row forwards from below.
    assert upcast_rows(capped) == 12
    assert upcast_rows(without) is None and upcast_rows(parse_figures(EPYC)) is None  # not timed; bf16 fast
    assert upcast_rows(parse_figures(AVX2.replace("bf16.up:0.93", "bf16.up:0.29"))) is None  # not MARGIN faster
    prompt_heavy = Job(batch_size=1, max_length=528, max_new_tokens=16)
    decode_heavy = Job(batch_size=1, max_length=264, max_new_tokens=256)
    for job in (prompt_heavy, decode_heavy, Job(batch_size=1, max_length=264)):
        assert _chosen(capped, job, ("bfloat16",)).dtype == "bfloat16"
    # Without the figure, the prompt-heavy and the unstated jobs load fp32 (the least worst over the splits).
    assert _chosen(without, prompt_heavy, ("bfloat16",)).dtype == "float32"
    assert _chosen(without, Job(batch_size=1, max_length=264), ("bfloat16",)).dtype == "float32"
    fp32 = estimate_seconds(capped, "float32", prompt_heavy, BILLION)
    bf16, plain = (
        estimate_seconds(capped, "bfloat16", prompt_heavy, BILLION),
        estimate_seconds(without, "bfloat16", prompt_heavy, BILLION),
    )
    assert fp32 is not None and bf16 is not None and plain is not None
    assert bf16[0] < plain[0] / 3  # the prompt at fp32's rate and the copy, not bf16's 0.28x
    # A prompt of 12 rows or fewer runs bf16: priced as without the figure.
    short = Job(batch_size=1, max_length=20, max_new_tokens=12)
    assert estimate_seconds(capped, "bfloat16", short, BILLION) == estimate_seconds(without, "bfloat16", short, BILLION)
