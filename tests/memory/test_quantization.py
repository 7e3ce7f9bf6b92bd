"""Quantization: when bitsandbytes 4-bit is chosen, on which backends, the numbers, and real loads on this CPU."""

from __future__ import annotations

import ast
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.hardware.registry import backends
from whichdevice.memory import quantization
from whichdevice.testing import simulate

# The tiny Llama (hidden 64, 2 layers, vocab 256): 106,816 parameters, 208.62 KiB in bf16; its
# 73,728 linear weights go to 4-bit, so about 101.8 KiB. A 150 KiB budget needs 4-bit.
SMALL_BUDGET = "150KiB"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", dtype=torch.bfloat16, tokenizer=False)


def _budget(spec: str, size: str = SMALL_BUDGET) -> dict[int | str, str]:
    """max_memory for the simulated device: "cpu"/"mps" keys for those, device indices elsewhere."""
    name = spec.split(",")[0].split(":")[0]
    return {name: size} if name in ("cpu", "mps") else {0: size}


# ----------------------------------------------------------------- scenarios under simulate

# spec -> (device_map, compute dtype) for every backend bitsandbytes supports
SUPPORTED = [
    ("cpu,flags=avx512_bf16", "cpu", "bfloat16"),
    ("cpu,flags=", "cpu", "float32"),  # fp32 compute: the rest of the model stays fp32
    ("cuda:1,cc=8.0", "cuda:0", "bfloat16"),
    ("cuda:1,cc=7.5,name=Tesla T4", "cuda:0", "float16"),
    ("cuda:2,variant=rocm", "cuda:0", "bfloat16"),
    ("xpu:1", "xpu:0", "bfloat16"),
    ("hpu:8,gen=gaudi2", "hpu", "bfloat16"),
    ("hpu:8,gen=gaudi3", "hpu", "bfloat16"),
    ("npu:1", "npu:0", "bfloat16"),
    ("mps", "mps", "bfloat16"),  # macOS 14+: the bf16 checkpoint keeps its dtype (model_precision)
    ("mps,macos=13.6", "mps", "float16"),
]


@pytest.mark.parametrize(("spec", "device_map", "compute"), SUPPORTED, ids=[s[0] for s in SUPPORTED])
def test_too_big_model_gets_4bit_on_every_bitsandbytes_backend(tiny, spec, device_map, compute):
    budget = "200KiB" if compute == "float32" else SMALL_BUDGET
    with simulate(spec):
        res = wd.resolve_device(model=str(tiny), max_memory=_budget(spec, budget))
    plan = res.quantization
    assert plan is not None and plan.bits == 4 and plan.compute_dtype == compute
    assert res.device_map == device_map
    # the numbers: bf16/fp16 is 2 bytes a parameter, fp32 4; 4-bit roughly halves this model
    full = 106_816 * (4 if compute == "float32" else 2)
    assert plan.full_bytes == full
    assert plan.quantized_bytes is not None and plan.quantized_bytes < plan.budget_bytes < full
    assert plan.saved_bytes == full - plan.quantized_bytes
    config = res.model_kwargs()["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == getattr(torch, compute)
    text = res.explain()
    assert "4-bit NF4 with bitsandbytes" in text and "saves" in text and f"{budget[:-3]}.00 KiB usable" in text
    data = json.loads(json.dumps(res.to_dict()))
    assert data["quantization"]["bits"] == 4 and data["quantization"]["method"] == "bitsandbytes-nf4"
    assert data["quantization"]["reason"] == "does-not-fit"


UNSUPPORTED = [
    ("neuron:2", "bitsandbytes does not support neuron"),
    ("tpu:4", "bitsandbytes does not support tpu"),
    ("hpu:8,gen=gaudi1", "Gaudi 2 or newer; this is Gaudi 1"),
    ("mlu:1", "bitsandbytes does not support mlu"),
    ("musa:1", "bitsandbytes does not support musa"),
]


@pytest.mark.parametrize(("spec", "says"), UNSUPPORTED, ids=[s[0] for s in UNSUPPORTED])
def test_too_big_model_on_hardware_bitsandbytes_lacks_says_so(tiny, spec, says):
    with simulate(spec), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=str(tiny), max_memory={0: SMALL_BUDGET})
    message = str(err.value)
    assert says in message and "208.62 KiB" in message and "150.00 KiB usable" in message
    # and asking for it outright is a conflict with the hardware, model or not
    with simulate(spec), pytest.raises(wd.ConfigConflictError, match=says):
        wd.resolve_device(quantize="4bit")


def test_quantize_none_raises_the_fit_error_with_the_numbers(tiny):
    with simulate("cuda:1"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=str(tiny), max_memory={0: SMALL_BUDGET}, quantize=None)
    message = str(err.value)
    assert "208.62 KiB" in message and "150.00 KiB usable" in message
    assert "quantize='auto'" in message and "4-bit" in message
    # where bitsandbytes cannot help, quantize='auto' is not offered as the way out
    with simulate("neuron:2"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=str(tiny), max_memory={0: SMALL_BUDGET}, quantize=None)
    assert "quantize='auto'" not in str(err.value) and "bitsandbytes does not support neuron" in str(err.value)


def test_a_model_that_fits_is_not_quantized(tiny):
    res = wd.resolve_device(model=str(tiny), max_memory={"cpu": "1MiB"})
    assert res.quantization is None and "quantization_config" not in res.model_kwargs()
    assert not any(step.topic == "quantization" for step in res.trace)


def test_even_4bit_too_big_says_the_numbers(tiny):
    with pytest.raises(wd.DoesNotFitError, match=r"in 4-bit.*101\.78 KiB.*Give more memory"):
        wd.resolve_device(model=str(tiny), max_memory={"cpu": "90KiB"}, dtype="bfloat16")


def test_memory_from_the_hardware_when_no_budget_is_given(tiny):
    # 80% of a 200 KiB device is usable: too little for bf16, enough for 4-bit
    with simulate("cuda:1,mem=200KiB"):
        res = wd.resolve_device(model=str(tiny))
    assert res.quantization is not None and res.quantization.budget_bytes == int(200 * 1024 * 0.8)
    assert "160.00 KiB usable: 80% of 200.00 KiB" in res.explain()


def test_4bit_split_over_gpus_when_one_is_too_small(tiny):
    # 4-bit (~102 KiB) fits neither 80 KiB GPU alone, but two (less bitsandbytes' 10%) hold it
    with simulate("cuda:2"):
        res = wd.resolve_device(model=str(tiny), max_memory={0: "80KiB", 1: "80KiB"})
    assert res.quantization is not None and res.quantization.bits == 4
    assert res.device_map == "auto" and set(res.max_memory or {}) == {0, 1}
    assert res.model_kwargs()["max_memory"] == res.max_memory
    assert "split over 2 devices" in res.explain() and "10% of max_memory" in res.explain()


def test_explicit_4bit_and_8bit_quantize_a_model_that_fits(tiny):
    with simulate("cuda:1"):
        four = wd.resolve_device(model=str(tiny), quantize="4bit")
        eight = wd.resolve_device(model=str(tiny), quantize="8bit")
    assert four.quantization is not None and four.quantization.requested and four.quantization.bits == 4
    assert "as you asked" in four.quantization.explanation
    assert eight.quantization is not None and eight.quantization.bits == 8
    assert eight.quantization.quantized_bytes == 73_728 + (106_816 - 73_728) * 2
    assert eight.model_kwargs()["quantization_config"].load_in_8bit
    assert eight.to_dict()["quantization"]["method"] == "bitsandbytes-int8"


def test_explicit_quantize_without_a_model(tiny):
    with simulate("xpu:1"):
        res = wd.resolve_device(quantize="4bit")
    assert res.quantization is not None and res.quantization.full_bytes is None
    assert res.model_kwargs()["quantization_config"].load_in_4bit
    assert json.loads(json.dumps(res.to_dict()))["quantization"]["saved_bytes"] is None
    # with a device_map of the user's own, too
    with simulate("cuda:2"):
        res = wd.resolve_device(quantize="8bit", device_map="auto")
    assert res.device_map == "auto" and res.quantization is not None and res.quantization.bits == 8


@pytest.mark.parametrize("bad", ["3bit", "int4", True, 4])
def test_bad_quantize_values(bad):
    with pytest.raises(wd.DeviceError, match="'auto', '4bit', '8bit' or None"):
        wd.resolve_device(quantize=bad)


def test_bitsandbytes_not_installed(tiny):
    from whichdevice.core.packages import simulated_packages

    with simulated_packages({"bitsandbytes": None}):
        with simulate("cuda:1"), pytest.raises(wd.DoesNotFitError, match="pip install bitsandbytes"):
            wd.resolve_device(model=str(tiny), max_memory={0: SMALL_BUDGET})
        with simulate("cuda:1"), pytest.raises(wd.ConfigConflictError, match="pip install bitsandbytes"):
            wd.resolve_device(quantize="4bit")


def test_training_trace_points_at_lora(tiny):
    # Between QLoRA's 678 KiB and LoRA's 721 KiB for the tiny model (rank-16 adapters are a large share of it).
    res = wd.resolve_device(model=str(tiny), max_memory={"cpu": 700 * 1024}, task="training", dtype="bfloat16")
    assert res.training_setup.train == "qlora" and "lora_training" in res.explain()


def test_registry_matches_bitsandbytes_own_device_list():
    """Backend.bitsandbytes follows bitsandbytes' supported_torch_devices (read without importing it)."""
    spec = find_spec("bitsandbytes")
    if spec is None or spec.origin is None:
        pytest.skip("bitsandbytes is not installed")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "supported_torch_devices" for t in node.targets
        ):
            found = set(ast.literal_eval(node.value))
    assert found == set(quantization.BNB_DEVICES)
    assert {b.name for b in backends() if b.bitsandbytes} == found


# -------------------------------------------------------------------- real loads on this CPU


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_really_loads_quantized_on_cpu_and_the_estimate_holds(tiny, bits, monkeypatch):
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # bitsandbytes looks for a CPU kernel on the Hub
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    # bf16 stated, so the numbers hold on CPUs without native bf16 too (where "auto" picks fp32)
    res = wd.resolve_device(
        "cpu",
        model=str(tiny),
        max_memory={"cpu": SMALL_BUDGET},
        dtype="bfloat16",
        quantize="auto" if bits == 4 else "8bit",
    )
    assert res.quantization is not None and res.quantization.bits == bits
    model = AutoModelForCausalLM.from_pretrained(str(tiny), **res.model_kwargs())
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt)
    assert layer.weight.device.type == "cpu"
    footprint = model.get_memory_footprint()
    estimate = res.quantization.quantized_bytes
    assert estimate is not None and abs(footprint - estimate) / footprint < 0.05, (footprint, estimate)
    assert footprint < 150 * 1024 < res.quantization.full_bytes
    with torch.no_grad():
        logits = model(torch.randint(0, 250, (1, 8))).logits
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits.float()).all()
