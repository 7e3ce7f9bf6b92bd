"""generate's compiled static cache: handed over on an NVIDIA GPU, for a job long enough to repay the
compile and inside what was measured; nothing anywhere else. prepare() passes it to generate calls
that set no cache of their own, and writes nothing into the model's generation_config."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.core.job import Job, new_tokens
from whichdevice.model.support import support_of_config
from whichdevice.testing import simulate
from whichdevice.tuning.static_cache import COMPILE_MARGIN, COMPILE_PAYS_AFTER_STEPS, MEASURED_WEIGHT_BYTES

H200 = "cuda:1,cc=9.0,mem=141GiB,name=NVIDIA H200"
# A CUDA host's torch brings triton, which torch.compile builds its GPU kernels with; this CPU's does not.
TRITON = {"triton": "simulated"}
NEEDED = math.ceil(COMPILE_PAYS_AFTER_STEPS * COMPILE_MARGIN)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("generation") / "llama", dtype=torch.bfloat16, tokenizer=False)


def _static(res: wd.Resolution) -> bool:
    return res.tuning is not None and res.tuning.static_cache


def _generation_lines(res: wd.Resolution) -> list[str]:
    return [step.message for step in res.trace if step.topic == "generation"]


def test_a_long_job_on_an_nvidia_gpu_gets_the_static_cache(llama: Path) -> None:
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(llama), max_new_tokens=NEEDED, max_length=NEEDED + 32)
    assert _static(res)
    assert res.generate_kwargs() == {"cache_implementation": "static"}
    assert res.to_dict()["generate_kwargs"] == {"cache_implementation": "static"}
    (line,) = _generation_lines(res)
    assert f"this job generates {NEEDED} tokens a sequence" in line
    assert str(COMPILE_PAYS_AFTER_STEPS) in line


def test_a_short_job_keeps_generates_own_cache_and_says_how_long_would_pay(llama: Path) -> None:
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(llama), max_new_tokens=NEEDED - 1, max_length=NEEDED + 31)
    assert not _static(res)
    assert res.generate_kwargs() == {}
    (line,) = _generation_lines(res)
    assert f"{NEEDED - 1} new tokens a sequence do not repay the compile" in line
    assert f"handed over from {NEEDED}" in line


def test_unsaid_new_tokens_are_half_of_max_length(llama: Path) -> None:
    with simulate(H200, packages=TRITON):
        long = wd.resolve_device(model=str(llama), max_length=2 * NEEDED)
        short = wd.resolve_device(model=str(llama), max_length=2 * NEEDED - 2)
    assert _static(long) and not _static(short)


@pytest.mark.parametrize(
    ("spec", "kwargs", "reason"),
    [
        (H200, {"batch_size": 8}, "measured up to batch 4"),
        (H200, {"dtype": "float32"}, "measured for bf16 and fp16 weights, and these load as float32"),
        (H200, {"attn_implementation": "eager"}, "measured with sdpa attention, and this load runs eager"),
        (H200, {"device_map": {"": "cuda:0"}}, "the model is not whole on cuda:0"),
        ("cuda:2,cc=9.0,mem=80GiB,name=NVIDIA H100", {"device_map": "auto"}, "not whole on cuda:0"),
    ],
)
def test_outside_what_was_measured_generate_keeps_its_own_cache(
    llama: Path, spec: str, kwargs: dict[str, object], reason: str
) -> None:
    with simulate(spec, packages=TRITON):
        res = wd.resolve_device(model=str(llama), max_new_tokens=10 * NEEDED, max_length=10 * NEEDED + 32, **kwargs)
    assert not _static(res) and res.generate_kwargs() == {}
    (line,) = _generation_lines(res)
    assert line.startswith("generate's own cache, not a compiled static one: ")
    assert reason in line


def test_amd_gpus_the_cpu_and_training_get_nothing_and_say_nothing(llama: Path) -> None:
    job = {"model": str(llama), "max_new_tokens": 10 * NEEDED, "max_length": 10 * NEEDED + 32}
    with simulate("cuda:1,variant=rocm"):
        rocm = wd.resolve_device(**job)
    with simulate(H200, packages=TRITON):
        training = wd.resolve_device(task="training", model=str(llama), batch_size=1, max_length=64)
    cpu = wd.resolve_device("cpu", **job)
    for res in (rocm, training, cpu):
        assert not _static(res) and res.generate_kwargs() == {}
        assert not any("static" in line for line in _generation_lines(res))


def test_a_resolution_told_nothing_of_a_job_says_nothing(llama: Path) -> None:
    with simulate(H200, packages=TRITON):
        plain = wd.resolve_device()
        model_only = wd.resolve_device(model=str(llama))
    assert _generation_lines(plain) == [] and _generation_lines(model_only) == []


def test_without_model_the_trace_asks_for_it() -> None:
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(max_new_tokens=10 * NEEDED)
    (line,) = _generation_lines(res)
    assert "pass model=" in line and not _static(res)


def test_a_model_larger_than_measured_is_left_to_transformers() -> None:
    # The weights a decode step reads, past the largest measured (the 1.1B's): bf16, 2 bytes each.
    from whichdevice.model.step_weights import StepWeights
    from whichdevice.tuning.static_cache import _outside_measured

    job = Job(batch_size=1, max_new_tokens=10 * NEEDED)
    stored = SimpleNamespace(step_weights=lambda: StepWeights(int(MEASURED_WEIGHT_BYTES / 2) + 1, 155))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    facts = SimpleNamespace(adapter=None, config=config, stored=stored)
    reason = _outside_measured("bfloat16", "sdpa", facts, job)  # type: ignore[arg-type]
    assert reason is not None and "more than the 2.1 GB measured" in reason


def test_compile_support_is_read_from_the_installed_classes() -> None:
    # transformers' own flag: Llama's classes set _can_compile_fullgraph, MPT's do not.
    llama = support_of_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    mpt = support_of_config({"model_type": "mpt", "architectures": ["MptForCausalLM"]})
    assert llama.not_compiling() is None
    refusal = mpt.not_compiling()
    assert refusal is not None and refusal.startswith("MptForCausalLM") and "_can_compile_fullgraph=False" in refusal


def test_new_tokens_are_said_or_half_of_max_length() -> None:
    assert new_tokens(Job(max_new_tokens=7, max_length=100)) == 7
    assert new_tokens(Job(max_length=101)) == 51
    assert new_tokens(Job(batch_size=4)) is None


def test_the_keywords_run_in_the_installed_generate_and_prepare_keeps_the_users_setting(llama: Path) -> None:
    """The handed-over keyword on the real LlamaForCausalLM.generate (on this CPU generate does not
    compile; the static cache is the same): greedy output equals generate's own cache."""
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(llama), max_new_tokens=NEEDED, max_length=NEEDED + 8)
    model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **kwargs)
    static = model.generate(ids, **kwargs, **res.generate_kwargs())
    assert torch.equal(plain, static)

    res.prepare(model)
    assert model.generation_config.cache_implementation is None  # nothing written that save_pretrained keeps
    out = model.generate(ids, **kwargs, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and type(out.past_key_values).__name__ == "StaticCache"
    model.generation_config.cache_implementation = "dynamic"  # the user's own setting is kept
    assert type(model.generate(ids, **kwargs, return_dict_in_generate=True).past_key_values).__name__ != "StaticCache"
    model.generation_config.cache_implementation = None
    own = model.generate(ids, **kwargs, return_dict_in_generate=True, cache_implementation="dynamic")
    assert type(own.past_key_values).__name__ != "StaticCache"  # and the call's own
    res.unprepare(model)
    assert "generate" not in vars(model)


def test_the_report_carries_the_keywords_through_json(llama: Path) -> None:
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(llama), max_new_tokens=NEEDED, max_length=NEEDED + 32)
    assert json.loads(json.dumps(res.to_dict()))["generate_kwargs"] == {"cache_implementation": "static"}


def test_a_text_generation_pipeline_runs_with_the_prepared_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client code that never calls generate itself: a pipeline's model, prepared, generates through
    the static cache and gives the same greedy text."""
    from transformers import pipeline

    path = save_tiny_llama(tmp_path / "llama", dtype=torch.bfloat16)
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(path), max_new_tokens=NEEDED, max_length=NEEDED + 8)
    pipe = pipeline("text-generation", model=str(path), dtype=torch.float32, device="cpu")
    kwargs = {"max_new_tokens": 5, "do_sample": False}
    plain = pipe("hello world", **kwargs)[0]["generated_text"]
    res.prepare(pipe)
    made = []  # generate builds a static cache for the call: the pipeline took the model's setting
    build = pipe.model._prepare_static_cache
    monkeypatch.setattr(pipe.model, "_prepare_static_cache", lambda **kw: made.append(kw) or build(**kw))
    assert pipe("hello world", **kwargs)[0]["generated_text"] == plain
    assert len(made) == 1


def test_a_peft_adapter_is_left_to_transformers(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    base = save_tiny_llama(tmp_path / "base", dtype=torch.bfloat16, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "adapter"
    )
    with simulate(H200, packages=TRITON):
        res = wd.resolve_device(model=str(tmp_path / "adapter"), max_new_tokens=NEEDED, max_length=NEEDED + 32)
    assert not _static(res)
    (line,) = _generation_lines(res)
    assert "PEFT adapter" in line


@pytest.mark.parametrize(
    ("spec", "packages", "reason"),
    [
        (H200, {"triton": None}, "triton, which is not installed (pip install triton, at the version"),
        (
            "cuda:1,cc=6.0,mem=16GiB,name=Tesla P100-PCIE-16GB",
            TRITON,
            "needs compute capability 7.0 or more, and a GPU here has compute capability 6.0",
        ),
    ],
)
def test_where_torch_compile_cannot_build_the_step_generate_keeps_its_own_cache(
    llama: Path, spec: str, packages: dict[str, str | None], reason: str
) -> None:
    # torch/utils/_triton.py has_triton(): triton, and CUDA devices of compute capability 7.0 or more.
    with simulate(spec, packages=packages):
        res = wd.resolve_device(
            model=str(llama), dtype="float16", max_new_tokens=10 * NEEDED, max_length=10 * NEEDED + 32
        )
    assert not _static(res) and res.generate_kwargs() == {}
    (line,) = _generation_lines(res)
    assert reason in line


def test_torch_compile_turned_off_keeps_generates_own_cache_and_is_part_of_the_memo(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = {"model": str(llama), "max_new_tokens": NEEDED, "max_length": NEEDED + 32}
    with simulate(H200, packages=TRITON):
        before = wd.resolve_device(**job)
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
        off = wd.resolve_device(**job)
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
        on_again = wd.resolve_device(**job)
    assert _static(before) and _static(on_again) and not _static(off)
    (line,) = _generation_lines(off)
    assert "TORCH_COMPILE_DISABLE=1 turns torch.compile off" in line
