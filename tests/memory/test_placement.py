"""Placement that fits the whole job: free memory, the KV cache, training state, offload, busy devices."""

from __future__ import annotations

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama, tiny_config
from whichdevice.memory.job import kv_cache_bytes
from whichdevice.model.facts import model_shape
from whichdevice.testing import simulate

GiB = 1024**3


def _llama(hidden: int = 4096, layers: int = 32, kv_heads: int = 8, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=kv_heads,
        vocab_size=32000,
        max_position_embeddings=32768,
        **extra,
    )


def _lines(res: wd.Resolution, topic: str) -> str:
    return "\n".join(s.message for s in res.trace if s.topic == topic)


# ------------------------------------------------------------------------------ busy devices


def test_busy_gpu0_moves_inference_to_the_idle_gpu():
    with simulate("cuda:4,mem=80GiB,free=2GiB/60GiB/60GiB/80GiB"):
        res = wd.resolve_device(model=_llama(), dtype="bfloat16")
    assert res.device == "cuda:3" and res.device_map == "cuda:3"
    assert "cuda:3: the most free memory" in _lines(res, "device")
    assert "cuda:0 has 2.00 GiB free of 80.00 GiB" in _lines(res, "device")
    assert "cuda:3 80.00 GiB free of 80.00 GiB" in _lines(res, "memory")


@pytest.mark.parametrize(
    "spec",
    ["cuda:4,mem=80GiB", "cuda:4,mem=80GiB,free=80GiB", "cuda:4,mem=80GiB,free=78GiB/80GiB/80GiB/80GiB"],
    ids=["free-unknown", "all-idle", "gpu0-nearly-idle"],
)
def test_device_0_stays_when_nothing_is_busy(spec):
    with simulate(spec):
        res = wd.resolve_device()
    assert res.device == "cuda:0"
    assert "most free memory" not in res.explain()


def test_busy_gpu0_for_training_says_how_to_move_the_trainer():
    with simulate("cuda:4,mem=80GiB,free=2GiB/80GiB/80GiB/80GiB"):
        res = wd.resolve_device(task="training")
    # Trainer in one process always trains on device 0: the answer is a visible-devices variable.
    assert res.device == "cuda:0"
    assert "CUDA_VISIBLE_DEVICES=1 python train.py" in _lines(res, "warning")


def test_inference_takes_the_device_the_whole_job_fits_on_before_splitting():
    # cuda:0 stays the choice by free memory (13 GiB is within 90% of 14), but the 11.05 GiB model fits
    # only cuda:1's 80%: one device rather than a split over both.
    with simulate("cuda:2,mem=24GiB,free=13GiB/14GiB"):
        moved = wd.resolve_device(model=_llama(), dtype="bfloat16", quantize=None)
        asked = wd.resolve_device("cuda:0", model=_llama(), dtype="bfloat16", quantize=None)
        training = wd.resolve_device(model=_llama(), task="training", quantize=None)
    assert moved.device == moved.device_map == "cuda:1" and moved.max_memory is None
    assert "cuda:1: the whole job (11.05 GiB) fits there alone (11.20 GiB usable)" in _lines(moved, "device")
    assert asked.device == "cuda:0" and asked.device_map in ("auto", "balanced_low_0")  # an index as given
    assert training.device == "cuda:0"  # Trainer in one process trains on cuda:0 whatever is chosen


def test_a_distributed_rank_keeps_its_local_rank_device(monkeypatch):
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with simulate("cuda:2,mem=80GiB,free=2GiB/80GiB"):
        res = wd.resolve_device()
    assert res.device == "cuda:0"


def test_a_busy_gpu_is_sized_by_its_free_memory():
    # 7B in bf16 (13 GiB) fits an 80 GiB GPU, but not the 10 GiB another process left free.
    with simulate("cuda:1,mem=80GiB,free=10GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama(), dtype="bfloat16", quantize=None)
    assert "8.00 GiB usable" in str(err.value)


# --------------------------------------------------------------------------------- the KV cache


def test_plain_model_keeps_todays_answer_and_says_what_was_not_counted():
    with simulate("cuda:1,mem=24GiB"):
        res = wd.resolve_device(model=_llama(), dtype="bfloat16")
    assert res.device_map == "cuda:0" and res.max_memory is None
    assert "KV cache and activations not counted: pass max_length=" in _lines(res, "memory")


def test_a_long_generation_no_longer_fits_one_device():
    with simulate("cuda:1,mem=40GiB"):
        short = wd.resolve_device(model=_llama(), dtype="bfloat16", max_length=1024, batch_size=1)
        assert short.device_map == "cuda:0"
        assert "KV cache 128.00 MiB (2 x 32 layers x 8 KV heads x 128 x 1024 tokens" in _lines(short, "memory")
        with pytest.raises(wd.DoesNotFitError) as err:
            wd.resolve_device(model=_llama(), dtype="bfloat16", max_length=32768, batch_size=4, quantize=None)
    message = str(err.value)
    assert "KV cache 16.00 GiB" in message and "devices like this one" in message and "offload='cpu'" in message
    with simulate("cuda:2,mem=40GiB"):
        split = wd.resolve_device(model=_llama(), dtype="bfloat16", max_length=32768, batch_size=4, quantize=None)
    # Generation splits with balanced_low_0 where transformers' own placement keeps every layer on the two
    # devices with it (on two devices it leaves device 0 only what device 1 cannot hold, so "auto" often
    # wins: memory/split_check.py), and max_memory (weights only) leaves room for the rest.
    assert split.device_map in ("balanced_low_0", "auto")
    assert "checked with transformers' own placement on a meta build" in _lines(split, "placement")
    assert all(int(v.removesuffix("MiB")) < 0.9 * 40 * 1024 - 1024 for v in split.max_memory.values())
    assert split.model_kwargs()["device_map"] == split.device_map


def test_sliding_window_layers_cap_their_cache():
    full = model_shape(_llama())
    windowed = model_shape(_llama(sliding_window=4096))
    assert windowed is not None and full is not None and windowed.sliding_layers == 32
    assert kv_cache_bytes(windowed, 32768, 1, "bfloat16") == kv_cache_bytes(full, 4096, 1, "bfloat16")


def test_kv_cache_formula_matches_a_real_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.randint(0, 250, (3, 10))
    out = model.generate(
        ids, max_length=40, min_length=40, do_sample=False, return_dict_in_generate=True, pad_token_id=0
    )
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    shape = model_shape(str(path))
    assert shape is not None
    estimate = kv_cache_bytes(shape, 40, 3, "float32")
    # The cache holds every token but the last one generated; the estimate counts all 40.
    assert estimate >= held and estimate - held == kv_cache_bytes(shape, 1, 3, "float32")


# ------------------------------------------------------------------------------------ training


def test_training_7b_on_a_16gib_t4_is_qlora_computing_in_fp16():
    """At 4096 tokens LoRA on the fp16 weights does not fit a T4 even checkpointed; QLoRA does, its 4-bit
    layers computing in fp16 (a T4 has no bf16), with the paged 8-bit AdamW lora_training hands over."""
    with simulate("cuda:1,cc=7.5,mem=16GiB,name=Tesla T4"):
        res = wd.resolve_device(model=_llama(kv_heads=32), task="training", max_length=4096)
    memory = _lines(res, "memory")
    assert "gradients" in memory and "optimizer state" in memory and "paged 8-bit AdamW" in memory
    assert "QLoRA (4-bit base, LoRA adapters), gradient checkpointing:" in memory
    assert "LoRA adapters on float16 weights, gradient checkpointing does not fit" in memory
    assert res.quantization is not None and res.quantization.bits == 4 and res.device_map == "cuda:0"
    assert res.quantization.compute_dtype == "float16" and res.gradient_checkpointing is True
    assert "lora_training" in _lines(res, "quantization")


def test_training_70b_on_one_gaudi_is_qlora_with_gaudi_settings():
    from whichdevice.training.lora import kbit_training_kwargs

    with simulate("hpu:1,gen=gaudi2"):
        res = wd.resolve_device(model=_llama(hidden=8192, layers=80), task="training")
    assert "QLoRA (4-bit base, LoRA adapters):" in _lines(res, "memory")
    plan = res.quantization
    assert plan is not None and plan.bits == 4 and res.device_map == "hpu"
    config = res.model_kwargs()["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == getattr(torch, plan.compute_dtype)
    # Gaudi's TrainingArguments: bf16 autocast, no ddp_backend in one process; LoRA's keywords
    # without a paged optimizer (bitsandbytes pages through CUDA unified memory: NVIDIA only).
    assert res.training_kwargs() == {"bf16": True, "fp16": False}
    kbit = kbit_training_kwargs(res, 4)
    assert "optim" not in kbit and kbit["activation_checkpointing"] is True
    assert "lora_training" in _lines(res, "quantization")


def test_training_7b_on_an_8gib_gpu_without_quantizing_names_every_way_out():
    with simulate("cuda:1,cc=7.5,mem=8GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama(kv_heads=32), task="training", quantize=None)
    message = str(err.value)
    for way in ("LoRA adapters", "quantize='auto'", "adamw_bnb_8bit", "cuda devices like this one", "FSDP"):
        assert way in message, way
    assert "offload" not in message.split("Ways out")[1]  # offload does not train
    assert "characters left out" not in message


def test_training_that_fits_only_with_adapters_says_lora():
    # 1.2B in bf16: 2.2 GiB of weights fit an 8 GiB GPU, but with gradients and AdamW's state 8.9 GiB do not.
    with simulate("cuda:1,mem=8GiB"):
        res = wd.resolve_device(model=_llama(hidden=2048, layers=24), task="training", dtype="bfloat16")
    assert res.device_map == "cuda:0" and res.quantization is None
    assert "LoRA adapters on the bfloat16 weights do" in _lines(res, "warning")


# ------------------------------------------------------------------------------------- offload


def test_no_offload_unless_asked():
    with simulate("cuda:1,mem=12GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama(), dtype="bfloat16", quantize=None)
    assert "offload='cpu' or offload='disk' (a slow run: about" in str(err.value)


def test_offload_cpu_on_request_fills_max_memory_cpu():
    with simulate("cuda:1,mem=12GiB"):
        res = wd.resolve_device(model=_llama(), dtype="bfloat16", quantize=None, offload="cpu")
    kwargs = res.model_kwargs()
    assert kwargs["device_map"] == "auto" and "cpu" in kwargs["max_memory"] and 0 in kwargs["max_memory"]
    assert "offload_folder" not in kwargs
    assert "offload='cpu' as you asked" in _lines(res, "placement")


def test_offload_disk_loads_and_generates_for_real_on_this_cpu(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "m", tokenizer=False, hidden_size=256, num_hidden_layers=4, vocab_size=4096)
    folder = tmp_path / "offload"
    res = wd.resolve_device(
        "cpu", model=str(path), max_memory={"cpu": "6MiB"}, quantize=None, offload="disk", offload_folder=folder
    )
    kwargs = res.model_kwargs()
    assert kwargs["device_map"] == "auto" and kwargs["offload_folder"] == str(folder)
    assert kwargs["max_memory"] == {"cpu": "6MiB"}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    assert "disk" in set(model.hf_device_map.values())
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(offload="gpu"), "'cpu' or 'disk'"),
        (dict(offload="disk"), "offload_folder="),
        (dict(offload_folder="/tmp/x"), "without offload='disk'"),
        (dict(offload="cpu", offload_folder="/tmp/x"), "is for offload='disk'"),
        (dict(offload="cpu", task="training"), "LoRA"),
    ],
)
def test_bad_offload_requests_name_the_fix(kwargs, words):
    with pytest.raises(wd.DeviceError, match=words.replace("(", r"\(").replace(")", r"\)")):
        wd.resolve_device(**kwargs)


def test_cpu_offload_on_the_cpu_says_disk():
    with pytest.raises(wd.ConfigConflictError, match="offload='disk'"):
        wd.resolve_device("cpu", model=tiny_config(), max_memory={"cpu": "1KiB"}, quantize=None, offload="cpu")


# ------------------------------------------------------------------------------ free memory read


def test_the_cpu_probe_reads_available_memory():
    info = wd.resolve_device("cpu").probe.devices[0]
    assert info.free_memory is not None and info.total_memory is not None
    assert 0 < info.free_memory <= info.total_memory


def test_simulated_free_memory_follows_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    with simulate("cuda:4,mem=16GiB,free=1GiB/16GiB/16GiB/12GiB"):
        devices = wd.resolve_device().probe.devices
    assert [(d.physical_id, d.free_memory) for d in devices] == [("3", 12 * GiB), ("0", 1 * GiB)]


def test_free_spec_must_be_sizes():
    with pytest.raises(wd.DeviceError, match="free"), simulate("cuda:2,free=lots"):
        pass
