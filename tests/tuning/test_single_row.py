"""The single-row tuning on a real model: oneDNN off exactly for forward passes of one token row,
put back after each (also when one raises or is interrupted), the same tokens from generate(), and
prepare() adding it only where the resolution says so. The switch's owner has its own tests
(test_onednn.py: threads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.testing import simulate
from whichdevice.tuning.onednn import holders
from whichdevice.tuning.single_row import install_single_row, remove_single_row

# A simulated CPU whose batch-1 bf16 steps run 1.8x faster through torch's GEMV kernel (s1 over g1),
# with a 1 KiB cache so that the tiny model's weights stream from memory as a real model's do.
STREAMS = (
    "cpu,flags=avx512_bf16,calib=bf16.b1:1.3/bf16.b2:3/bf16.b4:2.8/bf16.b8:2.4/bf16.prompt:2.5/bf16.s1:1.9/"
    "bf16.s4:4.8/bf16.g1:3.5/fp32.s1:0.0085/fp32.s4:0.025/mem.llc:1024/mem.cache:4194304/mem.stream:33554432"
)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("single-row") / "tiny", dtype=torch.bfloat16, tokenizer=False)


def _spy(model: Any) -> list[tuple[int, bool]]:
    """(rows, oneDNN on) as the first decoder layer saw each forward pass."""
    seen: list[tuple[int, bool]] = []

    def record(module: Any, args: tuple[Any, ...]) -> None:
        seen.append((args[0].shape[0] * args[0].shape[1], torch._C._get_mkldnn_enabled()))

    model.model.layers[0].register_forward_pre_hook(record)
    return seen


def test_one_row_forwards_run_without_onednn_and_the_flag_comes_back(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert install_single_row(model) and not install_single_row(model)  # twice adds nothing
    seen = _spy(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = torch._C._get_mkldnn_enabled()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert seen[0] == (4, before)  # the prompt keeps oneDNN
    assert seen[1:] and all(rows == 1 and not on for rows, on in seen[1:])  # each step runs without
    assert torch._C._get_mkldnn_enabled() == before


def test_the_flag_comes_back_when_the_forward_raises(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(model)

    def boom(module: Any, args: tuple[Any, ...]) -> None:
        raise RuntimeError("boom")

    model.model.layers[0].register_forward_pre_hook(boom)
    before = torch._C._get_mkldnn_enabled()
    with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]))
    assert torch._C._get_mkldnn_enabled() == before


def test_the_switch_is_held_only_for_one_row_and_never_from_a_users_off(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(model)
    seen: list[tuple[int, int, bool]] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[1], holders(), torch._C._get_mkldnn_enabled()))
    )
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]]))
        model(input_ids=torch.tensor([[5]]))
        torch.backends.mkldnn.enabled = False  # the user's own switch: kept off, and not held
        try:
            model(input_ids=torch.tensor([[5]]))
            assert torch._C._get_mkldnn_enabled() is False
        finally:
            torch.backends.mkldnn.enabled = True
    assert seen == [(3, 0, True), (1, 1, False), (1, 0, False)]
    assert holders() == 0


def test_ctrl_c_inside_a_decode_step_leaves_the_switch_as_the_user_set_it(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(model)
    calls: list[int] = []

    def interrupt(module: Any, args: tuple[Any, ...]) -> None:
        calls.append(args[0].shape[1])
        if len(calls) == 3:  # the second one-row step: in the middle of generate's decode loop
            raise KeyboardInterrupt

    model.model.layers[1].register_forward_pre_hook(interrupt)
    ids = torch.tensor([[5, 6, 7, 8]])
    for users in (True, False):
        calls.clear()
        torch.backends.mkldnn.enabled = users
        try:
            with pytest.raises(KeyboardInterrupt), torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            assert torch._C._get_mkldnn_enabled() is users and holders() == 0
        finally:
            torch.backends.mkldnn.enabled = True
    assert calls == [4, 1, 1]


def test_a_prepared_model_pickles_deepcopies_and_compiles_and_unprepare_takes_it_back(path: Path):
    import copy
    import io

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the closure hooks of before could not be pickled
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        assert vars(other)["forward"].model is other  # bound to the copy, not the original
        with torch.inference_mode():
            torch.testing.assert_close(other(input_ids=ids).logits, expected)
    compiled = torch.compile(model, backend="eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(input_ids=ids).logits, expected)
    assert torch._C._get_mkldnn_enabled() and holders() == 0
    assert remove_single_row(model) and "forward" not in vars(model) and not remove_single_row(model)


def test_the_model_forwards_signature_is_what_generate_reads(path: Path):
    """transformers decides what generate passes (logits_to_keep, attention_mask) from forward's signature."""
    import inspect

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    before = inspect.signature(model.forward)
    install_single_row(model)
    assert inspect.signature(model.forward) == before and model._supports_logits_to_keep()


def test_the_hooked_model_generates_what_the_plain_one_does(path: Path):
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        a = plain(input_ids=ids[:, :1]).logits.float()
        b = model(input_ids=ids[:, :1]).logits.float()
    # Two kernels, one arithmetic: bf16 inputs, fp32 accumulation; they differ by rounding only.
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_prepare_hooks_the_model_only_where_the_resolution_measured_it(path: Path):
    with simulate(STREAMS):
        one = wd.resolve_device(model=str(path), batch_size=1, max_length=64)
        four = wd.resolve_device(model=str(path), batch_size=4, max_length=64)
    assert one.tuning is not None and one.tuning.single_row
    assert four.tuning is None or not four.tuning.single_row
    model = AutoModelForCausalLM.from_pretrained(path, **one.model_kwargs()).eval()
    assert one.prepare(model) is model and "forward" in vars(model)
    other = AutoModelForCausalLM.from_pretrained(path, **four.model_kwargs()).eval()
    assert four.prepare(other) is other and "forward" not in vars(other)


def test_an_encoder_decoders_decode_steps_run_without_onednn(tmp_path: Path):
    """generate runs a T5's encoder once, then each decode step's forward gets its outputs and one
    decoder row: those steps are the single-row ones (the encoder's many rows keep oneDNN)."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256, decoder_start_token_id=0)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(tmp_path)
    plain, model = (AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval() for _ in range(2))
    install_single_row(model)
    seen: list[tuple[int, bool]] = []
    model.decoder.block[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[0] * args[0].shape[1], torch._C._get_mkldnn_enabled()))
    )
    encoder_seen: list[bool] = []
    model.encoder.block[0].register_forward_pre_hook(lambda m, a: encoder_seen.append(torch._C._get_mkldnn_enabled()))
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    kwargs = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    before = torch._C._get_mkldnn_enabled()
    with torch.inference_mode():
        tokens = model.generate(input_ids=ids, **kwargs)
        assert torch.equal(tokens, plain.generate(input_ids=ids, **kwargs))
    assert encoder_seen == [before]
    assert len(seen) >= 3 and all(rows == 1 and not on for rows, on in seen)
    assert torch._C._get_mkldnn_enabled() == before
