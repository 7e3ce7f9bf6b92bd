"""unprepare() takes the tuning back wherever it sits in a chain of instance-level forwards: accelerate's
mixed-precision wrapper over ours (Accelerator.prepare), a user's decorator, or ours over theirs; the
others stay in place and keep working."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import save_tiny_llama
from whichdevice.tuning.onednn import holders
from whichdevice.tuning.prepare import prepare, unprepare
from whichdevice.tuning.record import Tuning
from whichdevice.tuning.single_row import _OneRowForward

SINGLE_ROW = Tuning(single_row=True)
IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("wrapped") / "tiny", dtype=torch.bfloat16, tokenizer=False)


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    # Accelerator's state is process-wide: each mixed precision needs a fresh one.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _load(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _onednn_seen(model: Any) -> list[tuple[int, bool]]:
    """(token rows, oneDNN on) as the first decoder layer sees each forward."""
    seen: list[tuple[int, bool]] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[0] * args[0].shape[1], torch._C._get_mkldnn_enabled()))
    )
    return seen


def _generate(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model.generate(
            input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, do_sample=False
        )
    return out


def _untouched(model: Any) -> None:
    """No forward toggles oneDNN: every one-row step ran with it on, and nothing holds it."""
    seen = _onednn_seen(model)
    _generate(model)
    assert [rows for rows, _ in seen] == [4, 1, 1] and all(on for _, on in seen), seen
    assert holders() == 0 and torch._C._get_mkldnn_enabled()


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_unprepare_reaches_under_accelerates_forward_wrapper(path: Path, precision: str):
    """Issue 54: with mixed_precision="bf16" accelerate wraps model.forward over ours at instance level;
    unwrap_model keeps it (keep_fp32_wrapper=True), and unprepare left our switch running under it."""
    from accelerate import Accelerator

    plain = _generate(_load(path))
    model = prepare(SINGLE_ROW, _load(path))
    try:
        accelerator = Accelerator(mixed_precision=precision, cpu=True)
    except (ValueError, RuntimeError) as err:  # what accelerate refuses on this CPU, in its own words
        pytest.skip(f"accelerate refuses mixed_precision={precision!r} on this CPU: {err}")
    model = accelerator.unwrap_model(accelerator.prepare(model))
    wrapped = accelerator.native_amp  # bf16 on a CPU: autocast and fp32 outputs around the forward
    top = vars(model).get("forward")
    assert isinstance(top, _OneRowForward) != wrapped  # accelerate's wrapper on top, or ours still is
    assert unprepare(model) is model
    assert vars(model).get("forward") is (top if wrapped else None)  # accelerate's wrapper stays where it was...
    _untouched(model)
    with torch.inference_mode():
        logits = model(input_ids=IDS).logits
    assert logits.dtype == (torch.float32 if wrapped else torch.bfloat16)  # ...and still does its work
    if not wrapped:
        assert torch.equal(_generate(model), plain)
    # prepare() again: tuned once more, under the same wrapper, and taken back again.
    prepare(SINGLE_ROW, model)
    seen = _onednn_seen(model)
    _generate(model)
    assert [on for rows, on in seen if rows == 1] == [False, False]
    unprepare(model)
    _untouched(model)


@pytest.mark.usefixtures("fresh_accelerate")
def test_an_earlier_wrapper_under_ours_is_put_back(path: Path):
    """docs/tuning.md: prepare() after accelerate's wrapper, then unprepare(): accelerate's forward is back."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.unwrap_model(accelerator.prepare(_load(path)))
    theirs = vars(model)["forward"]
    prepare(SINGLE_ROW, model)
    assert vars(model)["forward"] is not theirs
    unprepare(model)
    assert vars(model)["forward"] is theirs
    _untouched(model)


def _with_wraps(forward: Any) -> Any:
    @functools.wraps(forward)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return logged


def _closure_only(forward: Any) -> Any:
    def plain(*args: Any, **kwargs: Any) -> Any:  # no __wrapped__: ours is reachable only through the closure
        return forward(*args, **kwargs)

    return plain


@pytest.mark.parametrize("decorate", [_with_wraps, _closure_only], ids=["functools.wraps", "closure"])
def test_a_users_decorator_over_ours_stays_and_ours_is_taken_back(path: Path, decorate: Any):
    model = prepare(SINGLE_ROW, _load(path))
    calls: list[int] = []
    inner = decorate(model.forward)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    model.forward = counted
    unprepare(model)
    assert vars(model)["forward"] is counted
    _untouched(model)
    assert len(calls) == 3  # the prompt and two steps: the user's decorator still runs every forward


def test_a_peft_model_under_accelerate_is_taken_back_too(path: Path, fresh_accelerate: None):
    peft = pytest.importorskip("peft")
    from accelerate import Accelerator

    adapted = peft.get_peft_model(_load(path), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    prepare(SINGLE_ROW, adapted)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    adapted = accelerator.unwrap_model(accelerator.prepare(adapted))
    unprepare(adapted)
    base = adapted.get_base_model()
    seen = _onednn_seen(base)
    with torch.inference_mode():
        adapted.generate(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, do_sample=False)
    assert seen and all(on for _, on in seen), seen


def test_the_generate_wrapper_is_taken_back_from_under_a_users_too(path: Path):
    model = _load(path)
    passed: list[dict[str, Any]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:  # an instance-level generate before ours: sees what ours passes
        passed.append(dict(kwargs))
        return type(model).generate(model, *args, **kwargs)

    model.generate = recorded
    prepare(Tuning(static_cache=True), model)
    model.generate = _with_wraps(model.generate)  # a user's decorator over ours
    _generate(model)
    unprepare(model)
    _generate(model)
    assert [p.get("cache_implementation") for p in passed] == ["static", None]
