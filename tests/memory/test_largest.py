"""The largest max_length and batch that fit (memory/largest.py), checked against placement itself."""

from __future__ import annotations

import pytest

import whichdevice as wd
from whichdevice.memory.largest import _bisect
from whichdevice.testing import simulate


def _llama(context: int = 131072):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                       intermediate_size=5632, vocab_size=32000, max_position_embeddings=context)  # fmt: skip


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_bisect_finds_the_last_true(n):
    assert _bisect(lambda k: k <= n, 4096) == n


def test_the_largest_found_fits_and_one_more_does_not():
    config = _llama()
    with simulate("cuda:1,mem=24GiB"):
        fit = wd.resolve_device(model=config, batch_size=8, max_length=2048, quantize=None).largest_fit()
        assert 2048 < fit.longest < 131072 and fit.largest_batch > 8
        wd.resolve_device(model=config, batch_size=8, max_length=fit.longest, quantize=None)
        with pytest.raises(wd.DoesNotFitError):
            wd.resolve_device(model=config, batch_size=8, max_length=fit.longest + 1, quantize=None)
        wd.resolve_device(model=config, batch_size=fit.largest_batch, max_length=2048, quantize=None)
        with pytest.raises(wd.DoesNotFitError):
            wd.resolve_device(model=config, batch_size=fit.largest_batch + 1, max_length=2048, quantize=None)


def test_a_job_that_does_not_fit_quotes_the_largest_that_would():
    """The issue's case: 200,000 tokens at batch 64 of a 1.1B model on 2 x 24 GiB."""
    with simulate("cuda:2,mem=24GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama(), batch_size=64, max_length=200_000)
    text = str(err.value)
    assert "the largest that fit for inference in bfloat16: max_length=" in text and "at batch_size=64" in text
    assert "at max_length=200000" in text


def test_the_models_context_caps_the_length():
    with simulate("cuda:1,mem=80GiB"):
        fit = wd.resolve_device(model=_llama(4096), batch_size=1, max_length=512).largest_fit()
    assert fit.longest == 4096 and "the model's whole context" in fit.text()


def test_largest_fit_needs_the_job():
    with simulate("cuda:1,mem=24GiB"):
        res = wd.resolve_device(model=_llama())
    with pytest.raises(wd.DeviceError, match="batch_size="):
        res.largest_fit()


def test_the_limits_are_those_of_the_plan_chosen_and_resolve_again_to_it():
    """1.1B, training at batch 1 x 512 on 16 GiB resolves to LoRA on bf16 weights: the limits are LoRA's
    (they were full fine-tuning's, with largest_batch=0, which resolve_device refuses)."""
    config = _llama(2048)
    pinned = dict(task="training", max_length=512, quantize=None, gradient_checkpointing=False)
    with simulate("cuda:1,mem=16GiB,cc=8.6"):
        res = wd.resolve_device(model=config, batch_size=1, **pinned)
        fit = res.largest_fit()
        assert res.training_setup.train == "lora" and res.dtype_name == "bfloat16"
        assert fit.plan == "for LoRA adapters on bfloat16 weights"
        line = next(s.message for s in res.trace if s.topic == "limits")
        assert line == fit.text() and "LoRA" in line
        assert fit.largest_batch is not None and fit.largest_batch >= 1 and fit.longest is not None
        again = wd.resolve_device(model=config, batch_size=fit.largest_batch, **pinned)
        assert again.largest_fit().plan == fit.plan
        with pytest.raises(wd.DoesNotFitError):
            wd.resolve_device(model=config, batch_size=fit.largest_batch + 1, **pinned)


def test_limits_where_nothing_fits_are_none_not_zero():
    with simulate("cuda:1,mem=2GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama(), task="training", batch_size=1, max_length=512, quantize=None)
    assert "not one token" in str(err.value) and "=0" not in str(err.value)
    from whichdevice.memory.fit import LargestFit

    none = LargestFit(1, 512, None, None, 2048, "for full fine-tuning in float32")
    assert none.to_dict()["largest_batch_size"] is None and "not one sequence" in none.text()
