"""Attention the model supports: read from the installed transformers' classes, passed only when it
beats transformers' own pick, and what the README's headline pattern loads for every architecture.

``from_pretrained(path, **wd.resolve_device(model=path).model_kwargs())`` must load whatever plain
``from_pretrained(path)`` loads: on transformers 5.24, 148 of the 613 base model classes lack sdpa,
and passing ``attn_implementation="sdpa"`` to one of them raises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import whichdevice as wd
from tiny_models import TINY
from whichdevice.attention.decode import ATTENTION_NAME, VERIFIED_MODEL_TYPES
from whichdevice.core.packages import simulated_packages
from whichdevice.model.facts import attention_support
from whichdevice.model.support import support_flag, transformers_default
from whichdevice.testing import simulate

pytestmark = pytest.mark.slow

# model_type -> (tiny config keywords, the class to build and save, the Auto class a user loads it with)
WITHOUT_SDPA: dict[str, tuple[dict[str, Any], str, str]] = {
    "gemma2": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        ),
        "Gemma2ForCausalLM",
        "AutoModelForCausalLM",
    ),
    "bloom": (dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256), "BloomForCausalLM", "AutoModelForCausalLM"),
    "gpt_neo": (
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            vocab_size=256,
            max_position_embeddings=256,
            window_size=16,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "GPTNeoForCausalLM",
        "AutoModelForCausalLM",
    ),
    "mamba": (
        dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8),
        "MambaForCausalLM",
        "AutoModelForCausalLM",
    ),
    "deberta-v2": (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256),
        "DebertaV2ForMaskedLM",
        "AutoModelForMaskedLM",
    ),
    # all-mpnet-base-v2's architecture, loaded the way sentence-transformers loads it (AutoModel)
    "mpnet": (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256),
        "MPNetForMaskedLM",
        "AutoModel",
    ),
    "resnet": (
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3),
        "ResNetForImageClassification",
        "AutoModelForImageClassification",
    ),
}


def _save(model_type: str, path: Path) -> Path:
    import transformers

    keywords, class_name, _ = WITHOUT_SDPA[model_type]
    config = transformers.AutoConfig.for_model(model_type, **keywords)
    torch.manual_seed(0)
    getattr(transformers, class_name)(config).save_pretrained(path)
    return path


def _save_decoder(model_type: str, path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _run(model: Any, auto_class: str) -> None:
    """Generate (causal LMs) or run a forward pass, and check the output is finite."""
    with torch.inference_mode():
        if auto_class == "AutoModelForImageClassification":
            out = model(pixel_values=torch.randn(1, 3, 32, 32, dtype=model.dtype)).logits
        elif auto_class == "AutoModelForCausalLM":
            ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(0))
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
            assert generated.shape == (1, 10)
            out = model(input_ids=generated).logits
        else:
            ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(0))
            result = model(input_ids=ids, attention_mask=torch.ones_like(ids))
            out = result.logits if hasattr(result, "logits") else result.last_hidden_state
    assert torch.isfinite(out.float()).all()


def _attention_line(res: wd.Resolution) -> str:
    return next(s.message for s in res.trace if s.topic == "attention")


# ------------------------------------------------------------------ the "done when"


@pytest.mark.parametrize("model_type", sorted(WITHOUT_SDPA))
def test_every_family_without_sdpa_loads_with_the_resolution(model_type, tmp_path):
    import transformers

    path = _save(model_type, tmp_path / model_type)
    auto_class = WITHOUT_SDPA[model_type][2]
    res = wd.resolve_device(model=path)
    kwargs = res.model_kwargs()
    assert "attn_implementation" not in kwargs, res.explain()
    assert res.attn_implementation == "eager" and not res.attn_passed
    line = _attention_line(res)
    assert "_supports_sdpa=False" in line and f"transformers {transformers.__version__}" in line
    model = getattr(transformers, auto_class).from_pretrained(path, **kwargs).eval()
    assert model.config._attn_implementation == "eager"
    _run(model, auto_class)
    # pipeline() gets the same: nothing that would make it refuse the model
    assert "attn_implementation" not in wd.resolve_device(model=path).pipeline_kwargs()["model_kwargs"]


@pytest.mark.parametrize("model_type", sorted(VERIFIED_MODEL_TYPES))
def test_every_verified_decoder_loads_and_generates_with_the_resolution(model_type, tmp_path, cpu_kind):
    from transformers import AutoModelForCausalLM

    path = _save_decoder(model_type, tmp_path / model_type)
    res = wd.resolve_device(model=path)
    kwargs = res.model_kwargs()
    if cpu_kind.dtype == "bfloat16":  # sdpa handed over, and prepare() runs the decode attention in its place
        assert res.attn_implementation == "sdpa" and kwargs["attn_implementation"] == "sdpa"
        assert res.tuning is not None and res.tuning.decode_attention
    else:  # fp32 on this CPU: transformers' own sdpa, not passed
        assert res.attn_implementation == "sdpa" and "attn_implementation" not in kwargs
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    assert model.config._attn_implementation == res.attn_implementation
    res.prepare(model)
    prepared = res.tuning.attention_after_prepare(res.attn_implementation) if res.tuning else res.attn_implementation
    assert model.config._attn_implementation == prepared == (ATTENTION_NAME if cpu_kind.dtype == "bfloat16" else "sdpa")
    _run(model, "AutoModelForCausalLM")


# ------------------------------------------------------------------------- explicit requests


@pytest.mark.parametrize("asked", ["sdpa", ATTENTION_NAME, "flex_attention"])
def test_a_request_the_model_refuses_is_refused_with_the_fix(asked, tmp_path):
    path = _save("bloom", tmp_path / "bloom")
    with pytest.raises(wd.ConfigConflictError) as err:
        wd.resolve_device(model=path, attn_implementation=asked)
    message = str(err.value)
    flag = support_flag(asked)
    assert f"attn_implementation={asked!r}: BloomForCausalLM" in message and f"{flag}=False" in message
    assert "leave attn_implementation='auto' (transformers then picks eager itself) or pass 'eager'" in message


def test_flash_attention_asked_for_a_model_without_it_is_refused(tmp_path):
    path = _save("bloom", tmp_path / "bloom")
    refused = pytest.raises(wd.ConfigConflictError, match="_supports_flash_attn=False")
    with simulated_packages({"flash-attn": "2.8.3"}), simulate("cuda:1,cc=8.0"), refused:
        wd.resolve_device(model=path, attn_implementation="flash_attention_2")


def test_a_request_the_model_supports_is_passed_and_says_what_was_checked(tmp_path):
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", tokenizer=False)
    res = wd.resolve_device(model=path, attn_implementation="sdpa")
    assert res.model_kwargs()["attn_implementation"] == "sdpa" and res.attn_passed
    assert "supported by LlamaForCausalLM and" in _attention_line(res)
    eager = wd.resolve_device(model=_save("bloom", tmp_path / "bloom"), attn_implementation="eager")
    assert eager.model_kwargs()["attn_implementation"] == "eager"


def test_without_a_model_a_request_is_passed_as_asked():
    res = wd.resolve_device(attn_implementation="sdpa")
    assert res.model_kwargs()["attn_implementation"] == "sdpa" and _attention_line(res) == "sdpa: as you asked"


# ---------------------------------------------------------------------- FlashAttention, auto


def test_flash_attention_is_passed_only_for_a_model_that_supports_it(tmp_path):
    from tiny_models import tiny_config

    bloom = _save("bloom", tmp_path / "bloom")
    with simulated_packages({"flash-attn": "2.8.3"}), simulate("cuda:1,cc=8.0"):
        llama = wd.resolve_device(model=tiny_config())
        refused = wd.resolve_device(model=bloom)
        unknown = wd.resolve_device()
    assert llama.model_kwargs()["attn_implementation"] == "flash_attention_2"
    assert "supported by LlamaForCausalLM" in _attention_line(llama)
    assert refused.attn_implementation == "eager" and "attn_implementation" not in refused.model_kwargs()
    assert "flash_attention_2 not passed: BloomForCausalLM" in _attention_line(refused)
    assert unknown.attn_implementation is None and "attn_implementation" not in unknown.model_kwargs()
    assert "flash_attention_2 would fit" in _attention_line(unknown) and "pass model=" in _attention_line(unknown)


# ------------------------------------------------------------- what is read, and from where


def _config_folder(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_custom_code_is_left_to_its_own_classes(tmp_path):
    path = _config_folder(
        tmp_path / "custom",
        {"model_type": "llama", "architectures": ["MyLlama"], "auto_map": {"AutoModel": "modeling_my.MyLlama"}},
    )
    support = attention_support(path)
    assert support.unknown is not None and "auto_map" in support.unknown
    assert transformers_default(support) is None


def test_an_architecture_this_transformers_lacks_is_unknown(tmp_path):
    path = _config_folder(tmp_path / "future", {"model_type": "llama", "architectures": ["LlamaForTimeTravel"]})
    support = attention_support(path)
    assert support.unknown is not None and "LlamaForTimeTravel is not a class of transformers" in support.unknown


def test_every_auto_class_of_the_model_type_is_read(tmp_path):
    """The config says MPNetForMaskedLM; sentence-transformers loads AutoModel (MPNetModel)."""
    path = _config_folder(tmp_path / "mpnet", {"model_type": "mpnet", "architectures": ["MPNetForMaskedLM"]})
    names = [c.name for c in attention_support(path).classes]
    assert names[0] == "MPNetForMaskedLM" and "MPNetModel" in names


def test_sub_models_are_read_and_a_mixed_model_is_left_to_transformers(tmp_path):
    """A composite model: each sub-model checks its own class, so a vision tower without sdpa
    means transformers picks per part, and 'sdpa' asked for is refused."""
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {"model_type": "llama"},
        "vision_config": {"model_type": "resnet"},
    }
    support = attention_support(_config_folder(tmp_path / "mixed", config))
    assert "ResNetModel (vision_config)" in support.checked() and "LlamaModel (text_config)" in support.checked()
    assert transformers_default(support) is None
    assert "ResNetModel (vision_config) has _supports_sdpa=False" in (support.refusal("sdpa") or "")
    assert support.refusal("eager") is None


def test_a_simulated_transformers_version_is_not_answered_by_the_installed_classes(tmp_path):
    from tiny_models import tiny_config

    with simulated_packages({"transformers": "5.0.0"}):
        support = attention_support(tiny_config())
    assert support.unknown is not None and "5.0.0" in support.unknown


THREADS = """
import sys, threading
import whichdevice as wd
answers, start = [], threading.Barrier(8)

def resolve():
    start.wait()
    answers.append(wd.resolve_device(model=sys.argv[1]).attn_implementation)

threads = [threading.Thread(target=resolve) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(set(map(str, answers))), wd.resolve_device(model=sys.argv[1], refresh=True).attn_implementation)
"""


def test_threads_resolving_a_model_at_once_get_the_answer_one_thread_gets(tmp_path):
    # A fresh process, so the threads are the first to read the model's classes from transformers'
    # lazy module (which fails some of them while another imports the class's module).
    import subprocess
    import sys

    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    out = subprocess.run(
        [sys.executable, "-c", THREADS, str(folder)], capture_output=True, text=True, timeout=300, check=True
    ).stdout.strip()
    answers, alone = out.rsplit(" ", 1)
    assert answers == f"[{alone!r}]" and alone != "None", out


def test_flash_attn_package_is_no_reason_on_xpu_and_ascend_needs_none():
    from tiny_models import tiny_config

    # flash-attn has no XPU build: FlashAttention-2 there is the Hub kernel, which is opt-in.
    with simulated_packages({"flash-attn": "2.8.3"}), simulate("xpu:1"):
        xpu = wd.resolve_device(model=tiny_config())
    assert xpu.model_kwargs().get("attn_implementation") != "flash_attention_2"
    # The line says what is installed and why it is no reason, never "no FlashAttention package".
    assert "no FlashAttention package" not in _attention_line(xpu)
    assert f"flash-attn is installed but has no build for {xpu.backend.hardware}" in _attention_line(xpu)
    # Ascend runs FlashAttention-2 through torch_npu (transformers' integrations/npu_flash_attention.py).
    with simulate("npu:1"):
        npu = wd.resolve_device(model=tiny_config())
    assert npu.model_kwargs()["attn_implementation"] == "flash_attention_2"
    assert "torch_npu's own FlashAttention" in _attention_line(npu)
