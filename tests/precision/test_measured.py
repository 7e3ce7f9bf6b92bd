"""The CPU's measured dtype for real model sizes: the model's size picks the regime (weights in the
cache or streamed from memory), and the checkpoint's own half precision is the default a figure must
beat by MARGIN. The estimate's own rules (per-call costs, the GEMV kernel, packing) are in
test_estimate.py; what a resolution hands over from it, in tests/tuning/test_decide.py.

Figures are pinned through ``simulate("cpu,calib=...")``: no test here depends on this machine's speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import whichdevice as wd
from epyc_figures import BILLION, EPYC, FP32, MEMORY
from tiny_models import save_tiny_llama
from whichdevice.core.job import Job
from whichdevice.measure.calibration import parse_figures
from whichdevice.measure.estimate import ASSUMED_PARAMETERS, MARGIN
from whichdevice.model.step_weights import StepWeights
from whichdevice.precision.measured import measured_dtype
from whichdevice.testing import simulate

# A CPU where bf16 wins from the cache but loses once weights stream (its kernel reads them twice).
CACHE_ONLY = f"bf16.b1:1.6/bf16.b2:1.6/bf16.b4:1.6/bf16.b8:1.6/bf16.prompt:1.6/bf16.s1:0.6/bf16.s4:0.6/{FP32}/{MEMORY}"


def _line(res: wd.Resolution, topic: str) -> str:
    return " | ".join(s.message for s in res.trace if s.topic == topic)


def test_the_models_size_picks_between_the_cache_and_the_memory_figures():
    calib = parse_figures(CACHE_ONLY)
    job = Job(batch_size=1, max_length=64)
    small, large = StepWeights(2_000_000), StepWeights(400_000_000)  # 4 MiB in bf16: in the 32 MiB cache; 800 MiB
    assert measured_dtype(calib, job, ("bfloat16",), weights=small).dtype == "bfloat16"
    big = measured_dtype(calib, job, ("bfloat16",), weights=large)
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
    told = Job(batch_size=1, max_length=64, max_new_tokens=32)
    choice = measured_dtype(calib, told, ("bfloat16",), "bfloat16", BILLION)
    assert choice.dtype == kept
    if kept == "float32":  # the upcast is justified by its figure
        assert "fp32, the default" not in choice.why and "as fast as bf16, the default" in choice.why
    else:
        assert f"no other dtype estimated {MARGIN:.2f}x faster, the checkpoint's bf16 kept" in choice.why


def test_near_a_tie_the_default_wins_from_either_side():
    # bf16 3% faster: an fp32 checkpoint stays fp32 and a bf16 one stays bf16, whichever run measured it.
    figures = "/".join(f"bf16.{s}:1.03" for s in ("b1", "b2", "b4", "b8", "prompt", "s1", "s4"))
    calib = parse_figures(f"{figures}/{FP32}/{MEMORY}")
    for job in (Job(batch_size=4, max_length=64, max_new_tokens=32), Job(batch_size=4, max_length=64)):
        assert measured_dtype(calib, job, ("bfloat16",), "float32", BILLION).dtype == "float32"
        assert measured_dtype(calib, job, ("bfloat16",), "bfloat16", BILLION).dtype == "bfloat16"


def test_a_resolution_counts_the_checkpoints_matmuls_from_its_headers(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    # Every linear layer a decode step runs, the lm_head included (tests/model/test_size.py counts the weights).
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC}"):
        res = wd.resolve_device(model=path, batch_size=1, max_length=64)
    assert f"parameters read per step in {len(linears)} matmuls" in _line(res, "dtype")


# An AVX2-only EPYC (no AVX-512, no native bf16; issue 48's figures): bf16 decode reads half the bytes
# and runs 1.7x fp32 with the weights streamed, but its prompt (emulated arithmetic) runs at 0.17x.
AVX2 = f"bf16.b1:0.6/bf16.b2:0.3/bf16.b4:0.2/bf16.b8:0.18/bf16.prompt:0.17/bf16.s1:1.7/bf16.s4:0.9/{FP32}/{MEMORY}"


@pytest.mark.parametrize(
    ("new", "expected"),
    [(16, "float32"), (256, "bfloat16"), (None, "float32")],
    ids=["prompt-heavy 64+16", "decode-heavy 8+256", "split not told"],
)
def test_the_split_told_decides_and_an_untold_one_takes_the_least_worst_case(new, expected):
    """issue 48: with max_length=80 and nothing said of the new tokens, half of them were assumed new,
    which made bf16 win on a CPU whose bf16 prompt is 6x slower; a 64 + 16 job then ran 0.44-0.75x the
    best. Untold, the dtype is the one whose worst split loses least."""
    calib = parse_figures(AVX2)
    length = 80 if new in (16, None) else 264
    job = Job(batch_size=1, max_length=length, max_new_tokens=new)
    choice = measured_dtype(calib, job, ("bfloat16",), "float32", StepWeights(800_000_000, 169))
    assert choice.dtype == expected
    if new is None:
        assert "how the 80 tokens split into prompt and new tokens was not told (pass max_new_tokens=" in choice.why
        assert "from a pure prompt (79 + 1) to a pure decode (1 + 79)" in choice.why
        assert "bf16 at most " in choice.why and "x for a pure decode" in choice.why
    else:
        assert "was not told" not in choice.why


def test_an_untold_split_on_a_cpu_whose_bf16_wins_everywhere_keeps_bf16():
    calib = parse_figures(EPYC)
    job = Job(batch_size=1, max_length=256)
    choice = measured_dtype(calib, job, ("bfloat16",), "float32", BILLION)
    assert choice.dtype == "bfloat16" and "its worst case" in choice.why and "smaller than fp32's" in choice.why
