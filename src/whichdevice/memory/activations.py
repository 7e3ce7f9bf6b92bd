"""Training activations from what autograd keeps: a table measured on real transformers classes, per family.

``scripts/gen_activation_table.py`` trains each family's transformers class one step on the CPU at eight
small sizes (twelve for routed experts), two depths and three lengths, counting every storage that step
creates, and fits what it measured onto the widths a token's tensors are made of (:func:`token_widths`).
The fit is the table (``activation_table.json``, with the versions and the date it was made); this module
evaluates it for a model's shape. Four quantities, each ``constant + per token x T + per token squared x T^2`` with the
coefficients applied to the widths:

* ``layer``: what one layer keeps for backward (with checkpointing, only its input);
* ``rest``: what the embeddings, the head and the loss keep;
* ``head``: how far the loss and the head's backward rise above what the forward kept;
* ``layers``: how far the layers' backward rises above what the layers kept (with checkpointing, the
  recomputed layer: its whole forward kept again while its backward runs).

A family that was not measured takes the closest measured one, and says which. A family whose measured
code path keeps more than the one a GPU runs (Mamba's scan on the CPU, without mamba-ssm's fused kernels)
says so beside its figures: the table's ``measured``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.model.shape import ModelShape

__all__ = [
    "ActivationMode",
    "Activations",
    "family_of",
    "kind_of",
    "table_source",
    "token_widths",
    "training_activations",
]

TABLE = "activation_table.json"
QUANTITIES = ("layer", "rest", "head", "layers")


@frozen_record
class ActivationMode:
    """How a training step computes: what it trains (``full``, ``lora`` on a frozen base, ``qlora`` on a
    4-bit base), the weights' dtype, the autocast dtype (None: none), the attention, checkpointing."""

    train: str
    weights: str
    autocast: str | None
    attention: str
    checkpointing: bool

    def key(self) -> str:
        # fp16 and bf16 keep the same bytes (the generator checks it): the table measures bf16 for both.
        weights = "bfloat16" if self.weights == "float16" else self.weights
        cast = "bfloat16" if self.autocast == "float16" else (self.autocast or "none")
        if self.train == "qlora":
            weights = "4bit"
        elif self.train == "lora" and weights == "bfloat16":
            cast = "bfloat16"  # adapters on a 16-bit base compute in it, with autocast or without
        elif self.train == "full" and weights == "bfloat16":
            cast = "none"  # autocast over 16-bit weights copies nothing: as without it
        attention = "eager" if self.attention == "eager" else "sdpa"
        return f"{self.train}/{weights}/{cast}/{attention}/{'ckpt' if self.checkpointing else 'keep'}"


def token_widths(shape: ModelShape, layer_params: float, largest_weight: float) -> dict[str, float]:
    """The widths the table's coefficients apply to. Per token: the hidden size, the dense MLP, the query
    and key/value projections, the heads, routed experts (each token's share of them, the hidden states
    it sends them, the router's scores), a state-space layer's state; outside the layers the vocabulary
    and the head size (rotary tables). Constant: one layer's parameters (autocast's 16-bit copies), the
    head's, and the largest weight (a 4-bit weight dequantized for backward)."""
    routed = shape.experts_per_token
    return {
        "one": 1.0,
        "hidden": float(shape.hidden),
        "intermediate": float(shape.intermediate if shape.state_size else shape.mlp_intermediate),
        "query": float(shape.heads * shape.head_dim),
        "key_value": float(shape.kv_heads * shape.head_dim),
        "heads": float(shape.heads),
        "routed": float(routed * shape.expert_intermediate),
        "routed_hidden": float(routed * shape.hidden),
        "experts": float(shape.experts),
        "state": float(shape.intermediate * shape.state_size),
        "vocab": float(shape.vocab),
        "head_dim": float(shape.head_dim),
        "layer_params": float(layer_params),
        "head_params": float(shape.vocab * shape.hidden),
        "largest_weight": float(largest_weight),
    }


@cache
def _table() -> dict[str, Any]:
    text = resources.files("whichdevice.memory").joinpath(TABLE).read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def table_source() -> str:
    """Where the table came from: the script, the date and the versions it was measured with."""
    made = _table()["generated"]
    versions = ", ".join(f"{k} {v}" for k, v in made["versions"].items())
    return f"{made['script']} on {made['date']} ({versions})"


def kind_of(shape: ModelShape) -> str:
    """How a model's layers are built, as far as activations go: a state-space model, an encoder-decoder,
    routed experts, or a dense decoder."""
    if shape.state_size > 0:
        return "state-space"
    if shape.decoder_layers > 0:
        return "encoder-decoder"
    return "routed experts" if shape.experts > 0 else "dense decoder"


# Where a model_type was not measured and no measured family of its kind shares its name: the family that
# prices each kind (the table says each family's kind, as gen_activation_table.py read it from its config).
_FALLBACK = {"state-space": "mamba", "encoder-decoder": "t5", "routed experts": "mixtral", "dense decoder": "llama"}


def family_of(shape: ModelShape) -> tuple[str, str | None]:
    """(the measured family whose coefficients price ``shape``, why another family's where it is not its own):
    its own model_type; else a measured family of the same kind whose name it shares ("qwen2_5_vl_text" ->
    "qwen2", "gemma3" -> "gemma3_text"); else the kind's fallback."""
    families = _table()["families"]
    own = shape.model_type or ""
    if own in families:
        return own, None
    kind = kind_of(shape)
    for family, entry in families.items():
        if own and entry.get("kind") == kind and (own.startswith(family) or family.startswith(own)):
            return family, f"model_type {own!r} was not measured; {family!r} is its closest family by name"
    named = f"model_type {own!r}" if own else "a config without model_type"
    family = _FALLBACK[kind]
    if family not in families:  # a table without the kind's own family: another of its kind, else a dense decoder
        family = next((f for f, entry in families.items() if entry.get("kind") == kind), "")
    if not family:
        family = _FALLBACK["dense decoder"]
        return family, f"{named} was not measured, nor any {kind} model: priced as {family!r}, a dense decoder"
    return family, f"{named} was not measured; priced as {family!r}, the measured family for a {kind} model"


def _evaluate(quantity: Mapping[str, Any], widths: Mapping[str, float], rows: int, tokens: int) -> float:
    """A quantity of the table for ``rows`` sequences of ``tokens``: a peak is the highest of its moments."""
    if "moments" in quantity:
        return float(max(_evaluate(moment, widths, rows, tokens) for moment in quantity["moments"]))

    def apply(part: str) -> float:
        return float(sum(c * widths.get(name, 0.0) for name, c in quantity.get(part, {}).items()))

    return apply("constant") + apply("per_token") * rows * tokens + apply("per_token_squared") * rows * tokens * tokens


def _measured(modes: Mapping[str, Any], key: str) -> str | None:
    """``key``, or the measured mode closest to it: the same training and checkpointing, then the same
    weights, autocast and attention as far as they were measured (an eager-only class has no sdpa row);
    None where no mode of that training and checkpointing was measured."""
    if key in modes:
        return key
    train, weights, cast, attention, ckpt = key.split("/")
    same = [k.split("/") for k in modes if k.startswith(f"{train}/") and k.endswith(f"/{ckpt}")]
    if not same:
        return None
    score = lambda k: (k[1] == weights, k[2] == cast, k[3] == attention)  # noqa: E731
    return "/".join(max(same, key=score))


# From the lightest training to the heaviest: a training a family was not measured in is priced from its
# nearest measured one (QLoRA from LoRA, LoRA from full).
_TRAININGS = ("full", "lora", "qlora")
# The family every mode is measured for (scripts/gen_activation_table.py measures its modes in full).
_REFERENCE = "llama"


def _nearest(modes: Mapping[str, Any], key: str) -> str | None:
    """The measured mode of another training closest to ``key`` (same checkpointing, then the nearest
    training, then the same autocast and attention); None where none shares its checkpointing."""
    train, _, cast, attention, ckpt = key.split("/")
    others = [k.split("/") for k in modes if k.endswith(f"/{ckpt}") and k.split("/")[0] != train]
    if not others:
        return None
    rank = _TRAININGS.index(train) if train in _TRAININGS else 0
    score = lambda k: (-abs(_TRAININGS.index(k[0]) - rank), k[2] == cast, k[3] == attention)  # noqa: E731
    return "/".join(max(others, key=score))


def _values(
    family: str, key: str, widths: Mapping[str, float], batch: int, tokens: int
) -> tuple[dict[str, float], str, str | None]:
    """Each quantity of ``key`` for ``family`` at ``widths``, the mode it was read from, and why another
    one where the family was not measured in that training: its nearest measured training plus what
    that training adds as the reference family measured it, at this model's widths."""
    families = _table()["families"]
    modes = families[family]["modes"]

    def at(table: Mapping[str, Any], mode: str) -> dict[str, float]:
        return {q: _evaluate(table[mode][q], widths, batch, tokens) for q in QUANTITIES}

    used = _measured(modes, key)
    if used is not None:
        return at(modes, used), used, None
    near = _nearest(modes, key)
    reference = families.get(_REFERENCE, {}).get("modes", {})
    ref_key, ref_near = _measured(reference, key), _measured(reference, near) if near else None
    if ref_key is None:  # only a damaged table lacks a mode of the reference family
        raise LookupError(f"the activation table has no {key} rows for {_REFERENCE!r}")
    if near is None or ref_near is None:
        why = f"{family!r} was not measured in {key}: priced from {_REFERENCE!r}'s {ref_key} rows at its widths"
        return at(reference, ref_key), ref_key, why
    own, added, base = at(modes, near), at(reference, ref_key), at(reference, ref_near)
    value = {q: own[q] + added[q] - base[q] for q in QUANTITIES}
    why = (
        f"{family!r} was not measured in {key.split('/')[0]} training: priced from its {near} rows plus what "
        f"{_REFERENCE!r} measured {ref_key} to add over {ref_near}"
    )
    return value, near, why


@frozen_record
class Activations:
    """A training step's activations in bytes: what the forward keeps, and the two backward peaks."""

    kept: int
    head_peak: int
    layers_peak: int
    # What is left at the end of backward: the first layer's kept activations and its backward's own.
    layers_end: int
    family: str
    note: str | None  # why another family's coefficients, where the model's own were not measured
    mode: str

    @property
    def peak(self) -> int:
        return max(self.head_peak, self.layers_peak)


def training_activations(
    shape: ModelShape, mode: ActivationMode, batch: int, tokens: int, *, params: int, largest_weight: int
) -> Activations:
    """The activations of one training step of ``batch`` sequences of ``tokens`` tokens (an encoder-decoder:
    ``tokens`` into the encoder and ``tokens`` out of the decoder) trained as ``mode``; ``params`` and
    ``largest_weight`` are the model's parameters and its largest linear weight's."""
    family, note = family_of(shape)
    layers = max(shape.layers, shape.decoder_layers)  # an encoder-decoder's layers were measured in pairs
    outside = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)  # the embedding and the head
    widths = token_widths(shape, max(0, params - outside) / layers, largest_weight)
    computed, key, transferred = _values(family, mode.key(), widths, batch, tokens)
    value = {q: max(0.0, v) for q, v in computed.items()}
    if transferred is not None:
        note = f"{note}; {transferred}" if note else transferred
    path = _table()["families"][family].get("measured")
    if isinstance(path, str) and path:  # where the measured code path keeps more than a GPU's (Mamba's scan)
        measured = f"{family!r} was measured {path}"
        note = f"{note}; {measured}" if note else measured
    layer_kept = value["layer"] * layers
    kept = layer_kept + value["rest"]
    layers_peak, layers_end = layer_kept + value["layers"], value["layer"] + value["layers"]
    if shape.tied_embeddings and mode.train == "full":
        # A tied head's gradient and the embedding's are both alive when the embedding's backward adds
        # them into the one .grad: two vocab x hidden temporaries in the weights' dtype at the end of
        # backward (measured on qwen2 tied at 4,000 and 16,000 words, fp32 weights: 8.0 bytes per head
        # parameter over the untied step). The table's families measured untied do not hold it.
        tied = 2 * shape.vocab * shape.hidden * (4 if mode.weights == "float32" else 2)
        layers_peak, layers_end = max(layers_peak, tied), max(layers_end, tied)
    return Activations(
        kept=int(kept),
        head_peak=int(kept + value["head"]),
        layers_peak=int(layers_peak),
        layers_end=int(layers_end),
        family=family,
        note=note,
        mode=key,
    )
