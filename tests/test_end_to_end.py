"""End to end on this machine: tiny checkpoints in fp16, bf16 and fp32 through from_pretrained and pipeline,
and other architectures through what a resolution hands over."""

from __future__ import annotations

import pytest
import torch

import whichdevice as wd
from simulated_cpus import PACKS
from whichdevice.attention.decode import ATTENTION_NAME
from whichdevice.measure.cpu_memory import packable_dtypes
from whichdevice.testing import simulate

# What this CPU's oneDNN packs (a real try, outside any simulation): the simulated CPU hands bf16 packing
# over, and where this one cannot pack bf16, prepare() refuses and the model runs as it was.
PACKS_HERE = packable_dtypes()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16, torch.float32], ids=str)
def checkpoint(request, tmp_path_factory):
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("ckpt"), request.param)


def test_from_pretrained_and_generate(checkpoint, cpu_kind):
    from transformers import AutoModelForCausalLM

    res = wd.resolve_device(model=checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **res.model_kwargs())
    # Whatever dtype the checkpoint was saved in, it runs in the one chosen for this CPU:
    # bf16 where bf16 is native, fp32 where it would be emulated.
    assert res.dtype_name == cpu_kind.dtype
    assert model.dtype == res.dtype
    assert str(model.device) == res.device == "cpu"
    # The keywords name sdpa; in bf16 prepare() runs the decode attention in its place (sdpa for the prompt,
    # the query heads grouped by key/value head for each one-token step); fp32: sdpa.
    assert model.config._attn_implementation == res.attn_implementation == "sdpa"
    res.prepare(model)
    want = ATTENTION_NAME if cpu_kind.dtype == "bfloat16" else "sdpa"
    assert model.config._attn_implementation == want
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)


def test_pipeline(checkpoint):
    from transformers import pipeline

    res = wd.resolve_device(model=checkpoint)
    pipe = pipeline("text-generation", model=str(checkpoint), **res.pipeline_kwargs())
    assert pipe.model.dtype == res.dtype
    assert pipe.device.type == "cpu"
    text = pipe("t1 t2 t3", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("t1 t2 t3") and len(text) > len("t1 t2 t3")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "phi", "gpt_neox", "bloom", "gpt2", "mixtral", "t5", "bart"])
def test_other_architectures_generate_the_same_tokens_with_what_the_resolution_hands_over(tmp_path, model_type, batch):
    """The user's path on architectures other than Llama: resolve_device(model=), from_pretrained with
    its keywords, prepare(), generate; against a plain load in the same dtype, token for token."""
    from tiny_models import save_tiny

    auto = save_tiny(model_type, tmp_path, torch.bfloat16)
    new = 40 if batch == 1 else 200  # packing repays its copy over enough new tokens
    with simulate(PACKS):
        res = wd.resolve_device(model=str(tmp_path), batch_size=batch, max_length=16 + new, max_new_tokens=new)
    tuning = res.tuning
    assert tuning is not None and (tuning.single_row, tuning.packed_for_batch) == (
        (True, None) if batch == 1 else (False, 4)
    )
    model = auto.from_pretrained(tmp_path, **res.model_kwargs()).eval()
    res.prepare(model)
    plain = auto.from_pretrained(tmp_path, dtype=model.dtype).eval()
    ids = torch.randint(3, 256, (batch, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        assert torch.equal(tokens, plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs))
    packed = sum(getattr(m, "_whichdevice_packed", None) is not None for m in model.modules())
    if batch == 4 and res.dtype_name in PACKS_HERE:
        assert packed >= 1  # generate packed (the clock may stop part-way)
    else:  # batch 1 packs nothing; nor does a CPU whose oneDNN cannot pack this dtype (the same tokens)
        assert packed == 0
