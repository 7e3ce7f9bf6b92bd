"""Tiny Llama checkpoints built from a config and saved locally: the real from_pretrained path, no Hub."""

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
