"""Whether a model's head shares its embedding's weight, read from config.json as transformers loads it.

transformers 4 saved only the values of a config that differ from the defaults, so the config.json of a
class that ties by default leaves ``tie_word_embeddings`` out (GPT-2's on the Hub, for one). Each case here
takes the installed config class's own dict, drops the key, saves it, and holds the shape's answer to
what ``AutoConfig.from_pretrained`` makes of that file, and (for three) to what the built model shares.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from whichdevice.model.facts import read_model_facts
from whichdevice.model.shape import shape_of_config

# Classes that tie by default (gpt2, gemma, mamba, t5, opt, bloom, falcon_mamba) and classes that do
# not (llama, qwen2, mistral), as the installed transformers sets them: the test reads each answer from
# transformers, not from this list.
MODEL_TYPES = ("gpt2", "gemma", "mamba", "t5", "opt", "bloom", "falcon_mamba", "llama", "qwen2", "mistral")


def _without_tie(model_type: str) -> dict[str, Any]:
    data: dict[str, Any] = AutoConfig.for_model(model_type).to_dict()
    data.pop("tie_word_embeddings", None)
    return data


def _saved(tmp_path: Path, data: dict[str, Any]) -> Path:
    folder = tmp_path / str(data["model_type"])
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_config_without_tie_word_embeddings_is_read_as_transformers_loads_it(tmp_path: Path, model_type: str) -> None:
    data = _without_tie(model_type)
    loaded = AutoConfig.from_pretrained(_saved(tmp_path, data)).tie_word_embeddings
    shape = shape_of_config(data)
    assert shape is not None
    assert shape.tied_embeddings is loaded


def test_both_answers_occur_among_the_cases() -> None:
    # Otherwise the test above could pass with a constant answer.
    answers = {bool(AutoConfig.for_model(t).tie_word_embeddings) for t in MODEL_TYPES}
    assert answers == {True, False}


@pytest.mark.parametrize("model_type", ["gpt2", "mamba", "llama"])
def test_the_built_model_shares_its_head_exactly_when_the_shape_says_so(tmp_path: Path, model_type: str) -> None:
    small = {"gpt2": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64},
             "mamba": {"num_hidden_layers": 1, "hidden_size": 32, "state_size": 4, "vocab_size": 64},
             "llama": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64}}[model_type]  # fmt: skip
    data = {**_without_tie(model_type), **small}
    folder = _saved(tmp_path, data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    shares = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    facts = read_model_facts(str(folder), weights=False)
    assert facts.shape is not None
    assert facts.shape.tied_embeddings is shares


def test_a_stated_value_wins_over_the_class_default() -> None:
    for model_type in ("gpt2", "llama"):
        for stated in (True, False):
            shape = shape_of_config({**_without_tie(model_type), "tie_word_embeddings": stated})
            assert shape is not None and shape.tied_embeddings is stated


def test_a_config_no_installed_class_answers_for_is_read_as_tied() -> None:
    # auto_map: the config class is the model's own code, never imported; an unknown model_type has no
    # class in the installed transformers. Both take the larger training estimate: tied.
    llama = _without_tie("llama")
    for data in ({**llama, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}, {**llama, "model_type": "no-such"}):
        shape = shape_of_config(data)
        assert shape is not None and shape.tied_embeddings is True


def test_tied_is_the_larger_training_estimate() -> None:
    # What the fallback above relies on: the same model priced tied needs at least what it needs untied.
    from whichdevice.memory.activations import ActivationMode, training_activations

    tied = shape_of_config(_without_tie("gpt2"))
    assert tied is not None and tied.tied_embeddings
    untied = replace(tied, tied_embeddings=False)
    for mode in (ActivationMode("full", "float32", "bfloat16", "sdpa", False),
                 ActivationMode("lora", "bfloat16", None, "sdpa", True)):  # fmt: skip
        a, b = (training_activations(s, mode, 8, 512, params=124_439_808, largest_weight=768 * 3072)
                for s in (tied, untied))  # fmt: skip
        assert a.kept >= b.kept and a.head_peak >= b.head_peak and a.layers_peak >= b.layers_peak
