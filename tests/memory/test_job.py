"""An inference job's memory besides the weights, held to what transformers allocates: here, a state-space
model's cache (Mamba, Mamba2), read back from the cache a real forward leaves, and Mamba2's widths, read
from the mixer transformers builds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from whichdevice.memory.job import job_memory, kv_cache_bytes, state_cache_bytes
from whichdevice.model.shape import shape_of_config

SMALL = {
    "mamba": {"hidden_size": 48, "num_hidden_layers": 3, "state_size": 8, "vocab_size": 96, "conv_kernel": 3},
    "mamba2": {"hidden_size": 64, "num_hidden_layers": 3, "state_size": 8, "vocab_size": 96, "conv_kernel": 4,
               "num_heads": 8, "head_dim": 16, "n_groups": 2},
    "falcon_mamba": {"hidden_size": 40, "num_hidden_layers": 2, "state_size": 4, "vocab_size": 96, "conv_kernel": 4},
}  # fmt: skip


def _built(model_type: str, dtype: torch.dtype) -> tuple[dict[str, Any], Any]:
    config = AutoConfig.for_model(model_type, **SMALL[model_type])
    torch.manual_seed(0)
    return config.to_dict(), AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _cache_bytes(cache: Any) -> int:
    """Every tensor transformers' cache holds for the states (each storage once)."""
    seen: set[int] = set()
    total = 0
    for layer in cache.layers:
        for states in (layer.conv_states, layer.recurrent_states):
            for tensor in states.values():
                if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("model_type", sorted(SMALL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_cache_is_what_transformers_holds_after_a_forward(model_type: str, dtype: torch.dtype) -> None:
    config, model = _built(model_type, dtype)
    batch = 3
    with torch.no_grad():
        out = model(torch.randint(0, 96, (batch, 7)), use_cache=True)
    held = _cache_bytes(out.cache if hasattr(out, "cache") else out.past_key_values)
    assert held > 0
    shape = shape_of_config(config)
    assert shape is not None
    assert state_cache_bytes(shape, batch, str(dtype).removeprefix("torch.")) == held


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_the_widths_are_the_mixers_transformers_builds(model_type: str) -> None:
    config, model = _built(model_type, torch.float32)
    mixer = model.backbone.layers[0].mixer
    shape = shape_of_config(config)
    assert shape is not None
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (0, 0, 0)  # no attention: Mamba2's num_heads are the scan's
    assert shape.intermediate == mixer.intermediate_size
    assert shape.conv_kernel == mixer.conv_kernel_size
    assert shape.ssm_groups == getattr(mixer, "n_groups", 0)
    assert shape.state_size == mixer.ssm_state_size


def test_a_state_space_job_counts_its_states_once_whatever_its_length() -> None:
    config, _ = _built("mamba2", torch.float32)
    shape = shape_of_config(config)
    assert shape is not None
    assert kv_cache_bytes(shape, 4096, 2, "bfloat16") == 0
    short, long = (job_memory(shape, "bfloat16", 2, tokens) for tokens in (64, 4096))
    for memory in (short, long):
        names = [t.name for t in memory.terms]
        assert "KV cache" not in names and names.count("state cache") == 1
    (a,), (b,) = ([t.bytes for t in m.terms if t.name == "state cache"] for m in (short, long))
    assert a == b == state_cache_bytes(shape, 2, "bfloat16")


def test_an_attention_model_has_no_state_cache() -> None:
    shape = shape_of_config(AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64).to_dict())
    assert shape is not None
    assert state_cache_bytes(shape, 4, "bfloat16") == 0
    assert [t.name for t in job_memory(shape, "bfloat16", 1, 128).terms].count("KV cache") == 1


def test_a_state_space_jobs_activations_name_no_attention_scores() -> None:
    # Mamba runs eager (no sdpa), but has no attention: nothing of T x T scores is counted or said.
    config, _ = _built("mamba2", torch.float32)
    shape = shape_of_config(config)
    assert shape is not None
    (activations,) = [t for t in job_memory(shape, "float32", 2, 512, eager=True).terms if t.name == "activations"]
    assert "scores" not in activations.why
    assert activations.bytes == job_memory(shape, "float32", 2, 512, eager=False).terms[-1].bytes
