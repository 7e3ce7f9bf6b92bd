"""End to end on this machine: tiny checkpoints in fp16, bf16 and fp32 through from_pretrained and pipeline."""

from __future__ import annotations

import pytest
import torch

import whichdevice as wd
from whichdevice.attention.decode import ATTENTION_NAME

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
    # bf16 on the CPU: sdpa for the prompt, a plain matmul for each one-token step; fp32: sdpa
    want = ATTENTION_NAME if cpu_kind.dtype == "bfloat16" else "sdpa"
    assert model.config._attn_implementation == res.attn_implementation == want
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
