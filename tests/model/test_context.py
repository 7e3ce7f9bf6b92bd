"""The model's own context (model/context.py): its positions, stretched where its RoPE scaling says so
as transformers reads it, and a max_length beyond them said with both numbers, in the API and the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import whichdevice as wd

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip


def _llama(**kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL, **kwargs)


@pytest.fixture(scope="module")
def gpt2_64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 with 64 learned positions: generate() past them raises IndexError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2") / "gpt2-64"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64)).save_pretrained(path)
    return path


def _warnings(res: wd.Resolution) -> list[str]:
    return [s.message for s in res.trace if s.topic == "warning"]


def test_max_length_past_the_models_positions_is_a_warning_with_both_numbers(gpt2_64: Path):
    """Issue 54: max_length=256 on 64 positions resolved without a word, and generate() then raised."""
    from transformers import AutoModelForCausalLM

    res = wd.resolve_device(model=gpt2_64, max_length=256)
    said = [w for w in _warnings(res) if "max_length=256" in w]
    assert said and "64 positions" in said[0] and "n_positions" in said[0], res.explain()
    # What the warning is about, read back from the model: past its 64 positions it fails.
    model = AutoModelForCausalLM.from_pretrained(gpt2_64, **res.model_kwargs())
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(IndexError):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_length=256, min_length=256, do_sample=False)
    inside = wd.resolve_device(model=gpt2_64, max_length=64)
    assert not any("max_length=" in w for w in _warnings(inside))


def test_the_command_says_it_in_the_report_and_the_plan(gpt2_64: Path):
    report = subprocess.run(
        [sys.executable, "-m", "whichdevice", "--json", "--task", "inference", "--model", str(gpt2_64),
         "--max-length", "256"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    warnings = [w["message"] for w in json.loads(report.stdout)["warnings"]]
    assert any("max_length=256" in w and "64 positions" in w for w in warnings), warnings
    plan = subprocess.run(
        [sys.executable, "-m", "whichdevice", "plan", str(gpt2_64), "--max-length", "256", "--machine", "cuda:1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "max_length=256" in plan.stdout and "64 positions" in plan.stdout


def test_a_yarn_model_has_its_stretched_context():
    """Issue 54: YaRN factor 4 over 256 original positions is a 1,024-token model, not a 256-token one."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    config = _llama(max_position_embeddings=256, rope_scaling=yarn)
    res = wd.resolve_device(model=config, batch_size=1, max_length=1000)
    fit = res.largest_fit()
    assert fit.context == 1024 and fit.longest is not None and fit.longest >= 1000
    assert not any("max_length=" in w for w in _warnings(res)), res.explain()
    assert "YaRN" in res.explain() or "yarn" in res.explain()


@pytest.mark.parametrize(
    ("kwargs", "tokens"),
    [
        ({"max_position_embeddings": 4096}, 4096),
        # linear: positions compressed by the factor over max_position_embeddings (vicuna-7b-v1.5-16k's form)
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
        ({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 4096),
        # YaRN as Qwen2.5 writes it, the legacy key and "type"
        ({"max_position_embeddings": 32768,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
        # YaRN with max_position_embeddings already the stretched length (DeepSeek's form)
        ({"max_position_embeddings": 163840,
          "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}}, 163840),
        # Llama 3.1: max_position_embeddings is the model's context; factor 8 over 8192 is less
        ({"max_position_embeddings": 131072,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}, 131072),
    ],
    ids=["plain", "linear", "dynamic", "yarn-qwen", "yarn-deepseek", "llama3"],
)  # fmt: skip
def test_each_rope_type_is_read_as_transformers_reads_it(kwargs, tokens):
    from whichdevice.model.context import model_context

    config = _llama(**kwargs)
    for form in (config, config.to_dict()):  # a config object, and what config.json holds
        context = model_context(form.to_dict() if hasattr(form, "to_dict") else form)
        assert context is not None and context.tokens == tokens, context


def test_longrope_reads_phi3s_own_original_positions():
    from transformers import Phi3Config

    from whichdevice.model.context import model_context

    head = 64 // 4
    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=256, max_position_embeddings=131072, original_max_position_embeddings=4096,
                        rope_scaling={"type": "longrope", "long_factor": [1.0] * (head // 2),
                                      "short_factor": [1.0] * (head // 2)})  # fmt: skip
    context = model_context(config.to_dict())
    assert context is not None and context.tokens == 131072 and context.positions == 131072


def test_what_is_not_read_fails_closed_to_the_positions():
    from whichdevice.model.context import STRETCHED_BY, model_context

    # A rope type whichdevice has no rule for, per-layer rope parameters, and a config transformers
    # cannot build (unknown model_type): the positions the config states, nothing stretched.
    odd = {"model_type": "llama", **SMALL, "max_position_embeddings": 4096,
           "rope_parameters": {"rope_type": "proportional", "factor": 8.0, "rope_theta": 10000.0}}  # fmt: skip
    assert model_context(odd).tokens == 4096
    custom = {"model_type": "not_a_transformers_model", "max_position_embeddings": 2048,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}  # fmt: skip
    assert model_context(custom).tokens == 2048
    assert model_context({"model_type": "llama"}) is None
    # Every type with a rule is one the installed transformers computes.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(STRETCHED_BY) <= set(ROPE_INIT_FUNCTIONS)
