"""The CPU's measured dtype for real model sizes: the model's size picks the regime (weights in the
cache or streamed from memory), the checkpoint's own half precision is the default a figure must
beat by MARGIN, and the single-row GEMV setting follows its own figure.

Figures are pinned through ``simulate("cpu,calib=...")``: no test here depends on this machine's speed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.core.job import Job
from whichdevice.hardware.calibration import Calibration, parse_figures
from whichdevice.precision.measured import ASSUMED_PARAMETERS, MARGIN, _per_call, measured_dtype
from whichdevice.testing import simulate

# Measured on this project's AMD EPYC (avx512_bf16, 2 cores): bf16 wins everywhere, most when the
# weights stream from memory, and torch's own GEMV kernel beats oneDNN's at one row.
MEMORY = "mem.llc:33554432/mem.cache:4194304/mem.stream:33554432/mem.read:30"
FP32 = "fp32.b1:0.0011/fp32.b2:0.0012/fp32.b4:0.0016/fp32.b8:0.002/fp32.prompt:0.00009/fp32.s1:0.0085/fp32.s4:0.025"
EPYC = (
    "bf16.b1:1.3/bf16.b2:3.0/bf16.b4:2.8/bf16.b8:2.4/bf16.prompt:2.5/bf16.s1:1.9/bf16.s4:4.8/bf16.g1:3.5/"
    f"bf16.attention:3.0/{FP32}/{MEMORY}"
)
# A CPU where bf16 wins from the cache but loses once weights stream (its kernel reads them twice).
CACHE_ONLY = f"bf16.b1:1.6/bf16.b2:1.6/bf16.b4:1.6/bf16.b8:1.6/bf16.prompt:1.6/bf16.s1:0.6/bf16.s4:0.6/{FP32}/{MEMORY}"


def _line(res: wd.Resolution, topic: str) -> str:
    return " | ".join(s.message for s in res.trace if s.topic == topic)


def test_the_models_size_picks_between_the_cache_and_the_memory_figures():
    calib = parse_figures(CACHE_ONLY)
    small = Job(batch_size=1, max_length=64, parameters=2_000_000)  # 4 MiB in bf16: in the 32 MiB cache
    large = Job(batch_size=1, max_length=64, parameters=400_000_000)  # 800 MiB: streamed
    assert measured_dtype(calib, small, ("bfloat16",)).dtype == "bfloat16"
    big = measured_dtype(calib, large, ("bfloat16",))
    assert big.dtype == "float32" and "weights streamed from memory" in big.why
    assert "400M parameters read per step" in big.why


def test_without_a_model_the_assumed_size_is_said_and_used():
    calib = parse_figures(CACHE_ONLY)
    choice = measured_dtype(calib, Job(batch_size=1, max_length=64), ("bfloat16",))
    assert f"{ASSUMED_PARAMETERS / 1e9:.0f}B parameters assumed" in choice.why
    assert choice.dtype == "float32"  # 1B parameters stream from memory, where bf16 loses on this CPU


@pytest.mark.parametrize("fp32_speed, kept", [(1 / 1.03, "bfloat16"), (1 / 1.5, "float32")])
def test_a_bf16_checkpoint_keeps_its_dtype_unless_fp32_is_measured_faster_by_the_margin(fp32_speed, kept):
    figures = "/".join(f"bf16.{s}:{fp32_speed:.4f}" for s in ("b1", "b2", "b4", "b8", "prompt", "s1", "s4"))
    calib = parse_figures(f"{figures}/{FP32}/{MEMORY}")
    choice = measured_dtype(calib, Job(batch_size=1, max_length=64, parameters=10**9), ("bfloat16",), "bfloat16")
    assert choice.dtype == kept
    if kept == "float32":  # the upcast is justified by its figure
        assert "fp32, the default" not in choice.why and "as fast as bf16, the default" in choice.why
    else:
        assert f"no other dtype estimated {MARGIN:.2f}x faster, the checkpoint's bf16 kept" in choice.why


def test_near_a_tie_the_default_wins_from_either_side():
    # bf16 3% faster: an fp32 checkpoint stays fp32 and a bf16 one stays bf16, whichever run measured it.
    figures = "/".join(f"bf16.{s}:1.03" for s in ("b1", "b2", "b4", "b8", "prompt", "s1", "s4"))
    calib = parse_figures(f"{figures}/{FP32}/{MEMORY}")
    job = Job(batch_size=4, max_length=64, parameters=10**9)
    assert measured_dtype(calib, job, ("bfloat16",), "float32").dtype == "float32"
    assert measured_dtype(calib, job, ("bfloat16",), "bfloat16").dtype == "bfloat16"


def test_the_single_row_kernel_is_chosen_by_its_own_figure_at_batch_one_only():
    calib = parse_figures(EPYC)
    job = Job(batch_size=1, max_length=64, parameters=10**9)
    one = measured_dtype(calib, job, ("bfloat16",), "bfloat16")
    assert one.single_row and "3.50x through torch's GEMV kernel" in one.why
    four = measured_dtype(calib, Job(batch_size=4, max_length=64, parameters=10**9), ("bfloat16",), "bfloat16")
    assert not four.single_row
    slower = parse_figures(EPYC.replace("bf16.g1:3.5", "bf16.g1:1.9"))  # no gain over oneDNN: not handed over
    assert not measured_dtype(slower, job, ("bfloat16",), "bfloat16").single_row


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
    small = Job(batch_size=1, max_length=64, parameters=74_900_000, matmuls=57)  # a 0.1B Llama, lm_head counted
    large = Job(batch_size=1, max_length=64, parameters=1_034_000_000, matmuls=155)  # a 1.1B Llama
    chosen = measured_dtype(calib, small, ("bfloat16",), "bfloat16")
    assert chosen.single_row and "its matmul calls counted" in chosen.why and "in 57 matmuls" in chosen.why
    assert not measured_dtype(calib, large, ("bfloat16",), "bfloat16").single_row  # bytes dominate there
    without = replace(calib, speeds={k: v for k, v in calib.speeds.items() if not k.endswith("n1")})
    assert not measured_dtype(without, small, ("bfloat16",), "bfloat16").single_row  # the old, large-set estimate


def test_a_resolution_counts_the_checkpoints_matmuls_from_its_headers(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    # Every linear layer a decode step runs, the lm_head included (tests/model/test_size.py counts the weights).
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC}"):
        res = wd.resolve_device(model=path, batch_size=1, max_length=64)
    assert f"parameters read per step in {len(linears)} matmuls" in _line(res, "dtype")


def test_a_resolution_for_a_bf16_model_hands_over_the_single_row_setting(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    # A 1 KiB cache, so that the tiny model's weights stream from memory as a real model's do.
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC.replace('mem.llc:33554432', 'mem.llc:1024')}"):
        one = wd.resolve_device(model=path, batch_size=1, max_length=64)
        four = wd.resolve_device(model=path, batch_size=4, max_length=64)
        training = wd.resolve_device(model=path, task="training")
    assert one.dtype_name == "bfloat16" and one.single_row
    assert "oneDNN off" in _line(one, "generation") and one.to_dict()["single_row"] is True
    assert not four.single_row and _line(four, "generation") == ""
    assert not training.single_row


def test_a_resolution_that_does_not_load_bf16_never_hands_it_over(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.float32, tokenizer=False)
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC}"):
        asked = wd.resolve_device(model=path, batch_size=1, max_length=64, dtype="float32")
    assert asked.dtype_name == "float32" and not asked.single_row


# The same CPU with the batch-4 step also timed with its weights packed ahead (p4) and the packing's rate.
PACKING = f"{EPYC}/bf16.p4:7.0/fp32.p4:0.0076/mem.pack:2"


def test_packing_is_chosen_where_the_jobs_new_tokens_pay_for_it():
    calib = parse_figures(PACKING)
    job = Job(batch_size=4, max_length=1024, parameters=10**9, max_new_tokens=768)
    long = measured_dtype(calib, job, ("bfloat16",), "bfloat16")
    assert long.dtype == "bfloat16" and long.packed
    assert "7.00x with its weights packed ahead (packing about 4 s once)" in long.why
    short = replace(job, max_length=64, max_new_tokens=32)
    assert not measured_dtype(calib, short, ("bfloat16",), "bfloat16").packed
    assert "not paid back by 32 new tokens" in measured_dtype(calib, short, ("bfloat16",), "bfloat16").why


def test_the_new_tokens_told_decide_the_packing_and_unsaid_are_half_of_max_length():
    # The same 1024 tokens: 768 of them new pay for the packing, 128 do not; unsaid, half are
    # counted, and the line says so and what to pass.
    calib = parse_figures(PACKING)
    job = Job(batch_size=4, max_length=1024, parameters=10**9)
    assert measured_dtype(calib, replace(job, max_new_tokens=768), ("bfloat16",), "bfloat16").packed
    few = measured_dtype(calib, replace(job, max_new_tokens=128), ("bfloat16",), "bfloat16")
    assert not few.packed and "not paid back by 128 new tokens, " in few.why
    guessed = measured_dtype(calib, job, ("bfloat16",), "bfloat16")
    assert guessed.packed  # 512 new pay for it too, and the line says the count was a guess
    assert guessed.why.endswith(
        "counted against 512 new tokens, half of max_length: packed at the first generate() call whose own "
        "tokens repay it (pass max_new_tokens= to have prepare() pack)"
    )
    assert guessed.packing is not None and not guessed.packing.told and guessed.packing.new_tokens == 512
    told = measured_dtype(calib, replace(job, max_new_tokens=512), ("bfloat16",), "bfloat16")
    assert told.packed and "max_new_tokens" not in told.why
    assumed = measured_dtype(calib, replace(job, max_length=None), ("bfloat16",), "bfloat16")  # 128 new pay for it
    assert assumed.packed and "half of the 256 tokens assumed: packed at the first generate() call" in assumed.why
    unsaid = measured_dtype(calib, replace(job, max_length=128), ("bfloat16",), "bfloat16")
    assert not unsaid.packed and "64 new tokens (half of max_length; pass max_new_tokens=)" in unsaid.why


def test_packing_needs_its_figures_and_two_rows():
    job = Job(batch_size=4, max_length=1024, parameters=10**9, max_new_tokens=768)
    assert not measured_dtype(parse_figures(EPYC), job, ("bfloat16",), "bfloat16").packed  # not timed packed
    no_rate = parse_figures(PACKING.replace("/mem.pack:2", ""))
    assert not measured_dtype(no_rate, job, ("bfloat16",), "bfloat16").packed
    one = measured_dtype(parse_figures(PACKING), Job(batch_size=1, max_length=1024, parameters=10**9), ("bfloat16",))
    assert not one.packed and one.single_row
    slower = parse_figures(PACKING.replace("bf16.p4:7.0", "bf16.p4:4.9"))  # under MARGIN over the plain 4.8x
    assert not measured_dtype(slower, job, ("bfloat16",), "bfloat16").packed


def test_fp32_packed_is_quoted_against_fp32_as_torch_runs_it():
    # A CPU without a fast bf16: fp32 with packed weights wins, and its line says how much over plain fp32.
    figures = PACKING.replace("bf16.s4:4.8", "bf16.s4:1.2").replace("bf16.p4:7.0", "bf16.p4:1.3")
    job = Job(batch_size=4, max_length=1024, parameters=10**9, max_new_tokens=768)
    choice = measured_dtype(parse_figures(figures), job, ("bfloat16",))
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
            job = Job(batch_size=4, max_length=512 + new, parameters=10**9, max_new_tokens=new)
            choice = measured_dtype(calib, job, ("bfloat16",))
            if choice.packed:
                return new, choice.packing
        raise AssertionError("never packed")

    plain, plan = fewest(figures)
    faster, packed_plan = fewest(f"{figures}/fp32.pp:{0.00009 / 1.4}")
    assert faster < plain and plan.packed_prompt_token_s == plan.prompt_token_s
    assert packed_plan.packed_prompt_token_s == pytest.approx(packed_plan.prompt_token_s / 1.4)


def test_a_resolution_hands_over_the_packing_with_its_batch(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    spec = PACKING.replace("mem.llc:33554432", "mem.llc:1024")
    with simulate(f"cpu,flags=avx512_bf16,calib={spec}"):
        # Packing costs per weight as a step does: about 80 new tokens pay for it here, whatever the size.
        four = wd.resolve_device(model=path, batch_size=4, max_length=1024, max_new_tokens=768)
        unsaid = wd.resolve_device(model=path, batch_size=4, max_length=64)
        short = wd.resolve_device(model=path, batch_size=4, max_length=64, max_new_tokens=32)
        one = wd.resolve_device(model=path, batch_size=1, max_length=64)
        training = wd.resolve_device(model=path, task="training", batch_size=4)
        quantized = wd.resolve_device(model=path, batch_size=4, max_length=64, dtype="float16")
    assert four.packed_for_batch == 4 and four.to_dict()["packed_for_batch"] == 4
    assert "packs the bf16 linear weights in oneDNN's layout for batch 4" in _line(four, "generation")
    limit = f"if its own rate prices the whole copy past {four.packing_budget_s:.2g} s"
    assert f"(the layers packed by then kept) {limit}" in _line(four, "generation")
    assert short.packed_for_batch is None and "not paid back by 32 new tokens" in _line(short, "dtype")
    assert unsaid.packed_for_batch is None and "(half of max_length; pass max_new_tokens=)" in _line(unsaid, "dtype")
    assert one.packed_for_batch is None and training.packed_for_batch is None
    assert quantized.packed_for_batch is None  # an explicit dtype is not the measured choice
