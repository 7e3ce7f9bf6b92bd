"""Header-only checkpoints of real large models, for the test Hub (tests/hub_server.py).

Each is the model's published config.json and the safetensors headers its checkpoint has: the
tensor names, dtypes and shapes that the architecture's weights take, sharded at about 5 GB as
``save_pretrained`` shards, with a shard index. No tensor data exists: the test Hub makes zeros up
to each file's size. The configs are those of the published models (Llama 3.1 8B and 70B,
Mixtral 8x7B), cut to the fields transformers and whichdevice read.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from hub_server import HeaderOnly

Tensor = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape
_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1, "U8": 1}
_SHARD = 5_000_000_000


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv: int, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        **extra,
    }


LLAMA_8B = llama_config(4096, 14336, 32, 32, 8)  # meta-llama/Llama-3.1-8B config.json
LLAMA_70B = llama_config(8192, 28672, 80, 64, 8)  # meta-llama/Llama-3.1-70B config.json
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def decoder_tensors(config: dict[str, Any], dtype: str = "BF16") -> list[Tensor]:
    """The tensors of a Llama-style checkpoint (Mixtral's experts where the config has them)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    d = h // heads
    out: list[Tensor] = [("model.embed_tokens.weight", dtype, (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", dtype, (h,)),
            (f"{p}.post_attention_layernorm.weight", dtype, (h,)),
            (f"{p}.self_attn.q_proj.weight", dtype, (heads * d, h)),
            (f"{p}.self_attn.k_proj.weight", dtype, (kv * d, h)),
            (f"{p}.self_attn.v_proj.weight", dtype, (kv * d, h)),
            (f"{p}.self_attn.o_proj.weight", dtype, (h, heads * d)),
        ]
        experts = config.get("num_local_experts")
        if experts:
            out.append((f"{p}.block_sparse_moe.gate.weight", dtype, (experts, h)))
            for e in range(experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                out += [(f"{q}.w1.weight", dtype, (inter, h)), (f"{q}.w2.weight", dtype, (h, inter))]
                out.append((f"{q}.w3.weight", dtype, (inter, h)))
        else:
            out += [
                (f"{p}.mlp.gate_proj.weight", dtype, (inter, h)),
                (f"{p}.mlp.up_proj.weight", dtype, (inter, h)),
                (f"{p}.mlp.down_proj.weight", dtype, (h, inter)),
            ]
    out += [("model.norm.weight", dtype, (h,)), ("lm_head.weight", dtype, (vocab, h))]
    return out


def _is_layer_linear(name: str, shape: tuple[int, ...]) -> bool:
    return ".layers." in name and name.endswith("proj.weight") and len(shape) == 2


def gptq(tensors: list[Tensor], bits: int = 4, group: int = 128) -> list[Tensor]:
    """AutoGPTQ's layout: each layer's linear weight [out, in] as qweight, qzeros, scales and g_idx."""
    out: list[Tensor] = []
    per_int = 32 // bits
    for name, dtype, shape in tensors:
        if not _is_layer_linear(name, shape):
            out.append((name, "F16" if dtype == "BF16" else dtype, shape))
            continue
        rows, cols = shape
        base = name.removesuffix(".weight")
        out += [
            (f"{base}.qweight", "I32", (cols // per_int, rows)),
            (f"{base}.qzeros", "I32", (cols // group, rows // per_int)),
            (f"{base}.scales", "F16", (cols // group, rows)),
            (f"{base}.g_idx", "I32", (cols,)),
        ]
    return out


def fp8(tensors: list[Tensor], block: int = 128) -> list[Tensor]:
    """The block-wise FP8 layout (Qwen3-*-FP8, DeepSeek-V3): e4m3 weights and one F32 scale per block."""
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        if not _is_layer_linear(name, shape):
            out.append((name, dtype, shape))
            continue
        rows, cols = shape
        scales = (math.ceil(rows / block), math.ceil(cols / block))
        out += [(name, "F8_E4M3", shape), (f"{name}_scale_inv", "F32", scales)]
    return out


def header_only(tensors: list[Tensor]) -> HeaderOnly:
    """One safetensors file holding ``tensors``: its real length prefix and header, zeros after."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * _BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    head = struct.pack("<Q", len(raw)) + raw
    return HeaderOnly(head, len(head) + offset)


def checkpoint(config: dict[str, Any], tensors: list[Tensor]) -> dict[str, bytes | HeaderOnly]:
    """A repo's files: config.json, and the tensors in ~5 GB shards with their index (one file if small)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = math.prod(tensor[2]) * _BYTES[tensor[1]]
        if shards[-1] and size + nbytes > _SHARD:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    files: dict[str, bytes | HeaderOnly] = {"config.json": json.dumps(config, indent=2).encode()}
    if len(shards) == 1:
        files["model.safetensors"] = header_only(shards[0])
        return files
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        files[name] = header_only(shard)
        total += sum(math.prod(t[2]) * _BYTES[t[1]] for t in shard)
        weight_map.update({t[0]: name for t in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
    return files


def gptq_config(config: dict[str, Any]) -> dict[str, Any]:
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    return {**config, "torch_dtype": "float16", "quantization_config": quant}


def fp8_config(config: dict[str, Any]) -> dict[str, Any]:
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return {**config, "quantization_config": quant}


def large_repos() -> dict[str, dict[str, bytes | HeaderOnly]]:
    """The header-only repos: id -> files."""
    return {
        "meta-llama/Llama-3.1-8B": checkpoint(LLAMA_8B, decoder_tensors(LLAMA_8B)),
        "meta-llama/Llama-3.1-70B": checkpoint(LLAMA_70B, decoder_tensors(LLAMA_70B)),
        "mistralai/Mixtral-8x7B-v0.1": checkpoint(MIXTRAL, decoder_tensors(MIXTRAL)),
        "acme/Llama-3.1-8B-GPTQ": checkpoint(gptq_config(LLAMA_8B), gptq(decoder_tensors(LLAMA_8B))),
        "acme/Llama-3.1-8B-FP8": checkpoint(fp8_config(LLAMA_8B), fp8(decoder_tensors(LLAMA_8B))),
    }
