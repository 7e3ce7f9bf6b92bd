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
from simulated_cpus import PACKS
from tiny_models import save_tiny_llama
from whichdevice.hardware.probes.cpu_memory import packing_ops
from whichdevice.precision import packed_weights
from whichdevice.precision.packed_weights import packable_layers
from whichdevice.precision.packing_plan import (
    DEFAULT_NEW_TOKENS,
    PACK_MARGIN,
    PackingPlan,
    call_tokens,
    remove_packing_hook,
)
from whichdevice.testing import simulate

PLAN = PackingPlan(
    batch=4,
    step_s=1.0,
    packed_step_s=0.5,
    pack_s=10.0,
    prompt_token_s=0.1,
    packed_prompt_token_s=0.05,
    prompt_tokens=10,
    new_tokens=64,
    told=False,
)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("plan") / "tiny", dtype=torch.float32)


@pytest.fixture
def unsaid(path: Path, monkeypatch: pytest.MonkeyPatch) -> wd.Resolution:
    # The simulated figures' budget for this tiny model is milliseconds, which a busy machine's
    # packing can pass: the budget has its own test (test_packed_weights), so here it never stops it.
    monkeypatch.setattr(packed_weights, "PROBE_MIN_S", float("inf"))
    with simulate(PACKS):
        return wd.resolve_device(model=str(path), batch_size=4, max_length=1024)


def _packed(model: Any) -> int:
    """The layers that run from a packed copy (a copied or loaded layer keeps an empty one)."""
    return sum(getattr(getattr(m, "_whichdevice_packed", None), "tensor", None) is not None for m in model.modules())


def _ids(batch: int = 4, length: int = 8) -> torch.Tensor:
    return torch.randint(5, 200, (batch, length), generator=torch.Generator().manual_seed(0))


def _generate(model: Any, new: int, **kwargs: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(_ids(), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def _plain(prompt: int, new: int) -> float:
    return prompt * 0.1 + (new - 1) * 1.0  # the prompt's forward makes the first new token


def _packed_run(prompt: int, new: int) -> float:
    return prompt * 0.05 + (new - 1) * 0.5


def test_the_budget_follows_the_estimates_rule():
    # It is tried from the count on where the whole job, packing at the calibration's 10 s included,
    # is PACK_MARGIN faster packed; its budget is what the packing may take and leave it that much faster.
    assert PLAN.budget_s(10, 20) is None  # 20 against 19.5 + 10: no gain at all
    needed = next(n for n in range(1, 1000) if PLAN.budget_s(10, n) is not None)
    assert _plain(10, needed) >= (_packed_run(10, needed) + 10) * PACK_MARGIN
    assert _plain(10, needed - 1) < (_packed_run(10, needed - 1) + 10) * PACK_MARGIN
    assert PLAN.budget_s(10, 501) == pytest.approx(_plain(10, 501) / PACK_MARGIN - _packed_run(10, 501))
    assert PLAN.budget_for_job == pytest.approx(_plain(10, 64) / PACK_MARGIN - _packed_run(10, 64))  # its counts


def test_the_prompt_run_packed_counts_toward_the_packing():
    # A long prompt and few new tokens: the prompt's packed speed alone repays the packing.
    unpacked_prompt = PLAN._replace(packed_prompt_token_s=PLAN.prompt_token_s)
    assert unpacked_prompt.budget_s(2000, 4) is None
    assert PLAN.budget_s(2000, 4) == pytest.approx(_plain(2000, 4) / PACK_MARGIN - _packed_run(2000, 4))


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
    assert unsaid.packing_at_generate and unsaid.packed_for_batch == 4 and unsaid.to_dict()["packing_at_generate"]
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
    with simulate(PACKS):
        told = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=512)
    assert not told.packing_at_generate and told.to_dict()["packing_at_generate"] is False
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
    remove_packing_hook(model)
    assert "generate" not in vars(model) and _packed(model) == 0


def test_someone_elses_generate_is_left_alone(path: Path, unsaid: wd.Resolution):
    model = AutoModelForCausalLM.from_pretrained(path, **unsaid.model_kwargs()).eval()
    theirs = model.generate
    model.generate = theirs  # an instance-level generate of another library's
    unsaid.prepare(model)
    assert vars(model)["generate"] is theirs


@pytest.mark.skipif(packing_ops(torch) is None, reason="this torch has no oneDNN packing ops")
def test_a_packed_model_saves_and_loads_whole(path: Path):
    from whichdevice.precision.packed_weights import install_packed_weights

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
