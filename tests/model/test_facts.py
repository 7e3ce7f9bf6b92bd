"""The model read once: each model file opened at most once per resolve_device(model=...) call, and
the ModelFacts record holding what the checkpoint says (whichdevice.model.facts)."""

from __future__ import annotations

import builtins
import collections
import io
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama, tiny_config
from whichdevice.model.facts import ModelFacts, read_model_facts

PACKAGE = Path(wd.__file__).resolve().parent
CALLS = {
    "inference": {},
    "inference sized": {"batch_size": 2, "max_length": 64},
    "training": {"task": "training"},
    "training sized": {"task": "training", "batch_size": 2, "max_length": 64},
}


@contextmanager
def opens_under(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Counts opens of every file under ``root`` by name: builtins.open, io.open (which pathlib uses)
    and os.open (the model reader's regular-file-only open)."""
    counts: collections.Counter[str] = collections.Counter()
    real_open, real_os_open = io.open, os.open
    prefix = str(root)

    def count(file: Any) -> None:
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(prefix):
            counts[Path(os.fspath(file)).name] += 1

    def counted(file: Any, *args: Any, **kwargs: Any) -> Any:
        count(file)
        return real_open(file, *args, **kwargs)

    def counted_os(file: Any, *args: Any, **kwargs: Any) -> Any:
        count(file)
        return real_os_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", counted)
        patch.setattr(io, "open", counted)
        patch.setattr(os, "open", counted_os)
        yield counts


def _sharded(path: Path) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("facts")
    return {
        "one file": save_tiny_llama(root / "one", dtype=torch.bfloat16, tokenizer=False),
        "sharded": _sharded(root / "sharded"),
    }


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("layout", ["one file", "sharded"])
def test_each_model_file_is_opened_at_most_once(folders, monkeypatch, layout, call) -> None:
    folder = folders[layout]
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(weights) == 1 if layout == "one file" else len(weights) > 1
    with opens_under(folder, monkeypatch) as counts:
        res = wd.resolve_device("cpu", model=folder, **CALLS[call])
    assert res.device == "cpu"
    assert counts["config.json"] == 1
    assert all(counts[name] == 1 for name in weights), counts
    assert max(counts.values()) == 1, counts


def test_a_cached_model_id_is_read_once_through_the_cache(folders, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    entry = tmp_path / "hub" / "models--acme--tiny"
    snapshot = entry / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("a" * 40)
    for file in folders["one file"].iterdir():
        blob = entry / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with opens_under(snapshot, monkeypatch) as counts:
        res = wd.resolve_device("cpu", model="acme/tiny", task="training", batch_size=1, max_length=32)
    assert counts["config.json"] == 1 and counts["model.safetensors"] == 1, counts
    assert any("parameters" in s.message for s in res.trace if s.topic == "model")


def test_a_config_object_is_read_once(monkeypatch) -> None:
    config = tiny_config()
    real = config.to_dict
    calls = []

    def counted() -> dict[str, Any]:
        # whichdevice's reads only: transformers calls to_dict itself when it builds the model to size it.
        # The caller is whichdevice's by where its file is, not by its path's text: a checkout named
        # whichdevice with its venv inside puts transformers' files under that name too (issue 58).
        caller = sys._getframe(1).f_code.co_filename
        if Path(caller).resolve().is_relative_to(PACKAGE):
            calls.append(caller)
        return real()

    monkeypatch.setattr(config, "to_dict", counted)
    res = wd.resolve_device("cpu", model=config, task="training", batch_size=2, max_length=64)
    assert len(calls) == 1, calls
    sized = [s.message for s in res.trace if s.topic == "model"]
    assert sized and "meta-device build of LlamaConfig" in sized[0]


def test_the_record_holds_what_the_checkpoint_says(folders) -> None:
    from safetensors import safe_open

    folder = folders["sharded"]
    facts = read_model_facts(folder)
    assert isinstance(facts, ModelFacts)
    assert facts.model_type == "llama" and facts.architectures == ("LlamaForCausalLM",)
    assert facts.quantization_config is None and facts.sliding_window is None
    config = tiny_config()
    assert facts.shape is not None
    assert (facts.shape.layers, facts.shape.kv_heads) == (config.num_hidden_layers, config.num_key_value_heads)
    # Parameters and bytes per stored dtype, against the tensors themselves.
    params: collections.Counter[str] = collections.Counter()
    stored: collections.Counter[str] = collections.Counter()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = fh.get_tensor(name)
                code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[tensor.dtype]
                params[code] += tensor.numel()
                stored[code] += tensor.numel() * tensor.element_size()
    assert {c: (p, b) for c, p, b in facts.stored.by_code} == {c: (params[c], stored[c]) for c in params}
    assert facts.size.parameters == sum(params.values())
    assert facts.checkpoint.dtype == "float32"
    assert read_model_facts(folders["one file"]).checkpoint.dtype == "bfloat16"


def test_a_checkpoints_own_quantization_config_is_carried_as_read(tmp_path) -> None:
    import json

    folder = save_tiny_llama(tmp_path / "q", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    assert read_model_facts(folder).quantization_config == config["quantization_config"]


def test_the_dtype_vocabulary_is_one_table() -> None:
    from whichdevice.core import dtypes

    for name in dtypes.NAMES:
        assert dtypes.from_short(dtypes.short_name(name)) == name
        assert dtypes.item_size(name) == torch.empty((), dtype=getattr(torch, name)).element_size()
    for code in ("F32", "BF16", "F16"):
        name = dtypes.code_name(code)
        assert name is not None and dtypes.SAFETENSORS_BITS[code] == 8 * dtypes.item_size(name)


def test_reading_a_config_object_causes_no_deprecation_warning(monkeypatch) -> None:
    """Issue 46: reading a config's torch_dtype (transformers 5's deprecated alias of dtype) made
    transformers say "`torch_dtype` is deprecated! Use `dtype` instead!" to a user who never wrote it."""
    import warnings

    from transformers import LlamaConfig, configuration_utils

    import whichdevice as wd

    said: list[str] = []
    # warning_once remembers what it said in this process: a spy sees every call.
    monkeypatch.setattr(configuration_utils.logger, "warning_once", lambda message, *a, **k: said.append(message))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecation raised as a Python warning fails here
        res = wd.resolve_device(model=config)
    assert "the config, which states no dtype" in res.explain()
    assert not [m for m in said if "deprecated" in m]
