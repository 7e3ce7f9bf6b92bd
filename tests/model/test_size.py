"""Sizing a model never runs the model's own code: a folder with ``auto_map`` and configuration or
modeling files of its own is read from config.json and safetensors headers alone, even when stdin
answers yes to transformers' "Do you wish to run the custom code?"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import whichdevice as wd

# Each of the folder's own files leaves a marker in the folder if it is ever imported (transformers
# imports a copy from its modules cache, so the marker's path is written in full).
OWN_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"
AUTO_MAP = {
    "AutoConfig": "configuration_evil.EvilConfig",
    "AutoModel": "modeling_evil.EvilModel",
    "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
}
RESOLVE = """
import sys, whichdevice as wd
try:
    res = wd.resolve_device(model=sys.argv[1])
    print("RESOLVED", res.device)
    print(res.explain())
except wd.DeviceError as error:
    print("REFUSED", error)
"""


def _custom_folder(tmp_path: Path, model_type: str, weights: bool) -> Path:
    folder = tmp_path / f"{model_type}-{weights}"
    folder.mkdir()
    config = {"model_type": model_type, "auto_map": AUTO_MAP, "hidden_size": 64, "num_hidden_layers": 2}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil", "modeling_evil"):
        (folder / f"{name}.py").write_text(OWN_CODE.format(marker=str(folder / f"IMPORTED-{name}")))
    if weights:
        save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}, str(folder / "model.safetensors"))
    return folder


def _resolve_answering_yes(folder: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, str(folder)],
        input="y\n" * 100,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert not list(folder.glob("IMPORTED-*")), f"the folder's own code ran:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("model_type", ["evil_custom", "llama"])
def test_a_folder_with_its_own_code_is_sized_from_its_headers_without_running_it(tmp_path, model_type):
    out = _resolve_answering_yes(_custom_folder(tmp_path, model_type, weights=True))
    assert out.startswith("RESOLVED cpu") and "safetensors headers" in out
    # The attention its own code would choose is not checked here, and the trace says so.
    assert "auto_map" in out


def test_an_unknown_architecture_without_weights_cannot_be_sized_and_the_error_says_what_to_pass(tmp_path):
    out = _resolve_answering_yes(_custom_folder(tmp_path, "evil_custom", weights=False))
    assert out.startswith("REFUSED") and "never runs a model's own code" in out
    assert "has no model_type 'evil_custom'" in out and "save the weights as safetensors" in out


def test_a_known_architecture_with_its_own_code_is_built_from_transformers_classes_and_says_so(tmp_path):
    folder = _custom_folder(tmp_path, "llama", weights=False)
    config = json.loads((folder / "config.json").read_text())
    config.update(intermediate_size=128, num_attention_heads=4, vocab_size=256)
    (folder / "config.json").write_text(json.dumps(config))
    from whichdevice.model.facts import estimate_model_size

    size = estimate_model_size(folder)
    assert not list(folder.glob("IMPORTED-*"))
    assert "the folder's code, auto_map, was not run" in size.source and size.parameters > 0
    assert wd.resolve_device(model=folder).device == "cpu"


def _headers(tensors: dict[str, list[int]]) -> tuple[tuple[Path, dict[str, dict[str, object]]], ...]:
    return ((Path("model.safetensors"), {name: {"dtype": "BF16", "shape": shape} for name, shape in tensors.items()}),)


def test_a_decode_step_reads_the_head_of_its_own_or_the_tied_embedding():
    from whichdevice.model.size import stored_weights

    layers = {"model.layers.0.self_attn.q_proj.weight": [64, 64], "model.layers.0.mlp.up_proj.weight": [128, 64]}
    embedding = {"model.embed_tokens.weight": [1000, 64], "model.norm.weight": [64]}
    own = stored_weights(_headers({**layers, **embedding, "lm_head.weight": [1000, 64]}))
    tied = stored_weights(_headers({**layers, **embedding}))
    positions = stored_weights(
        _headers({**layers, "transformer.wte.weight": [900, 64], "transformer.wpe.weight": [2048, 64]})
    )
    assert own is not None and tied is not None and positions is not None
    linear = 64 * 64 + 128 * 64
    assert (own.linear_params, own.linear_count) == (linear, 2)  # what bitsandbytes quantizes: no head
    assert own.step_weights() == (linear + 64_000, 3)
    assert tied.step_weights() == (linear + 64_000, 3)  # the tied head reads the embedding
    assert positions.step_weights().parameters == linear + 900 * 64  # a position table is no head
    assert stored_weights(_headers(layers)).step_weights().parameters == linear  # type: ignore[union-attr]
