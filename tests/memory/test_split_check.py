"""Splits are checked with transformers' own placement on a meta build (memory/split_check.py)."""

from __future__ import annotations

from collections import Counter

import pytest

import whichdevice as wd
from whichdevice.testing import simulate

GiB = 1024**3


def _llama_7b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008,
                       vocab_size=32000, max_position_embeddings=4096)  # fmt: skip


def test_the_issues_split_keeps_every_layer_on_the_gpus():
    """Llama-7B, 4096 tokens x 8 on 2 x 24 GiB: 'balanced_low_0' with the old budgets put layers on disk."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map

    config = _llama_7b()
    with simulate("cuda:2,mem=24GiB"):
        res = wd.resolve_device(model=config, max_length=4096, batch_size=8)
    assert isinstance(res.device_map, str) and res.max_memory
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    budgets = {k: int(v.removesuffix("MiB")) * 1024**2 for k, v in res.max_memory.items()}
    placed = _get_device_map(meta, res.device_map, budgets, None)  # the call from_pretrained makes
    where = Counter(placed.values())
    assert set(where) <= {0, 1}, where
    # each device's weights plus its share of the KV cache (0.5 GiB per layer here) stay under 24 GiB
    layers = Counter(v for k, v in placed.items() if k.startswith("model.layers."))
    for device in (0, 1):
        weights = sum(
            p.numel() * p.element_size()
            for name, module in meta.named_modules()
            if placed.get(name) == device
            for p in module.parameters()
        )
        assert weights + layers[device] * GiB // 2 < 24 * GiB
    assert "checked with transformers' own placement on a meta build" in res.explain()


def _llama_13b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824,
                       vocab_size=32000, max_position_embeddings=4096)  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "devices"),
    [
        ("cuda:4,mem=24GiB,cc=8.9", [1, 2]),
        # GPU 0 in exclusive mode, held by another process: the resolution leaves it out by itself.
        ("cuda:4,mem=24GiB,cc=8.9,compute=exclusive_process/default,held=1GiB/0", None),
    ],
    ids=["devices-1-2", "gpu0-exclusive-and-held"],
)
def test_a_split_that_leaves_gpu_0_out_is_one_from_pretrained_places(spec, devices):
    """Issue 54: budgets without device 0 went to transformers' 'balanced_low_0', whose placement reads
    max_memory[0] (KeyError: 0 in get_balanced_memory). The keywords are now a form transformers places,
    passed here to the call from_pretrained makes on a meta build."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map

    config = _llama_13b()
    with simulate(spec):
        res = wd.resolve_device(model=config, devices=devices, batch_size=1, max_length=1024)
    kwargs = res.model_kwargs()
    used = set(res.devices or ())
    assert 0 not in used and len(used) >= 2
    assert {int(k) for k in kwargs["max_memory"]} == used
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config, dtype=kwargs["dtype"])
    placed = _get_device_map(meta, kwargs["device_map"], dict(kwargs["max_memory"]), None)
    assert set(placed.values()) <= used, Counter(placed.values())
    assert res.device == f"cuda:{min(used)}"
    line = next(s.message for s in res.trace if s.topic == "placement" and "device_map=" in s.message)
    assert "checked with transformers' own placement" in line
    assert torch.float16 != kwargs["dtype"]  # cc 8.9: bf16
