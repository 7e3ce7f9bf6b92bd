"""What a training step really keeps: live bytes counted storage by storage while a real transformers model
trains one step on the CPU.

Used by ``scripts/gen_activation_table.py`` (which fits the table whichdevice prices activations by) and by
``tests/memory/test_activation_table.py`` (which re-measures one size per family against that table). Not
part of the package: it needs torch, transformers, peft and bitsandbytes, and runs real models.

A step is counted by a ``TorchDispatchMode`` that sees every storage an operator creates and, through a
weak reference, the moment it is freed. Parameters, buffers and inputs are registered first, so a view of
them is never counted; gradients are recognised once backward has made them and taken out of the
activation timeline. Three figures come back per step:

* ``kept``: the bytes alive at the end of the forward pass (the loss computed, the outputs dropped), which
  is what autograd keeps for backward, whether through ``save_for_backward`` or a ``ctx`` attribute
  (bitsandbytes' 4-bit matmul keeps its input that way);
* ``head_peak``: the highest activation bytes from the start of forward until the gradient reaches the
  output head's input (the loss and the head's backward);
* ``layers_peak``: the highest activation bytes from then to the end of backward (the layers' backward,
  and with checkpointing the recomputed layer).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["FAMILIES", "Family", "Mode", "Step", "fit", "measure_step", "modes", "quadratic"]


_TORCH = os.path.dirname(torch.__file__)


def _made_at() -> str:
    """Where an allocation is made: in backward the autograd node that runs, in forward the first line of
    Python outside torch and this script (a model's line, peft's, the loss's). An operator and its count
    alone name a moment only where every length runs the same operators; the CPU slow path of Mamba's scan
    runs a Python loop per token, so its operators' counts shift with the length and name a different place
    at each. Named by where they are made, the allocations outside such a loop keep their count."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return str(node.name())
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class _LiveStorages(TorchDispatchMode):
    """Every storage an operator creates while active, as a timeline of (+bytes or -bytes, serial)."""

    def __init__(self) -> None:
        super().__init__()
        self.serials: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.events: list[tuple[int, int]] = []
        self.ops: dict[int, str] = {}  # event index -> the operator whose output it allocated
        self.counter = itertools.count()

    def known(self, tensors: Iterator[torch.Tensor]) -> None:
        """Storages that exist already (weights, inputs): never counted, views of them neither."""
        for t in tensors:
            self.serials.setdefault(t.untyped_storage(), -1)

    def _see(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        if storage in self.serials or storage.device.type == "meta":
            return
        serial = next(self.counter)
        self.serials[storage] = serial
        size = storage.nbytes()
        self.ops[len(self.events)] = op
        self.events.append((size, serial))
        weakref.finalize(storage, self.events.append, (-size, serial))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        named = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                named = named or f"{func}@{_made_at()}"
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    self._see(t, named)
        return out

    def moments(self, start: int, end: int, skip: set[int]) -> dict[str, int]:
        """The activation bytes alive right after each allocation in [start, end), keyed by its operator
        and how many times that operator allocated before it in the range: the same key names the same
        moment of the step at every size, where a peak can be."""
        live = self.live(start, skip)
        seen: dict[str, int] = {}
        found: dict[str, int] = {}
        for index in range(start, end):
            d, s = self.events[index]
            if s in skip:
                continue
            live += d
            op = self.ops.get(index)
            if op is not None:
                n = seen.get(op, 0)
                seen[op] = n + 1
                found[f"{op}#{n}"] = live
        return found

    def serial(self, t: torch.Tensor) -> int | None:
        return self.serials.get(t.untyped_storage())

    def live(self, upto: int, skip: set[int]) -> int:
        return sum(d for d, s in self.events[:upto] if s not in skip)

    def peak(self, start: int, end: int, skip: set[int]) -> int:
        live = self.live(start, skip)
        top = live
        for d, s in self.events[start:end]:
            if s not in skip:
                live += d
                top = max(top, live)
        return top


@dataclass(frozen=True)
class Mode:
    """How a step trains: what is trained (``full``, ``lora`` on a frozen base, ``qlora`` on a 4-bit base),
    the weights' dtype, the autocast dtype (None: none), the attention and gradient checkpointing."""

    train: str
    weights: str
    autocast: str | None
    attention: str
    checkpointing: bool

    @property
    def key(self) -> str:
        cast = self.autocast or "none"
        return f"{self.train}/{self.weights}/{cast}/{self.attention}/{'ckpt' if self.checkpointing else 'keep'}"


# What is trained, the weights' dtype and the autocast dtype: how whichdevice's plans train.
# full fine-tuning: fp32 weights (fp32, or mixed precision through Trainer's autocast), and 16-bit
# weights without autocast (DeepSpeed and FSDP cast the weights themselves); LoRA: the frozen base in
# the compute dtype under that autocast (memory/placement.py), adapters kept in fp32 by peft; QLoRA:
# the 4-bit base computing in the autocast dtype (fp32 where there is none), the rest upcast to fp32
# by peft's prepare_model_for_kbit_training (which lora_training calls). fp16 keeps the bytes bf16
# keeps: measured as bf16, and gen_activation_table.py's check_half holds the two equal.
_TRAININGS = (
    ("full", "float32", None),
    ("full", "float32", "bfloat16"),
    ("full", "bfloat16", None),
    ("lora", "float32", None),
    ("lora", "bfloat16", "bfloat16"),
    ("qlora", "4bit", None),
    ("qlora", "4bit", "bfloat16"),
)


def modes(attentions: tuple[str, ...]) -> list[Mode]:
    return [
        Mode(train, weights, cast, attention, ckpt)
        for train, weights, cast in _TRAININGS
        for attention in attentions
        for ckpt in (False, True)
    ]


@dataclass(frozen=True)
class Family:
    """An architecture family: its transformers classes, the sizes it is measured at, and which config
    fields set its depth."""

    model_type: str
    config_class: str
    model_class: str
    sizes: tuple[Mapping[str, Any], ...]
    depth_keys: tuple[str, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # What the measured code path keeps where it differs from the path the family runs on a GPU: the table
    # writes it beside the family's coefficients and whichdevice says it where it prices the family.
    measured: str = ""

    def config(self, size: Mapping[str, Any], layers: int, attention: str) -> Any:
        import transformers

        values = {**self.fixed, **size, **{k: layers for k in self.depth_keys}}
        config = getattr(transformers, self.config_class)(**values)
        config._attn_implementation = attention
        config.use_cache = False
        return config


def _decoder(hidden: int, inter: int, heads: int, kv: int, head_dim: int | None, vocab: int) -> dict[str, Any]:
    size = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
    }
    if head_dim is not None:
        size["head_dim"] = head_dim
    return size


# Sizes chosen so that the widths a token's activations are made of are not proportional to one another
# across a family's sizes (fit() leaves out a width that moves with another), while their ratios stay where
# real checkpoints have them: the MLP 2.5-5x the hidden size, the vocabulary 8-48x. Which moment of a step
# peaks depends on those ratios (the loss over a large vocabulary, a wide MLP's backward), so the peaks are
# measured in the regime models are trained in.
# (hidden, intermediate, heads, key/value heads, head size, vocabulary)
_GQA = (
    (64, 176, 4, 2, 24, 1024),
    (96, 336, 6, 2, 16, 3072),
    (80, 320, 4, 4, 20, 960),
    (128, 320, 8, 2, 8, 3072),
    (112, 560, 2, 1, 40, 4480),
    (72, 216, 6, 3, 12, 1440),
    (120, 540, 4, 1, 32, 960),
    (88, 286, 8, 4, 16, 4224),
)
# Configs without head_dim (the query width is the hidden size) and without grouped key/values.
_MHA = tuple((h, i, n, v) for h, i, n, _, _, v in _GQA if h % n == 0)


def _rotates(hidden: int, heads: int, fraction: float = 1.0) -> bool:
    """Rotary embeddings split the rotated part of a head in halves: it must have an even width."""
    return hidden % heads == 0 and int(hidden // heads * fraction) % 2 == 0


_LAYERS = ("num_hidden_layers",)


def _mha(hidden: int, inter: int, heads: int, vocab: int, kv: bool = True) -> dict[str, Any]:
    size = _decoder(hidden, inter, heads, heads, None, vocab)
    if not kv:
        del size["num_key_value_heads"]
    return size


def _moe(experts_key: str, inter_key: str) -> tuple[dict[str, Any], ...]:
    # (hidden, expert intermediate, heads, kv, head_dim, vocab, experts, experts per token)
    rows = (
        (64, 96, 4, 2, 24, 1024, 4, 2),
        (96, 240, 6, 2, 16, 3072, 8, 2),
        (80, 128, 4, 4, 20, 960, 4, 1),
        (128, 64, 8, 2, 8, 3072, 6, 3),
        (112, 336, 2, 1, 40, 4480, 8, 1),
        (72, 144, 6, 3, 12, 1440, 4, 3),
        (120, 72, 4, 1, 32, 960, 6, 2),
        (88, 176, 8, 4, 16, 4224, 8, 4),
        # Four more: a layer of routed experts has eight per-token widths (hidden, query, key/value, heads,
        # the routed share, the hidden states sent to it, the experts, a constant), which eight sizes
        # determine exactly and no more; twelve fit them by least squares.
        (56, 160, 4, 1, 24, 1536, 8, 3),
        (136, 112, 4, 2, 32, 2048, 4, 2),
        (48, 208, 2, 2, 16, 768, 6, 4),
        (144, 152, 6, 1, 24, 3584, 12, 2),
    )
    sizes = []
    for h, i, n, kv, d, v, e, k in rows:
        size = _decoder(h, i, n, kv, d, v)
        size.update({inter_key: i, experts_key: e, "num_experts_per_tok": k})
        sizes.append(size)
    return tuple(sizes)


def _encoder_decoder_t5() -> tuple[dict[str, Any], ...]:
    return tuple({"d_model": h, "d_ff": i, "num_heads": n, "d_kv": d, "vocab_size": v} for h, i, n, _, d, v in _GQA)


def _bart() -> tuple[dict[str, Any], ...]:
    return tuple(
        {
            "d_model": h,
            "encoder_ffn_dim": i,
            "decoder_ffn_dim": i,
            "encoder_attention_heads": n,
            "decoder_attention_heads": n,
            "vocab_size": v,
            "max_position_embeddings": 512,
        }
        for h, i, n, v in _MHA
    )


def _mamba() -> tuple[dict[str, Any], ...]:
    rows = (
        (64, 8, 2, 1024),
        (96, 16, 1, 3072),
        (80, 4, 3, 960),
        (128, 12, 2, 3072),
        (112, 8, 1, 4480),
        (72, 16, 3, 1440),
        (120, 6, 2, 960),
        (88, 10, 2, 4224),
    )
    return tuple({"hidden_size": h, "state_size": s, "expand": e, "vocab_size": v} for h, s, e, v in rows)


_NO_PAD = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaConfig", "LlamaForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS),
    "mistral": Family("mistral", "MistralConfig", "MistralForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS),
    "qwen2": Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS),
    "qwen3": Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS),
    "gemma2": Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS),
    "gemma3_text": Family(
        "gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", tuple(_decoder(*s) for s in _GQA), _LAYERS
    ),
    "phi3": Family(
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        tuple(_decoder(h, i, n, kv, None, v) for h, i, n, kv, _, v in _GQA if _rotates(h, n)),
        _LAYERS,
        fixed=_NO_PAD,
    ),
    "gpt_neox": Family(
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        # GPT-NeoX rotates a quarter of each head (its config's default partial_rotary_factor)
        tuple(_mha(h, i, n, v, kv=False) for h, i, n, v in _MHA if _rotates(h, n, 0.25)),
        _LAYERS,
        fixed=_NO_PAD,
    ),
    "gpt2": Family(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        tuple({"n_embd": h, "n_inner": i, "n_head": n, "vocab_size": v, "n_positions": 512} for h, i, n, v in _MHA),
        ("n_layer",),
        fixed=_NO_PAD,
    ),
    "t5": Family(
        "t5",
        "T5Config",
        "T5ForConditionalGeneration",
        _encoder_decoder_t5(),
        ("num_layers", "num_decoder_layers"),
        fixed={"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
    ),
    "bart": Family(
        "bart",
        "BartConfig",
        "BartForConditionalGeneration",
        _bart(),
        ("encoder_layers", "decoder_layers"),
        fixed={
            "decoder_start_token_id": 2,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "forced_eos_token_id": 2,
        },
    ),
    "mixtral": Family(
        "mixtral", "MixtralConfig", "MixtralForCausalLM", _moe("num_local_experts", "intermediate_size"), _LAYERS
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _moe("num_experts", "moe_intermediate_size"), _LAYERS
    ),
    "mamba": Family(
        "mamba",
        "MambaConfig",
        "MambaForCausalLM",
        _mamba(),
        _LAYERS,
        # transformers' MambaMixer on the CPU (mamba-ssm and causal-conv1d absent) runs mamba_selective_scan's
        # loop over tokens, and autograd keeps each token's state and its discretized A and B*x; mamba-ssm's
        # fused CUDA kernels recompute the states in backward (Gu & Dao 2023, arXiv:2312.00752, section 3.3.2).
        measured="on the CPU's reference scan, which keeps every token's state (intermediate x state_size per "
        "layer); mamba-ssm's fused CUDA kernels recompute the states in backward and keep less, so with them "
        "this is an upper bound",
    ),
}


@dataclass(frozen=True)
class Step:
    """What one training step kept and peaked at, in bytes (activations only: no weights, no gradients)."""

    kept: int
    head_peak: int
    layers_peak: int
    parameters: int  # the model's parameters (4-bit weights counted as their element count)
    # The activation bytes alive right after each allocation (the moments a peak can be at), in the head's
    # phase and in the layers', keyed as _LiveStorages.moments keys them.
    head_moments: Mapping[str, int] = field(default_factory=dict)
    layers_moments: Mapping[str, int] = field(default_factory=dict)


def _build(family: Family, size: Mapping[str, Any], layers: int, mode: Mode, folder: str) -> Any:
    import os

    import transformers

    config = family.config(size, layers, mode.attention)
    if mode.train != "qlora":
        torch.manual_seed(0)
        model = getattr(transformers, family.model_class)(config)
        return model.to(getattr(torch, mode.weights)) if mode.weights != "float32" else model
    from transformers import BitsAndBytesConfig

    if not os.path.exists(os.path.join(folder, "config.json")):  # one checkpoint per size and depth
        torch.manual_seed(0)
        getattr(transformers, family.model_class)(config).save_pretrained(folder)
    compute = getattr(torch, mode.autocast or "float32")
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    loader = getattr(transformers, family.model_class)
    return loader.from_pretrained(
        folder, quantization_config=quant, device_map="cpu", dtype=compute, attn_implementation=mode.attention
    )


def _trainable(model: Any, mode: Mode) -> Any:
    """The model as lora_training() prepares it (LoRA, QLoRA), or as it is (full fine-tuning)."""
    if mode.train == "full":
        if mode.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    import peft

    from whichdevice.training.lora import lora_target_modules

    if mode.train == "qlora":
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
    if mode.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets, _ = lora_target_modules(model)
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=list(targets))
    return peft.get_peft_model(model, config)


def _inputs(config: Any, tokens: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    # An encoder-decoder reads ``tokens`` and writes ``tokens`` (labels of the same length).
    return {"input_ids": ids, "labels": ids.clone()}


def measure_step(
    family: Family, size: Mapping[str, Any], layers: int, tokens: int, mode: Mode, folder: str | None = None
) -> Step:
    """One real training step of ``family`` at ``size`` with ``layers`` layers on ``tokens`` tokens, counted
    (``folder``: where a QLoRA step's checkpoint is saved once and loaded quantized; a new one if None)."""
    with contextlib.ExitStack() as stack:
        where = folder or stack.enter_context(tempfile.TemporaryDirectory())
        model = _trainable(_build(family, size, layers, mode, where), mode)
        model.train()
        config = model.config
        inputs = _inputs(config, tokens, int(config.vocab_size))
        head = model.get_output_embeddings()
        tracker = _LiveStorages()
        tracker.known(itertools.chain(model.parameters(), model.buffers(), inputs.values()))
        marks: dict[str, int] = {}

        def at_head_input(module: Any, args: tuple[Any, ...]) -> None:
            hidden = args[0]
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:

                def mark(grad: torch.Tensor) -> None:
                    marks.setdefault("head_done", len(tracker.events))

                hidden.register_hook(mark)

        handle = head.register_forward_pre_hook(at_head_input)
        cast = torch.autocast("cpu", dtype=getattr(torch, mode.autocast)) if mode.autocast else contextlib.nullcontext()
        with tracker:
            with cast:
                loss = model(**inputs).loss
            forward_end = len(tracker.events)
            loss.backward()
        handle.remove()
        grads = {tracker.serial(p.grad) for p in model.parameters() if p.grad is not None}
        skip = {s for s in grads if s is not None}
        split = marks.get("head_done", forward_end)
        end = len(tracker.events)
        kept = tracker.live(forward_end, skip)
        parameters = sum(p.numel() for p in model.parameters())
        return Step(
            kept,
            tracker.peak(0, split, skip),
            tracker.peak(split, end, skip),
            parameters,
            tracker.moments(0, split, skip),
            tracker.moments(split, end, skip),
        )


def layer_parameters(family: Family, size: Mapping[str, Any]) -> int:
    """The parameters one more layer adds, from meta-device builds at two depths."""
    import transformers

    counts = []
    for layers in (1, 2):
        with torch.device("meta"):
            model = getattr(transformers, family.model_class)(family.config(size, layers, "sdpa"))
        counts.append(sum(p.numel() for p in model.parameters()))
    return counts[1] - counts[0]


def fit(rows: list[tuple[Mapping[str, float], float]], names: tuple[str, ...]) -> tuple[dict[str, float], float]:
    """Least squares of ``value ~ sum(coefficient[name] * symbols[name])`` over ``rows``; the columns that
    are linear combinations of earlier ones (equal across the family's sizes) are left out. Returns the
    coefficients and the largest relative residual."""
    matrix = torch.tensor([[float(s[n]) for n in names] for s, _ in rows], dtype=torch.float64)
    values = torch.tensor([v for _, v in rows], dtype=torch.float64)
    used: list[int] = []
    for j in range(len(names)):
        trial = matrix[:, [*used, j]]
        if torch.linalg.matrix_rank(trial, rtol=1e-9) == len(used) + 1:
            used.append(j)
    solution = torch.linalg.lstsq(matrix[:, used], values.unsqueeze(1)).solution.squeeze(1)
    predicted = matrix[:, used] @ solution
    scale = values.abs().clamp(min=1.0)
    residual = float(((predicted - values).abs() / scale).max()) if len(values) else 0.0
    return {names[j]: float(c) for j, c in zip(used, solution, strict=True)}, residual


def apply(coefficients: Mapping[str, float], symbols: Mapping[str, float]) -> float:
    return sum(c * symbols[name] for name, c in coefficients.items())


def quadratic(points: Mapping[int, float]) -> tuple[float, float, float]:
    """(a, b, c) of ``a + b*T + c*T**2`` through three (T, value) points."""
    (t1, v1), (t2, v2), (t3, v3) = sorted(points.items())
    d21 = (v2 - v1) / (t2 - t1)
    d32 = (v3 - v2) / (t3 - t2)
    c = (d32 - d21) / (t3 - t1)
    b = d21 - c * (t1 + t2)
    a = v1 - b * t1 - c * t1 * t1
    return a, b, c
