"""serving=True: continuous batching (model.generate_batch) on the CPU with what the resolution hands over,
checked against the installed transformers' own signatures and its attention rule."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.attention.decode import ATTENTION_NAME
from whichdevice.attention.serving import continuous_batching_available, generate_batch_refusal
from whichdevice.testing import simulate

PROMPTS = [[1, 5, 9, 14, 3], [7, 2], [11, 12, 13, 40, 41, 42, 43, 8]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("serving") / "llama", tokenizer=False)


def _lines(res: wd.Resolution) -> str:
    return "\n".join(s.message for s in res.trace if s.topic == "serving")


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_the_handed_over_keywords_are_generate_batchs_own() -> None:
    from transformers import LlamaForCausalLM
    from transformers.generation import ContinuousBatchingConfig

    assert continuous_batching_available()[0]
    res = wd.resolve_device("cpu", serving=True, dtype="bfloat16")
    kwargs = res.generate_batch_kwargs()
    # Read, not typed: generate_batch's parameters and the config's fields on this transformers.
    assert set(kwargs) <= set(inspect.signature(LlamaForCausalLM.generate_batch).parameters)
    config = kwargs["continuous_batching_config"]
    assert isinstance(config, ContinuousBatchingConfig) and config.auto_switch_to_flash is False
    assert set(res.serving.config) <= {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert res.to_dict()["serving"] == {"applies": True, "continuous_batching_config": {"auto_switch_to_flash": False}}
    lines = _lines(res)
    assert "continuous batching applies" in lines and "auto_switch_to_flash=False" in lines
    # On a CPU without the job's sizes, the cache would take the machine's free memory: said, with the fix.
    warning = "\n".join(s.message for s in res.trace if s.topic == "warning")
    assert "sizes its cache and attention mask from the machine's free memory" in warning
    assert "pass batch_size= (requests at once) and max_length=" in warning
    sized = wd.resolve_device("cpu", serving=True, dtype="bfloat16", batch_size=3, max_length=300)
    config = sized.generate_batch_kwargs()["continuous_batching_config"]
    page = ContinuousBatchingConfig().page_size  # the installed default, read
    assert (config.num_blocks, config.max_batch_tokens) == (3 * -(-300 // page), 900)
    assert f"num_blocks={config.num_blocks}, max_batch_tokens=900" in _lines(sized)
    with simulate("cuda:1"):  # a GPU's own memory: its sizing is transformers'
        gpu = wd.resolve_device(serving=True, dtype="bfloat16", batch_size=3, max_length=300)
    assert set(gpu.serving.config) == {"auto_switch_to_flash"}
    assert "left to transformers: the cache's blocks" in _lines(gpu)


def test_generate_batch_runs_on_this_cpu_with_what_is_handed_over(path: Path) -> None:
    """The real thing: from_pretrained with model_kwargs(), generate_batch with generate_batch_kwargs();
    its greedy tokens are generate()'s, and the model still runs the attention announced."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    longest = max(map(len, PROMPTS)) + NEW_TOKENS
    res = wd.resolve_device(model=str(path), dtype="bfloat16", serving=True, batch_size=2, max_length=longest)
    assert res.attn_implementation != ATTENTION_NAME and (res.tuning is None or not res.tuning.decode_attention)
    assert set(res.serving.config) == {"auto_switch_to_flash", "num_blocks", "max_batch_tokens"}
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval()
    announced = model.config._attn_implementation
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    # Three requests for a job sized for two: the third waits for blocks, and every one completes.
    outputs = model.generate_batch(PROMPTS, generation_config=config, **res.generate_batch_kwargs())
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in outputs.values()}
    model.set_attn_implementation(announced)  # generate_batch leaves it as paged|...; generate() as loaded
    for prompt in PROMPTS:
        assert by_prompt[tuple(prompt)] == _greedy(model, prompt), prompt
    assert announced in ("sdpa", "eager") and "flash" not in announced
    # A request longer than max_length still completes (it takes more than its share of blocks).
    longer = GenerationConfig(max_new_tokens=300, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs = model.generate_batch(PROMPTS[:2], generation_config=longer, **res.generate_batch_kwargs())
    assert sorted(len(out.generated_tokens) for out in outputs.values()) == [300, 300]


def test_the_cpu_decode_attention_is_not_chosen_for_serving_and_would_crash_generate_batch(path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    plain = wd.resolve_device(model=str(path), dtype="bfloat16")
    serving = wd.resolve_device(model=str(path), dtype="bfloat16", serving=True)
    assert serving.tuning is None or not serving.tuning.decode_attention
    attention = next(s.message for s in serving.trace if s.topic == "attention")
    if plain.tuning is not None and plain.tuning.decode_attention:  # chosen for generate() (the CPU's measure decides)
        assert f"{ATTENTION_NAME} not passed for serving=True: model.generate_batch refuses it" in attention
    # Why: a model running it (prepare() installs it under the sdpa handed over) is refused by generate_batch.
    asked = wd.resolve_device(model=str(path), dtype="bfloat16", attn_implementation=ATTENTION_NAME)
    model = asked.prepare(AutoModelForCausalLM.from_pretrained(path, **asked.model_kwargs()).eval())
    assert model.config._attn_implementation == ATTENTION_NAME
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch(PROMPTS[:1], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))


def test_asking_for_an_attention_generate_batch_refuses_names_the_fix(path: Path) -> None:
    for name in (ATTENTION_NAME, "flex_attention"):
        with pytest.raises(wd.ConfigConflictError) as err:
            wd.resolve_device("cpu", serving=True, attn_implementation=name)
        text = str(err.value)
        assert f"attn_implementation={name!r} with serving=True" in text and "not supported for continuous" in text
        assert "pass 'sdpa'" in text
    for name in ("sdpa", "eager"):  # generate_batch runs eager as paged|eager
        assert wd.resolve_device("cpu", serving=True, attn_implementation=name).serving.applies
    assert generate_batch_refusal("flash_attention_2") is None and generate_batch_refusal(None) is None


def test_bad_serving_values_and_tasks_are_refused() -> None:
    with pytest.raises(wd.DeviceError, match="serving='yes': pass True or False"):
        wd.resolve_device("cpu", serving="yes")
    with pytest.raises(wd.ConfigConflictError, match="serving requests is inference"):
        wd.resolve_device("cpu", serving=True, task="training")


def test_no_serving_says_nothing_and_hands_nothing() -> None:
    res = wd.resolve_device("cpu", dtype="bfloat16", batch_size=8)
    assert res.serving is None and res.generate_batch_kwargs() == {} and not _lines(res)
    assert res.to_dict()["serving"] is None


@pytest.mark.parametrize(
    ("spec", "dtype", "switch"),
    [
        ("cuda:1", "bfloat16", False),  # no FlashAttention package here: the switch would fetch a Hub kernel
        ("cuda:1", "float32", None),  # transformers switches fp16/bf16 models only
        ("cuda:1,cc=7.5,name=Tesla T4", "float16", False),
        ("hpu:8", "bfloat16", False),
        ("cpu", "bfloat16", False),
    ],
)
def test_auto_switch_to_flash_is_handed_over_only_where_no_flash_fits(
    spec: str, dtype: str, switch: bool | None
) -> None:
    with simulate(spec):
        res = wd.resolve_device(serving=True, dtype=dtype)
    assert res.serving is not None and res.serving.applies
    assert res.serving.config.get("auto_switch_to_flash") is switch
    if switch is None:
        assert res.generate_batch_kwargs() == {} and "auto_switch_to_flash left to transformers" in _lines(res)


def test_installed_flash_attn_that_fits_is_left_to_the_switch() -> None:
    flash = {"flash-attn": "2.8.3"}
    with simulate("cuda:1,cc=8.0", packages=flash):
        res = wd.resolve_device(serving=True, dtype="bfloat16")
    assert "auto_switch_to_flash" not in res.serving.config
    assert "flash-attn is installed and fits" in _lines(res)
    with simulate("cuda:1,cc=7.5,name=Tesla T4", packages=flash):  # installed, below its capability floor
        res = wd.resolve_device(serving=True, dtype="float16")
    assert res.serving.config == {"auto_switch_to_flash": False}


def test_hub_kernels_opted_into_leave_the_switch_to_transformers() -> None:
    with simulate("cuda:1"):
        res = wd.resolve_device(serving=True, dtype="bfloat16", use_kernels="auto")
    if res.use_kernels:
        assert "auto_switch_to_flash" not in res.serving.config and "you opted into" in _lines(res)
    else:  # kernels not usable here (version range): the switch could not fetch one either way
        assert res.serving.config == {"auto_switch_to_flash": False}


def test_without_generate_batch_nothing_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    from whichdevice.attention import serving

    monkeypatch.setattr(serving, "continuous_batching_available", lambda: (False, "transformers 4.40 has none"))
    res = wd.resolve_device("cpu", serving=True, dtype="bfloat16", refresh=True)
    assert res.serving is not None and not res.serving.applies and res.generate_batch_kwargs() == {}
    assert "continuous batching does not apply: transformers 4.40 has none" in _lines(res)


def test_a_serving_job_is_not_handed_generates_static_cache(path: Path) -> None:
    """generate_batch takes none of generate()'s keywords: the static cache a long generate() job gets
    on an NVIDIA GPU is not decided, said or handed over for serving."""
    from whichdevice.tuning.static_cache import COMPILE_MARGIN, COMPILE_PAYS_AFTER_STEPS

    needed = int(COMPILE_PAYS_AFTER_STEPS * COMPILE_MARGIN) + 1
    job = {"model": str(path), "dtype": "bfloat16", "max_new_tokens": needed, "max_length": needed + 32}
    with simulate("cuda:1,cc=9.0,mem=141GiB,name=NVIDIA H200", packages={"triton": "simulated"}):
        plain = wd.resolve_device(**job)
        serving = wd.resolve_device(serving=True, **job)
    assert plain.generate_kwargs() == {"cache_implementation": "static"}
    assert serving.generate_kwargs() == {} and not [s for s in serving.trace if s.topic == "generation"]
    assert serving.serving is not None and serving.serving.applies


def test_a_gpu_without_flash_attention_hears_that_transformers_turns_graphs_and_async_batching_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with simulate("cuda:1,cc=9.0,name=NVIDIA H100 80GB HBM3"):
        plain = wd.resolve_device(serving=True, dtype="bfloat16")
    with simulate("cuda:1,cc=9.0,name=NVIDIA H100 80GB HBM3", packages={"flash-attn": "2.8.3"}):
        flash = wd.resolve_device(serving=True, dtype="bfloat16")
    with simulate("hpu:1"):  # no graphs in transformers' continuous batching: nothing to say
        gaudi = wd.resolve_device(serving=True, dtype="bfloat16")
    said = _lines(plain)
    assert "accelerator graphs and async batching off" in said and "CUDAGraphs on only" in said
    assert "use_cuda_graph=True, use_async_batching=True" in said
    assert "graphs and async batching off" not in _lines(flash) + _lines(gaudi)
    # The statement is transformers' own rule: with use_cuda_graph and use_async_batching unset, a model that needs
    # an attention mask (sdpa, eager) gets neither, on a device that has graphs; FlashAttention gets both.
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    for mask_needed, expected in ((True, False), (False, True)):
        config = ContinuousBatchingConfig()
        initialization.decide_use_cuda_graphs(config, is_attn_mask_needed=mask_needed, cuda_graph_requested=False)
        initialization.decide_use_async_batching(config, is_attn_mask_needed=mask_needed)
        assert (any(config.cuda_graph_booleans), config.use_async_batching) == (expected, expected)
