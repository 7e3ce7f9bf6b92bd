"""What a resolution hands over from the CPU's estimate: the single-row switch and packed weights, for the
dtype that loads, only for inference whole on the CPU, each with its trace line (tuning.decide)."""

from __future__ import annotations

from pathlib import Path

import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.testing import simulate

MEMORY = "mem.llc:33554432/mem.cache:4194304/mem.stream:33554432/mem.read:30"
FP32 = "fp32.b1:0.0011/fp32.b2:0.0012/fp32.b4:0.0016/fp32.b8:0.002/fp32.prompt:0.00009/fp32.s1:0.0085/fp32.s4:0.025"
EPYC = (
    "bf16.b1:1.3/bf16.b2:3.0/bf16.b4:2.8/bf16.b8:2.4/bf16.prompt:2.5/bf16.s1:1.9/bf16.s4:4.8/bf16.g1:3.5/"
    f"bf16.attention:3.0/{FP32}/{MEMORY}"
)
# The same CPU with the batch-4 step also timed with its weights packed ahead (p4) and the packing's rate.
PACKING = f"{EPYC}/bf16.p4:7.0/fp32.p4:0.0076/mem.pack:2"


def _line(res: wd.Resolution, topic: str) -> str:
    return " | ".join(s.message for s in res.trace if s.topic == topic)


def _single_row(res: wd.Resolution) -> bool:
    return res.tuning is not None and res.tuning.single_row


def _no_cpu_tuning(res: wd.Resolution) -> bool:
    """Neither CPU tuning of the estimate (the decode attention is decided with the attention, apart)."""
    return res.tuning is None or not (res.tuning.single_row or res.tuning.packing)


def _packed_for(res: wd.Resolution) -> int | None:
    return res.tuning.packed_for_batch if res.tuning is not None else None


def test_a_resolution_for_a_bf16_model_hands_over_the_single_row_setting(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    # A 1 KiB cache, so that the tiny model's weights stream from memory as a real model's do.
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC.replace('mem.llc:33554432', 'mem.llc:1024')}"):
        one = wd.resolve_device(model=path, batch_size=1, max_length=64)
        four = wd.resolve_device(model=path, batch_size=4, max_length=64)
        training = wd.resolve_device(model=path, task="training")
    assert one.dtype_name == "bfloat16" and _single_row(one)
    assert "oneDNN off" in _line(one, "generation") and one.to_dict()["tuning"]["single_row"] is True
    assert not _single_row(four) and _line(four, "generation") == "" and _packed_for(four) is None
    # What is left of the record is the decode attention, decided with the attention (tuning.decode_attention).
    assert _no_cpu_tuning(four) and training.tuning is None


def test_a_resolution_that_does_not_load_bf16_never_hands_it_over(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.float32, tokenizer=False)
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC}"):
        asked = wd.resolve_device(model=path, batch_size=1, max_length=64, dtype="float32")
    assert asked.dtype_name == "float32" and not _single_row(asked)


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
        fp16 = wd.resolve_device(model=path, batch_size=4, max_length=1024, max_new_tokens=768, dtype="float16")
    assert four.tuning is not None and four.tuning.packed_for_batch == 4
    assert four.to_dict()["tuning"]["packed_for_batch"] == 4
    assert "packs the bf16 linear weights in oneDNN's layout for batch 4" in _line(four, "generation")
    limit = f"if its own rate prices the whole copy past {four.tuning.packing_budget_s:.2g} s"
    assert f"(the layers packed by then kept) {limit}" in _line(four, "generation")
    assert _packed_for(short) is None and "not paid back by 32 new tokens" in _line(short, "dtype")
    assert _packed_for(unsaid) is None and "(half of max_length; pass max_new_tokens=)" in _line(unsaid, "dtype")
    assert _packed_for(one) is None and training.tuning is None
    assert _packed_for(fp16) is None  # fp16 weights are not packed (oneDNN packs fp32 and bf16)


def test_an_explicit_bf16_gets_the_tunings_its_estimate_measured(tmp_path: Path):
    """The tunings follow the dtype that loads, asked for or measured, as long as the estimate could be made."""
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.float32, tokenizer=False)
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC.replace('mem.llc:33554432', 'mem.llc:1024')}"):
        asked = wd.resolve_device(model=path, batch_size=1, max_length=64, dtype="bfloat16")
    assert asked.dtype_name == "bfloat16" and _single_row(asked)


def test_a_placement_off_the_cpu_or_a_quantized_load_gets_no_cpu_tuning(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    spec = f"cpu,flags=avx512_bf16,calib={PACKING.replace('mem.llc:33554432', 'mem.llc:1024')}"
    with simulate(spec):
        mapped = wd.resolve_device(model=path, batch_size=1, max_length=64, device_map={"": "cpu"})
        quantized = wd.resolve_device(model=path, batch_size=4, max_length=1024, max_new_tokens=768, quantize="8bit")
    assert _no_cpu_tuning(mapped) and _no_cpu_tuning(quantized)


def test_an_unsteady_figure_the_job_needs_leaves_the_flags_and_no_tuning(tmp_path: Path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    lost = EPYC.replace("mem.llc:33554432", "mem.llc:1024") + "/lost:s1"
    with simulate(f"cpu,flags=avx512_bf16,calib={lost}"):
        one = wd.resolve_device(model=path, batch_size=1, max_length=64)
    assert _no_cpu_tuning(one) and "could not be timed steadily" in _line(one, "calibration")
