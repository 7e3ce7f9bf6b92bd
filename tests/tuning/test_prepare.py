"""prepare() and unprepare() on the objects users pass: a transformers model, a PEFT model and a pipeline
are accepted (the transformers model inside is tuned), anything else is a DeviceError naming them; a
prepared model pickles, deepcopies and torch.saves like the unprepared one; unprepare takes it all back."""

from __future__ import annotations

import copy
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import whichdevice as wd
from simulated_cpus import PACKS_FP32
from tiny_models import save_tiny_llama
from whichdevice.measure.cpu_memory import packing_ops
from whichdevice.measure.packing_plan import PackingPlan
from whichdevice.testing import simulate
from whichdevice.tuning import packed_weights
from whichdevice.tuning.packed_weights import is_packed, packable_layers
from whichdevice.tuning.prepare import model_of, prepare, unprepare
from whichdevice.tuning.record import Tuning

PLAN = PackingPlan("float32", 4, 1.0, 0.5, 0.0, 0.1, 0.05, 8, 512, True)
EVERYTHING = Tuning(single_row=True, packing=PLAN, static_cache=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("prepare") / "tiny", dtype=torch.float32)


@pytest.fixture(autouse=True)
def _never_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    # A packing's own clock (tested in test_packed_weights) may stop a tiny model's packing on a busy machine.
    monkeypatch.setattr(packed_weights, "PROBE_MIN_S", float("inf"))


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tuned(model: torch.nn.Module) -> dict[str, bool]:
    return {
        "forward": "forward" in vars(model),
        "generate": "generate" in vars(model),
        "packed": any(is_packed(m) for m in model.modules()),
    }


PACKS = packing_ops(torch) is not None


def test_a_transformers_model_is_tuned_and_unprepare_takes_it_all_back(path: Path):
    model = _load(path)
    assert prepare(EVERYTHING, model) is model
    assert _tuned(model) == {"forward": True, "generate": True, "packed": PACKS}
    assert unprepare(model) is model
    assert _tuned(model) == {"forward": False, "generate": False, "packed": False}
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(hasattr(m, "_whichdevice_packed") or "forward" in vars(m) for m in model.modules())


def test_a_pipeline_is_its_model(path: Path):
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(path), dtype=torch.float32, device="cpu")
    plain = pipe("t1 t2 t3", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert prepare(EVERYTHING, pipe) is pipe and _tuned(pipe.model)["forward"]
    assert pipe("t1 t2 t3", max_new_tokens=4, do_sample=False)[0]["generated_text"] == plain
    unprepare(pipe)
    assert not any(_tuned(pipe.model).values())


def test_a_peft_model_tunes_its_base_model(path: Path):
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(_load(path), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    base = adapted.get_base_model()
    assert model_of(adapted) is base
    ids = torch.randint(5, 200, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
    assert prepare(EVERYTHING, adapted) is adapted
    assert _tuned(base) == {"forward": True, "generate": True, "packed": PACKS}
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
    unprepare(adapted)
    assert not any(_tuned(base).values())


@pytest.mark.parametrize(
    "thing",
    ["a string", None, 3, torch.nn.Linear(4, 4), {"model": 1}],
    ids=["str", "None", "int", "plain-module", "dict"],
)
def test_anything_else_is_an_error_naming_what_is_accepted(thing: object):
    for call in (lambda: prepare(EVERYTHING, thing), lambda: prepare(None, thing), lambda: unprepare(thing)):
        with pytest.raises(wd.DeviceError, match=r"prepare\(\) takes a transformers model \(PreTrainedModel"):
            call()
    hint = "pass the transformers model inside it"
    with pytest.raises(wd.DeviceError) as caught:
        prepare(None, thing)
    assert (hint in str(caught.value)) == isinstance(thing, torch.nn.Module)


def test_a_resolution_with_nothing_to_tune_still_checks_the_object(path: Path):
    res = wd.resolve_device("cpu", dtype="float32")
    assert res.tuning is None
    model = _load(path)
    assert res.prepare(model) is model and not any(_tuned(model).values())
    with pytest.raises(wd.DeviceError, match="PEFT model"):
        res.prepare("anything")


def test_a_prepared_model_pickles_deepcopies_and_saves_like_the_unprepared_one(path: Path):
    model = prepare(EVERYTHING, _load(path))
    ids = torch.randint(5, 200, (4, 8), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    expected = _load(path).generate(ids, **kwargs)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        assert vars(other)["forward"].model is other and vars(other)["generate"].model is other
        assert torch.equal(other.generate(ids, **kwargs), expected)
        assert all(type(p) is torch.nn.Parameter for p in other.parameters())
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert all(is_packed(m) for m in packable_layers(model, "float32")) == PACKS  # the original stays packed


def test_save_pretrained_writes_the_unprepared_models_files(path: Path, tmp_path: Path):
    """Nothing prepare() installs reaches the files: the same weights, and no static cache in the
    generation config (the wrapper passes it per call instead)."""
    model = prepare(EVERYTHING, _load(path))
    model.save_pretrained(tmp_path / "saved")
    _load(path).save_pretrained(tmp_path / "plain")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_the_resolutions_prepare_is_the_tunings(path: Path):
    with simulate(PACKS_FP32):
        res = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=512)
    assert res.tuning is not None and res.tuning.packing is not None and res.tuning.packing.told
    model = res.prepare(_load(path))
    assert _tuned(model) == {"forward": False, "generate": False, "packed": PACKS}
    res.unprepare(model)
    assert not any(_tuned(model).values())


@pytest.mark.parametrize("pause", ["at the second layer", "before the first layer"])
def test_unprepare_while_another_threads_generate_is_packing_leaves_nothing_packed(path: Path, monkeypatch, pause: str):
    """Issue 56: unprepare returned while the deferred packing went on, leaving 14 of 15 layers packed.
    Here the packing pauses (at its second layer, or once generate has decided to pack and before the
    first) until unprepare has been called from another thread."""
    real = packing_ops(torch)
    assert real is not None
    paused, resume = threading.Event(), threading.Event()
    packed_count: list[int] = []

    def wait_here() -> None:
        paused.set()
        resume.wait(60)

    def pack(weight: torch.Tensor, batch: int) -> torch.Tensor:
        packed_count.append(1)
        if len(packed_count) == 2 and pause == "at the second layer":
            wait_here()
        return real[0](weight, batch)

    install = packed_weights.install_packed_weights

    def install_after_a_pause(*args: Any, **kwargs: Any) -> tuple[int, str]:
        if pause == "before the first layer":
            wait_here()
        return install(*args, **kwargs)

    monkeypatch.setattr(packed_weights, "packing_ops", lambda torch: (pack, real[1]))
    monkeypatch.setattr(packed_weights, "install_packed_weights", install_after_a_pause)
    at_generate = Tuning(packing=PLAN._replace(told=False))
    model = prepare(at_generate, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    ids = torch.randint(5, 200, (4, 8), generator=torch.Generator().manual_seed(0))
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        except BaseException as error:
            errors.append(error)

    generating = threading.Thread(target=generate)
    generating.start()
    assert paused.wait(60), "the packing never started"
    undoing = threading.Thread(target=unprepare, args=(model,))
    undoing.start()
    undoing.join(0.5)  # unprepare is under way (it may wait for the packing) before the packing goes on
    resume.set()
    undoing.join(60)
    generating.join(60)
    assert errors == [] and not undoing.is_alive() and not generating.is_alive()
    assert not any(hasattr(m, "_whichdevice_packed") or "forward" in vars(m) for m in model.modules())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters()) and "generate" not in vars(model)
    assert len(packed_count) < len(packable_layers(model, "float32"))  # the packing stopped, not finished
