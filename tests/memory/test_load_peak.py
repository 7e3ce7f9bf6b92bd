"""The load's own peak: transformers' allocator warm-up, reproduced and held to the installed code, in the fit check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.memory.load_peak import (
    ROUND_LARGE,
    SMALL_SEGMENT,
    SMALL_TENSOR,
    installed_warmup,
    load_peak,
    warmup_bytes,
)
from whichdevice.model.size import size_from_config
from whichdevice.testing import simulate

GiB, MiB = 1024**3, 1024**2


def _config(**extra):
    from transformers import LlamaConfig

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
    return LlamaConfig(**{**shape, "num_key_value_heads": 2, "vocab_size": 32000, **extra})


def _meta(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _everything_on(model, device: str) -> dict[str, str]:
    from transformers.integrations.accelerate import expand_device_map

    return expand_device_map({"": device}, list(model.state_dict().keys()))


# ------------------------------------------------------------------ against the installed transformers


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    ("device", "total"),
    [
        ("cuda:0", 80 * GiB),  # the whole sum fits under the cap
        ("cuda:0", 1 * GiB + 300 * MiB),  # capped at the total less 1.2 GiB
        ("xpu:0", 2 * GiB),
        ("mps", None),  # skipped
        ("hpu", None),  # warmed up in full, uncapped
    ],
)
def test_the_warmup_is_what_the_installed_transformers_allocates(
    tied: bool, dtype: str, device: str, total: int | None
) -> None:
    config = _config(tie_word_embeddings=tied)
    meta = _meta(config, getattr(torch, dtype))
    memory = {device: (total, total)} if total is not None else {}
    theirs = installed_warmup(meta, _everything_on(meta, device), memory).get(device, 0)
    size = size_from_config(config)
    assert warmup_bytes(device.split(":")[0], size.bytes_in(dtype), total) == theirs
    if device.startswith(("cuda", "hpu")) and (total is None or total > 10 * GiB):
        assert theirs == size.bytes_in(dtype)  # the whole weights, tied ones once, in one block


def test_under_1_2_gib_the_installed_warmup_asks_for_a_negative_size() -> None:
    # transformers 5.25 caps the block at the total less 1.2 GiB without a floor: on a smaller device
    # torch.empty gets a negative size and raises, so from_pretrained with a device_map fails there.
    meta = _meta(_config(), torch.bfloat16)
    with pytest.raises(RuntimeError, match="negative dimension"):
        installed_warmup(meta, _everything_on(meta, "cuda:0"), {"cuda:0": (GiB, GiB)})
    assert warmup_bytes("cuda", 10**8, GiB) == 0


@pytest.mark.parametrize("bits", [4, 8])
def test_the_quantized_warmup_is_what_the_installed_transformers_allocates(bits: int) -> None:
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    config = _config()
    meta = _meta(config, torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(BitsAndBytesConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8))
    quantizer.preprocess_model(meta, dtype=torch.bfloat16, device_map={"": "cuda:0"})  # bitsandbytes' layers, on meta
    theirs = installed_warmup(meta, _everything_on(meta, "cuda:0"), {"cuda:0": (80 * GiB, 80 * GiB)}, quantizer)
    ours = load_peak(size_from_config(config), "bfloat16", "cuda:0", None, 80 * GiB, bits=bits, kind="cuda")
    assert ours.warmup == theirs["cuda:0"]


def test_bitsandbytes_element_sizes_are_the_installed_quantizers() -> None:
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer

    # load_peak counts a quantized weight at bits / 8 bytes, as these properties give it to the warm-up
    assert Bnb4BitHfQuantizer.quantized_element_size.fget(None) == 4 / 8  # type: ignore[attr-defined]
    assert Bnb8BitHfQuantizer.quantized_element_size.fget(None) == 8 / 8  # type: ignore[attr-defined]


def test_the_allocator_constants_are_the_installed_torchs() -> None:
    header = Path(torch.__file__).parent / "include" / "c10" / "core" / "AllocatorConfig.h"
    if not header.exists():
        pytest.skip("this torch ships without its C++ headers")
    text = header.read_text()

    def constant(name: str) -> int:
        found = re.search(rf"constexpr size_t {name} = (\d+);", text)
        assert found, f"{name} is not in {header}"
        return int(found.group(1))

    assert constant("kSmallSize") == SMALL_TENSOR
    assert constant("kSmallBuffer") == SMALL_SEGMENT
    assert constant("kRoundLarge") == ROUND_LARGE


# ------------------------------------------------------------------------------------ the formula


def test_a_7b_load_peaks_at_the_weights_and_its_small_tensors() -> None:
    from transformers import LlamaConfig

    size = size_from_config(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32))
    peak = load_peak(size, "bfloat16", "cuda:0", 79 * GiB, 80 * GiB, kind="cuda")
    assert peak.warmup == peak.weights == size.bytes_in("bfloat16")
    assert peak.small == 65 * 4096 * 2  # the RMSNorm weights: 65 tensors of 8 KiB
    assert peak.weights < peak.peak <= peak.weights + 2 * ROUND_LARGE + SMALL_SEGMENT
    assert peak.fits and "fits" in peak.text()
    quantized = load_peak(size, "bfloat16", "cuda:0", 79 * GiB, 80 * GiB, bits=4, kind="cuda")
    assert quantized.transient == 4096 * 11008 * 2  # the largest linear weight in bf16, before it is quantized
    assert quantized.weights < size.bytes_in("bfloat16") / 3


def test_small_tensors_are_reserved_twice_and_a_move_is_not() -> None:
    from tiny_models import tiny_config

    size = size_from_config(tiny_config())  # every tensor is under 1 MiB
    peak = load_peak(size, "float32", "cuda:0", None, 80 * GiB, kind="cuda")
    assert peak.small == peak.weights and peak.warmup == peak.weights
    assert peak.peak == 2 * SMALL_SEGMENT and peak.moved == SMALL_SEGMENT
    assert load_peak(size, "float32", "hpu", None, None, kind="hpu").small == 0  # the small pool is CUDA's and XPU's


# ---------------------------------------------------------------------------------- in the resolver


def test_a_fitting_load_is_said_and_recorded() -> None:
    with simulate("cuda:2,mem=80GiB,free=70GiB/79GiB"):
        res = wd.resolve_device(model=_config(), dtype="bfloat16")
    assert res.load_peak is not None and res.load_peak.device == res.device == "cuda:1"
    assert res.load_peak.free == 79 * GiB and res.load_peak.fits
    line = next(s.message for s in res.trace if s.topic == "load")
    assert "transformers' allocator warm-up reserves" in line and line.endswith("fits")
    assert res.to_dict()["load_peak"]["peak"] == res.load_peak.peak


def test_where_only_the_load_does_not_fit_the_model_is_loaded_on_the_cpu_and_moved(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, pipeline

    path = save_tiny_llama(tmp_path / "tiny")
    # 3 MiB free: the weights (0.2 MB) fit its 80% at rest; the load's block and small segments (4 MiB) do not.
    with simulate("cuda:1,mem=8GiB,free=3MiB", "cpu,mem=64GiB,free=60GiB"):
        res = wd.resolve_device(model=path, dtype="float32")
    assert res.device == "cuda:0" and res.device_map == "cpu"
    assert res.load_peak is not None and res.load_peak.remedy == "cpu" and not res.load_peak.fits
    assert res.load_peak.moved <= 3 * MiB < res.load_peak.peak
    warning = next(s.message for s in res.trace if s.topic == "warning" and "the load does not" in s.message)
    assert "model.to(res.device)" in warning
    assert res.model_kwargs()["device_map"] == "cpu"
    kwargs = res.pipeline_kwargs()
    assert kwargs["device"] == "cuda:0" and "device_map" not in kwargs and "device_map" not in kwargs["model_kwargs"]
    # What is handed over loads for real (on this machine's CPU, the GPU being simulated).
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs())
    assert model.device.type == "cpu" and getattr(model, "hf_device_map", None) is None
    pipe = pipeline("text-generation", model=str(path), **res.pipeline_kwargs(device="cpu"))
    assert pipe.model.device.type == "cpu"


def test_without_room_on_the_cpu_the_load_is_spread_with_a_lower_max_memory() -> None:
    config = _config()
    peak = load_peak(size_from_config(config), "float32", "cuda:0", None, 8 * GiB, kind="cuda")
    free = (peak.moved + peak.peak) // 2 // MiB  # the weights fit, the load does not
    budget = {0: f"{free}MiB", 1: f"{free}MiB"}
    with simulate(f"cuda:2,mem=8GiB,free={free}MiB", "cpu,mem=1GiB,free=1MiB"):
        res = wd.resolve_device(model=config, dtype="float32", max_memory=budget)
    assert res.load_peak is not None and res.load_peak.remedy == "split"
    assert res.device_map in ("auto", "balanced_low_0") and res.max_memory is not None
    assert all(int(v.removesuffix("MiB")) < free for v in res.max_memory.values())


def test_a_budget_above_what_the_device_has_free_is_refused() -> None:
    with simulate("cuda:1,mem=24GiB,free=10GiB"), pytest.raises(wd.DoesNotFitError) as raised:
        big = _config(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)
        wd.resolve_device(model=big, dtype="bfloat16", max_memory={0: "20GiB"}, quantize=None)
    assert "max_memory cannot give a device memory it does not have" in str(raised.value)
