"""whichdevice's decode attention: eager's numbers, sdpa's behaviour elsewhere, every verified architecture."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import whichdevice as wd
from tiny_models import TINY
from whichdevice.attention.decode import (
    ATTENTION_NAME,
    VERIFIED_MODEL_TYPES,
    decode_attention_forward,
    ensure_registered,
    model_type_of,
)

pytestmark = pytest.mark.slow

# the tests' tiny Llama shape, with token ids inside its 256-token vocabulary for every architecture
SMALL = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _qkv(dtype, batch=3, heads=8, kv_heads=2, q_len=1, kv_len=37, head_dim=16, value_dim=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, value_dim or head_dim, generator=g).to(dtype)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, is_causal=True)
    return module, q, k, v


def _padding(batch, kv_len, heads=1):
    mask = torch.ones(batch, heads, 1, kv_len, dtype=torch.bool)
    mask[1, :, :, :5] = False  # left padding in one row
    mask[2, :, :, :11] = False
    return mask


def _eager(module, q, k, v, mask, scaling=None):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if mask is not None:
        mask = mask[..., : k.shape[2]]  # transformers 4.x eager slices a longer mask; 5.x never passes one
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scale)
    return out


MASKS = {
    "no mask": lambda b, h, n: None,
    "bool padding": lambda b, h, n: _padding(b, n),
    "bool per head": lambda b, h, n: _padding(b, n, heads=h),
    "additive float": lambda b, h, n: torch.where(_padding(b, n), 0.0, -1e4),
    "longer than the keys": lambda b, h, n: _padding(b, n + 6),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_one_token_matches_eager_attention(dtype, kv_heads, mask_kind):
    module, q, k, v = _qkv(dtype, kv_heads=kv_heads)
    mask = MASKS[mask_kind](q.shape[0], q.shape[1], k.shape[2])
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    got, weights = decode_attention_forward(module, q, k, v, mask)
    want = _eager(module, q, k, v, mask)
    assert weights is None
    assert got.shape == want.shape == (3, 1, 8, 16) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # the masked keys really are ignored: changing them changes nothing
    if mask is not None:
        k2, v2 = k.clone(), v.clone()
        k2[2, :, :11], v2[2, :, :11] = 100.0, 100.0
        again, _ = decode_attention_forward(module, q, k2, v2, mask)
        torch.testing.assert_close(again[2], got[2], atol=0, rtol=0)


def test_grouped_heads_run_torchs_fused_kernel_as_rows_of_their_key_value_head(monkeypatch):
    module, q, k, v = _qkv(torch.bfloat16, kv_heads=2)
    fused = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[int, ...]] = []

    def spy(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return fused(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got, _ = decode_attention_forward(module, q, k, v, _padding(3, 37, heads=8))
    assert calls == [(3, 2, 4, 16)]  # 8 heads over 2 key/value heads: 4 rows each, no key repeated
    torch.testing.assert_close(got, _eager(module, q, k, v, _padding(3, 37, heads=8)), atol=2e-2, rtol=2e-2)
    calls.clear()
    decode_attention_forward(*_qkv(torch.bfloat16, kv_heads=8), None)
    assert calls == []  # one head per key/value head: nothing to group, plain matmuls


@pytest.mark.parametrize("enabled", [True, False], ids=["oneDNN on", "oneDNN off"])
def test_plain_matmuls_never_touch_the_global_onednn_switch(enabled):
    """The switch has one owner (whichdevice.tuning.onednn): the attention runs under whatever it is."""
    module, q, k, v = _qkv(torch.bfloat16, kv_heads=8)
    torch.backends.mkldnn.enabled = enabled
    try:
        got, _ = decode_attention_forward(module, q, k, v, None)
        assert torch._C._get_mkldnn_enabled() is enabled
    finally:
        torch.backends.mkldnn.enabled = True
    torch.testing.assert_close(got, _eager(module, q, k, v, None), atol=2e-2, rtol=2e-2)


def test_scaling_and_value_dim_are_honoured():
    module, q, k, v = _qkv(torch.bfloat16, value_dim=24)
    got, _ = decode_attention_forward(module, q, k, v, None, scaling=0.3)
    assert got.shape == (3, 1, 8, 24)
    torch.testing.assert_close(got, _eager(module, q, k, v, None, scaling=0.3), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("dtype", "q_len", "kwargs"),
    [
        (torch.bfloat16, 9, {}),  # a prompt: the fused kernel
        (torch.float32, 1, {}),  # fp32: the fused kernel is as fast as the matmul
        (torch.bfloat16, 1, {"output_attentions": True}),
    ],
    ids=["prompt", "fp32", "output_attentions"],
)
def test_everything_else_is_transformers_sdpa(dtype, q_len, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v = _qkv(dtype, q_len=q_len, kv_len=q_len if q_len > 1 else 37)
    got, _ = decode_attention_forward(module, q, k, v, None, **kwargs)
    want, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("feature", ["softcap", "position_bias"])
def test_features_the_matmul_lacks_go_to_sdpa(feature):
    """Soft-capping and position bias are sdpa's business: transformers 5 refuses soft-capping
    there and folds a position bias into the mask; whatever sdpa does, this does too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v = _qkv(torch.bfloat16)
    value = 30.0 if feature == "softcap" else torch.randn(1, 8, 1, 37).to(torch.bfloat16)
    try:
        want, _ = sdpa_attention_forward(module, q, k, v, None, **{feature: value})
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)[:40]):
            decode_attention_forward(module, q, k, v, None, **{feature: value})
        return
    got, _ = decode_attention_forward(module, q, k, v, None, **{feature: value})
    assert torch.equal(got, want)


def _family_checkpoint(model_type, path, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(SMALL)
    config_class = type(AutoConfig.for_model(model_type))
    if "num_key_value_heads" not in inspect.signature(config_class.__init__).parameters:
        settings.pop("num_key_value_heads")  # a multi-head family (gpt2, gpt_neox, phi): no stray key
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path)
    return path


def _decode(model, ids, mask, steps, forced=None):
    """Prefill, then ``steps`` one-token steps through the KV cache; the last-position logits of
    each call. The tokens fed are ``forced`` when given, else this model's own greedy choices."""
    logits, tokens = [], []
    # transformers 5.24 renamed forward's past_key_values to cache; 4.57 knows only the old name
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        for step in range(steps + 1):
            last = out.logits[:, -1].float()
            logits.append(last)
            token = last.argmax(-1, keepdim=True) if forced is None else forced[step]
            tokens.append(token)
            if step == steps:
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            cache = getattr(out, "cache", None) or out.past_key_values
            out = model(input_ids=token, attention_mask=mask, use_cache=True, **{cache_arg: cache})
    return torch.stack(logits), tokens


def _runs(res: wd.Resolution) -> str | None:
    """The attention a model loaded with res.model_kwargs() runs once res.prepare(model) ran."""
    return res.tuning.attention_after_prepare(res.attn_implementation) if res.tuning else res.attn_implementation


@pytest.mark.parametrize("model_type", sorted(VERIFIED_MODEL_TYPES))
def test_every_verified_architecture_decodes_as_eager_attention_does(model_type, tmp_path, monkeypatch):
    """The resolver picks the decode attention for the architecture, transformers routes every
    one-token step through it, and each step's logits are eager attention's."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    path = _family_checkpoint(model_type, tmp_path / model_type)
    res = wd.resolve_device(model=path, dtype="bfloat16")
    if _runs(res) != ATTENTION_NAME:
        # A multi-head model is not given it (its logits are further from eager fp32 than sdpa's);
        # a user may still ask for it, and then it must decode as eager attention does.
        line = next(s.message for s in res.trace if s.topic == "attention")
        assert "not passed for a multi-head model" in line, res.explain()
        res = wd.resolve_device(model=path, dtype="bfloat16", attn_implementation=ATTENTION_NAME)
    model = res.prepare(AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval())
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    assert model.config._attn_implementation == ATTENTION_NAME

    query_lengths: list[int] = []

    def counting(module, query, *args, **kwargs):
        query_lengths.append(query.shape[2])
        return decode_attention_forward(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, counting)
    ids = torch.randint(3, 250, (3, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :9] = 0
    ours, tokens = _decode(model, ids, mask, steps=5)
    # eager is fed the same tokens, so a near-tie that greedy decoding breaks the other way in bf16
    # cannot send the two down different paths
    theirs, _ = _decode(eager, ids, mask, steps=5, forced=tokens)
    layers = model.config.num_hidden_layers
    assert query_lengths.count(1) == 5 * layers  # every one-token step of every layer went through it
    assert sum(1 for n in query_lengths if n > 1) == layers
    # bf16 rounding of a differently ordered sum: under 0.01 here; ignoring the padding is 0.05 and more
    assert (ours - theirs).abs().max().item() < 0.02


@pytest.mark.parametrize(
    ("kwargs", "want", "why"),
    [
        ({"dtype": "bfloat16"}, ATTENTION_NAME, "verified for model_type 'llama'"),
        # Issue 25: used only where no further from eager fp32 than sdpa (benchmarks/decode_accuracy.py):
        # a grouped-query model runs sdpa's own fused kernel, with equal logits in fp16 too...
        ({"dtype": "float16"}, ATTENTION_NAME, "verified for model_type 'llama'"),
        # ...a multi-head model's plain matmuls are further, in either half precision.
        ({"dtype": "float16", "kv_heads": 4}, "sdpa", "not passed for a multi-head model"),
        ({"dtype": "bfloat16", "kv_heads": 4}, "sdpa", "not passed for a multi-head model"),
        ({"dtype": "bfloat16", "kv_heads": 4, "attn_implementation": ATTENTION_NAME}, ATTENTION_NAME, "as you asked"),
        ({"dtype": "float32"}, "sdpa", "no FlashAttention package"),
        ({"task": "training"}, "sdpa", "no FlashAttention package"),
        ({"attn_implementation": "sdpa"}, "sdpa", "as you asked"),
        ({"attn_implementation": "eager"}, "eager", "as you asked"),
        ({"attn_implementation": ATTENTION_NAME, "dtype": "float32"}, ATTENTION_NAME, "as you asked"),
    ],
)
def test_the_resolver_picks_it_for_cpu_inference_in_half_precision(kwargs, want, why, tmp_path):
    from tiny_models import save_tiny_llama

    kwargs = dict(kwargs)
    kv_heads = kwargs.pop("kv_heads", 2)  # the tiny Llama's 4 heads over 2 key/value heads, or over 4
    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False, num_key_value_heads=kv_heads)
    res = wd.resolve_device(model=path, **kwargs)
    assert _runs(res) == want
    # The keywords name a name transformers knows: sdpa, with the decode attention installed by prepare().
    assert res.attn_implementation == ("sdpa" if want == ATTENTION_NAME else want)
    line = next(s.message for s in res.trace if s.topic == "attention")
    assert why in line


def test_the_automatic_choice_follows_the_cpus_dtype(cpu_kind, tmp_path):
    """Without dtype=, the decode attention comes with bf16 where the probe says bf16 is native."""
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False)
    res = wd.resolve_device(model=path)
    assert res.dtype_name == cpu_kind.dtype
    assert _runs(res) == (ATTENTION_NAME if cpu_kind.dtype == "bfloat16" else "sdpa")


def test_without_a_model_it_leaves_attention_to_transformers_and_says_how_to_get_it():
    res = wd.resolve_device(dtype="bfloat16")
    assert res.attn_implementation is None and "attn_implementation" not in res.model_kwargs()
    line = next(s.message for s in res.trace if s.topic == "attention")
    assert f"pass model= to get {ATTENTION_NAME}" in line


def test_a_model_without_a_model_type_is_named_as_damaged(tmp_path):
    # from_pretrained cannot tell its architecture either (issue 16: a DeviceError naming the file).
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    del config["model_type"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(wd.DeviceError, match="has no model_type"):
        wd.resolve_device(model=path, dtype="bfloat16")


@pytest.mark.parametrize("model_type", ["falcon", "mixtral"])
def test_unverified_architectures_keep_sdpa(model_type):
    from transformers import AutoConfig

    res = wd.resolve_device(model=AutoConfig.for_model(model_type, **SMALL), dtype="bfloat16")
    assert res.attn_implementation == "sdpa"
    line = next(s.message for s in res.trace if s.topic == "attention")
    assert f"not verified for model_type {model_type!r}" in line


@pytest.mark.parametrize("spec", ["cuda:1,cc=9.0", "xpu:1", "mps", "hpu:8"])
def test_other_devices_keep_sdpa(spec, tmp_path):
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False)
    with wd.testing.simulate(spec):
        res = wd.resolve_device(model=path)
    assert res.attn_implementation == "sdpa"


def test_model_type_of_reads_configs_folders_and_files(tmp_path):
    from tiny_models import save_tiny_llama, tiny_config

    path = save_tiny_llama(tmp_path / "llama", tokenizer=False)
    assert model_type_of(path) == model_type_of(str(path)) == "llama"
    assert model_type_of(path / "model.safetensors") == "llama"
    assert model_type_of(tiny_config()) == "llama"
    assert model_type_of(tmp_path / "missing") is None
    assert model_type_of(None) is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert model_type_of(tmp_path / "broken") is None
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text(json.dumps(["llama"]))
    assert model_type_of(tmp_path / "list") is None


def test_registration_is_idempotent_and_leaves_sdpa_alone():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    ensure_registered()
    ensure_registered()
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is decode_attention_forward
    assert AttentionMaskInterface._global_mapping[ATTENTION_NAME] is sdpa_mask
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward


REGISTRATION = """
import sys, torch, whichdevice as wd
{before}
res = wd.resolve_device(model=sys.argv[1], dtype="bfloat16")  # the half-precision path on any CPU
assert res.tuning.decode_attention and res.attn_implementation == "sdpa", res.explain()
from transformers import AutoModelForCausalLM
kwargs = {kwargs}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs)
print("loaded with", model.config._attn_implementation)
"""


@pytest.mark.parametrize(
    ("before", "kwargs", "name"),
    [
        ("", "res.model_kwargs()", "sdpa"),
        ("", "dict(dtype=res.dtype, attn_implementation=res.attn_implementation)", "sdpa"),
        # A script that passes the decode attention's name by hand (what res.attn_implementation said
        # before schema 1.9): the resolution registered it, before or after transformers is imported.
        ("", "dict(dtype=res.dtype, attn_implementation='whichdevice_sdpa')", ATTENTION_NAME),
        ("import transformers", "dict(dtype=res.dtype, attn_implementation='whichdevice_sdpa')", ATTENTION_NAME),
    ],
    ids=["model_kwargs", "attribute", "by-hand-before-importing-transformers", "by-hand-after-importing-transformers"],
)
def test_a_fresh_process_can_load_with_what_the_resolver_chose(before, kwargs, name, tmp_path):
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False)
    script = REGISTRATION.format(before=before, kwargs=kwargs)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded with {name}" in proc.stdout


UNPICKLED = """
import pickle, sys
res = pickle.loads(bytes.fromhex(sys.argv[2]))  # another process: nothing registered there yet
from transformers import AutoModelForCausalLM
for name in (res.attn_implementation, "whichdevice_sdpa"):  # what the keywords name, and the name by hand
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=res.dtype, attn_implementation=name)
    print("loaded with", model.config._attn_implementation)
"""


def test_a_resolution_sent_to_another_process_registers_there(tmp_path):
    import pickle

    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "llama", torch.bfloat16, tokenizer=False)
    res = wd.resolve_device(model=path, dtype="bfloat16")
    assert res.tuning.decode_attention
    proc = subprocess.run(
        [sys.executable, "-c", UNPICKLED, str(path), pickle.dumps(res).hex()],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["loaded with sdpa", f"loaded with {ATTENTION_NAME}"]
