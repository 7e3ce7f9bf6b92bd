"""Tiny checkpoints (Llama, and other architectures) built from a config and saved locally: the real
from_pretrained path, no Hub."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


def tiny_config(**overrides: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **overrides})


def save_tiny_llama(path: Path, dtype: torch.dtype = torch.float32, tokenizer: bool = True, **overrides: int) -> Path:
    """Save a randomly initialised tiny Llama (and a word-level tokenizer) to ``path``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(**overrides)).to(dtype)
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    return path


def save_tokenizer(path: Path) -> None:
    """The word-level tokenizer docs/end-to-end.md's recipe builds (the same vocabulary and tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(250)}
    vocab.update({"<unk>": 250, "<s>": 251, "</s>": 252})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(path)


class RandomTokens(torch.utils.data.Dataset):
    """A few fixed random sequences for causal-LM training steps."""

    def __init__(self, n: int = 16, length: int = 16, vocab: int = 250, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# Architectures whose layers differ from Llama's: tied embeddings (gemma), a dense MLP without gates
# and partial rotary (phi), fused QKV (gpt_neox, bloom), learned positions (opt), GPT-2's Conv1D and
# Falcon's nn.Linear subclass, softcapping with eager attention (gemma2), experts (mixtral), and
# encoder-decoders (t5, bart).
_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
ARCHITECTURES = {
    "gemma": {**_SMALL, "intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16},
    "gemma2": {**_SMALL, "intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16},
    "phi": {**_SMALL, "intermediate_size": 128},
    "gpt_neox": {**_SMALL, "intermediate_size": 128},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256},
    "opt": {**_SMALL, "ffn_dim": 128, "word_embed_proj_dim": 64},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256},
    "falcon": dict(_SMALL),
    "mixtral": {**_SMALL, "intermediate_size": 128, "num_key_value_heads": 2, "num_local_experts": 4},
    "t5": {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 256, "decoder_start_token_id": 0},
    "bart": {
        "d_model": 64,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "vocab_size": 256,
    },
}


def save_tiny(model_type: str, path: Path, dtype: torch.dtype = torch.float32):
    """Save a randomly initialised tiny ``model_type`` (a key of ``ARCHITECTURES``) to ``path``; returns
    the Auto class that loads it (causal LM, or seq2seq LM for an encoder-decoder)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model(model_type, **ARCHITECTURES[model_type])
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(0)
    auto.from_config(config).to(dtype).save_pretrained(path)
    return auto
