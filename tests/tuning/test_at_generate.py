"""Packing decided at generate(): each call's own tokens, read as transformers reads them, decide;
the first call they repay packs, and the hook survives the ways users hold a model (pipeline,
PEFT, deepcopy, torch.save)."""

from __future__ import annotations

import copy
import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import whichdevice as wd
from simulated_cpus import PACKS_FP32
from tiny_models import save_tiny_llama
from whichdevice.measure.cpu_memory import packing_ops
from whichdevice.testing import simulate
from whichdevice.tuning import packed_weights
from whichdevice.tuning.at_generate import DEFAULT_NEW_TOKENS, call_tokens, remove_generate_hook
from whichdevice.tuning.packed_weights import packable_layers

pytestmark = pytest.mark.skipif(packing_ops(torch) is None, reason="this torch has no oneDNN packing ops")


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("plan") / "tiny", dtype=torch.float32)


@pytest.fixture
def unsaid(path: Path, monkeypatch: pytest.MonkeyPatch) -> wd.Resolution:
    # The simulated figures' budget for this tiny model is milliseconds, which a busy machine's
    # packing can pass: the budget has its own test (test_packed_weights), so here it never stops it.
    monkeypatch.setattr(packed_weights, "PROBE_MIN_S", float("inf"))
    # fp32 packing (PACKS_FP32), which oneDNN does on every CPU: what is packed is the same everywhere.
    with simulate(PACKS_FP32):
        return wd.resolve_device(model=str(path), batch_size=4, max_length=1024)


def _packed(model: Any) -> int:
    """The layers that run from a packed copy (a copied or loaded layer keeps an empty one)."""
    return sum(getattr(getattr(m, "_whichdevice_packed", None), "tensor", None) is not None for m in model.modules())


def _ids(batch: int = 4, length: int = 8) -> torch.Tensor:
    return torch.randint(5, 200, (batch, length), generator=torch.Generator().manual_seed(0))


def _generate(model: Any, new: int, **kwargs: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(_ids(), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def test_a_calls_tokens_are_read_as_transformers_reads_them():
    model = type("M", (), {"generation_config": GenerationConfig(max_length=50)})()
    ids = torch.zeros(3, 10, dtype=torch.long)
    assert call_tokens(model, (ids,), {}) == (3, 10, 40)  # the model's max_length, less the prompt
    assert call_tokens(model, (), {"input_ids": ids, "max_new_tokens": 7}) == (3, 10, 7)
    assert call_tokens(model, (ids,), {"max_length": 30}) == (3, 10, 20)
    assert call_tokens(model, (ids,), {"max_length": 30, "max_new_tokens": 5}) == (3, 10, 5)  # new tokens win
    told = GenerationConfig(max_new_tokens=12, num_beams=2)
    assert call_tokens(model, (ids,), {"generation_config": told}) == (6, 10, 12)  # beams are rows
    assert call_tokens(model, (ids,), {"generation_config": told, "num_beams": 1}) == (3, 10, 12)
    embeds = torch.zeros(2, 5, 16)
    assert call_tokens(model, (), {"inputs_embeds": embeds, "max_new_tokens": 3}) == (2, 5, 3)
    assert call_tokens(model, (), {}) is None  # nothing to read: the hook leaves the call alone
    assert call_tokens(model, (ids,), {"max_length": 10}) is None  # nothing new to generate
    told_model = type("M", (), {"generation_config": GenerationConfig(max_new_tokens=9)})()
    assert call_tokens(told_model, (ids,), {"max_length": 30}) == (3, 10, 9)  # the model's max_new_tokens wins
    unset = type("M", (), {"generation_config": GenerationConfig()})()
    default = GenerationConfig().max_length  # None where transformers reads no length as 20 new tokens
    assert call_tokens(unset, (ids,), {}) == (3, 10, DEFAULT_NEW_TOKENS if default is None else default - 10)


def test_prepare_leaves_the_packing_to_the_first_generate_call_its_tokens_repay(
    path: Path, unsaid: wd.Resolution, caplog: pytest.LogCaptureFixture
):
    tuning = unsaid.tuning
    assert tuning is not None and tuning.packing_at_generate and tuning.packed_for_batch == 4
    assert unsaid.to_dict()["tuning"]["packing_at_generate"]
    assert "the first model.generate() call whose own prompt and new tokens repay it" in _line(unsaid, "generation")
    plain = AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval()
    model = unsaid.prepare(AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval())
    assert _packed(model) == 0 and "generate" in vars(model)  # nothing packed yet
    short = _generate(model, 4)  # 4 new tokens do not repay it (about 180 do here)
    assert _packed(model) == 0 and "generate" in vars(model)
    one_row = model.generate(_ids(batch=1), max_new_tokens=200, do_sample=False, pad_token_id=0)
    assert _packed(model) == 0 and one_row.shape == (1, 208)  # one row: a packed step is not faster
    with caplog.at_level(logging.INFO, logger="whichdevice"):
        long = _generate(model, 200)
    assert _packed(model) == len(packable_layers(model, unsaid.dtype_name or "")) > 0
    assert "generate" not in vars(model)  # decided: the hook is gone, generate is the model's own
    assert "generate (4 rows, 8 + 200 tokens a sequence): " in caplog.text and "packed for batch 4" in caplog.text
    assert torch.equal(short, _generate(plain, 4)) and torch.equal(long, _generate(plain, 200))
    assert unsaid.prepare(model) is model and _packed(model) == len(packable_layers(model, unsaid.dtype_name or ""))


def test_a_told_count_packs_at_prepare(path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(packed_weights, "PROBE_MIN_S", float("inf"))
    with simulate(PACKS_FP32):
        told = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=512)
    assert told.tuning is not None and not told.tuning.packing_at_generate
    assert told.to_dict()["tuning"]["packing_at_generate"] is False
    model = told.prepare(AutoModelForCausalLM.from_pretrained(path, **told.model_kwargs()).eval())
    assert _packed(model) > 0 and "generate" not in vars(model)


def test_a_pipeline_and_a_peft_model_meet_the_hook(path: Path, unsaid: wd.Resolution, monkeypatch: pytest.MonkeyPatch):
    from transformers import pipeline

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what a batched pipeline sets: put back after
    pipe = pipeline("text-generation", model=str(path), **unsaid.pipeline_kwargs())
    unsaid.prepare(pipe.model)
    pipe(["t1 t2 t3"] * 4, max_new_tokens=200, min_new_tokens=200, do_sample=False, batch_size=4)
    assert _packed(pipe.model) > 0 and "generate" not in vars(pipe.model)

    peft = pytest.importorskip("peft")
    base = unsaid.prepare(AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval())
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    _generate(adapted, 200)
    assert _packed(base) > 0  # LoRA's base layers are the plain Linear layers packed


def test_a_copied_or_saved_model_carries_the_hook_bound_to_itself(path: Path, unsaid: wd.Resolution):
    model = unsaid.prepare(AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval())
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert vars(other)["generate"].model is other
        _generate(other, 200)
        assert _packed(other) > 0 and _packed(model) == 0  # the copy packed itself, not the original
    remove_generate_hook(model)
    assert "generate" not in vars(model) and _packed(model) == 0


def test_someone_elses_generate_is_called_in_ours_and_comes_back(path: Path, unsaid: wd.Resolution):
    model = AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval()
    calls: list[int] = []
    own = model.generate

    def theirs(*args: Any, **kwargs: Any) -> Any:  # an instance-level generate of another library's
        calls.append(1)
        return own(*args, **kwargs)

    model.generate = theirs
    unsaid.prepare(model)
    assert vars(model)["generate"] is not theirs
    _generate(model, 200)
    assert calls == [1] and _packed(model) > 0
    assert vars(model)["generate"] is theirs  # decided: ours is gone, theirs is back


def test_a_packed_model_saves_and_loads_whole(path: Path):
    from whichdevice.tuning.packed_weights import install_packed_weights

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert install_packed_weights(model, "float32", 4)[0] > 0
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a bound method here was restored by a name the layer lacks
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.allclose(loaded(_ids()).logits, model(_ids()).logits, atol=1e-4)
    assert _packed(loaded) == 0  # the copy's layers run unpacked: a packed tensor is not saved
    assert install_packed_weights(loaded, "float32", 4)[0] == _packed(model)  # and it can pack itself


def _line(res: wd.Resolution, topic: str) -> str:
    return " | ".join(s.message for s in res.trace if s.topic == topic)
