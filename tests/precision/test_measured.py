"""The CPU's measured dtype for real model sizes: the model's size picks the regime (weights in the
cache or streamed from memory), the checkpoint's own half precision is the default a figure must
beat by MARGIN, and the single-row GEMV setting follows its own figure.

Figures are pinned through ``simulate("cpu,calib=...")``: no test here depends on this machine's speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.core.job import Job
from whichdevice.hardware.calibration import parse_figures
from whichdevice.precision.measured import ASSUMED_PARAMETERS, MARGIN, measured_dtype
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
    long = measured_dtype(calib, Job(batch_size=4, max_length=1024, parameters=10**9), ("bfloat16",), "bfloat16")
    assert long.dtype == "bfloat16" and long.packed
    assert "7.00x with its weights packed ahead (packing about 4 s once)" in long.why
    short = measured_dtype(calib, Job(batch_size=4, max_length=64, parameters=10**9), ("bfloat16",), "bfloat16")
    assert short.dtype == "bfloat16" and not short.packed and "not paid back by 32 new tokens" in short.why


def test_packing_needs_its_figures_and_two_rows():
    job = Job(batch_size=4, max_length=1024, parameters=10**9)
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
    choice = measured_dtype(parse_figures(figures), Job(batch_size=4, max_length=1024, parameters=10**9), ("bfloat16",))
    assert choice.dtype == "float32" and choice.packed
    fp32_line = next(part for part in choice.why.split("; ") if part.startswith("measured, fp32"))
    assert "3.29x with its weights packed ahead" in fp32_line
    ratio = float(fp32_line.rsplit(": ", 1)[1].split("x")[0])
    assert 2.0 < ratio < 3.29  # the packing and the prompt are counted in the whole job's estimate


def test_a_resolution_hands_over_the_packing_with_its_batch(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    spec = PACKING.replace("mem.llc:33554432", "mem.llc:1024")
    with simulate(f"cpu,flags=avx512_bf16,calib={spec}"):
        # Packing costs per weight as a step does: about 80 new tokens pay for it here, whatever the size.
        four = wd.resolve_device(model=path, batch_size=4, max_length=1024)
        short = wd.resolve_device(model=path, batch_size=4, max_length=64)
        one = wd.resolve_device(model=path, batch_size=1, max_length=64)
        training = wd.resolve_device(model=path, task="training", batch_size=4)
        quantized = wd.resolve_device(model=path, batch_size=4, max_length=64, dtype="float16")
    assert four.packed_for_batch == 4 and four.to_dict()["packed_for_batch"] == 4
    assert "packs the bf16 linear weights ahead in oneDNN's layout for batch 4" in _line(four, "generation")
    assert short.packed_for_batch is None and "not paid back by 32 new tokens" in _line(short, "dtype")
    assert one.packed_for_batch is None and training.packed_for_batch is None
    assert quantized.packed_for_batch is None  # an explicit dtype is not the measured choice
