"""What a whole job needs besides the weights: the KV cache, activations, gradients, optimizer state.

Each figure is a named :class:`Term` with its size and the formula it came from, so the trace can say
it. The shape facts (layers, KV heads, head size, sliding window) come from the model's config
(:class:`whichdevice.model.shape.ModelShape`, read once with the model's other facts). The
formulas are upper bounds: the
benchmark ``benchmarks/placement_memory.py`` checks them against measured peaks on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from whichdevice.core.dtypes import item_size
from whichdevice.core.job import Job
from whichdevice.core.sizes import format_bytes
from whichdevice.model.shape import ModelShape

__all__ = [
    "ADAPTER_FRACTION",
    "OFFLOADS",
    "OPTIMIZER_STATES",
    "WORKSPACE",
    "Job",
    "JobMemory",
    "ModelShape",
    "Term",
    "headroom_tokens",
    "job_memory",
    "kv_cache_bytes",
]

# Optimizer state per trainable parameter, in units of the parameter's own size (torch's AdamW keeps
# exp_avg and exp_avg_sq like the parameter), or in bytes for the 8-bit optimizers (one byte each).
OPTIMIZER_STATES = {"adamw": ("x", 2.0), "adamw_8bit": ("bytes", 2.0), "sgd": ("x", 0.0)}
# LoRA adapters (r=16-64 on every linear layer of a 7B model) train at most this share of the weights.
ADAPTER_FRACTION = 0.02
# A generation's hidden states and MLP intermediates, per token, as multiples of hidden and intermediate
# sizes (residual, norm, q/k/v/o, gate/up/act): measured peaks on the CPU stay below these.
_INFER_HIDDEN, _INFER_MLP = 8, 4
# Training keeps every layer's inputs for backward: per token and layer (after Korthikanti et al. 2022, 34sbh
# for 16-bit, with the MLP counted through the intermediate size and room for dropout masks).
_TRAIN_HIDDEN, _TRAIN_MLP = 16, 10
# The runtime's own working memory once a job runs (allocator caches, kernels' scratch, autograd's
# bookkeeping): measured 3-15 MiB on the CPU for tiny models; cuBLAS keeps up to 32 MiB per stream.
WORKSPACE = 32 * 1024**2


OFFLOADS = ("cpu", "disk")


@dataclass(frozen=True)
class Term:
    """One part of the job's memory: its name, its size in bytes and how it was computed."""

    name: str
    bytes: int
    why: str

    def __str__(self) -> str:
        return f"{self.name} {format_bytes(self.bytes)} ({self.why})"


@dataclass(frozen=True)
class JobMemory:
    """The terms besides the weights, and what was assumed where the caller did not say."""

    terms: tuple[Term, ...] = ()
    assumed: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    def describe(self, weights: int) -> str:
        parts = [f"weights {format_bytes(weights)}", *(str(t) for t in self.terms)]
        return " + ".join(parts) + f" = {format_bytes(weights + self.bytes)}"


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, dtype: str) -> int:
    """2 (keys, values) x layers x KV heads x head size x tokens x batch x bytes, sliding layers capped."""
    per_token = 2 * shape.kv_heads * shape.head_dim * batch * item_size(dtype)
    full_layers = shape.layers - shape.sliding_layers
    window_tokens = min(tokens, shape.sliding_window or tokens)
    return per_token * (full_layers * tokens + shape.sliding_layers * window_tokens)


def headroom_tokens(shape: ModelShape, headroom: int, dtype: str) -> int:
    """How many tokens of one sequence's KV cache fit in ``headroom`` bytes."""
    per_token = kv_cache_bytes(shape, 1, 1, dtype)
    return headroom // per_token if per_token else 0


def _scores(shape: ModelShape, tokens: int, batch: int, size: int, eager: bool) -> tuple[int, str]:
    if not eager:
        return 0, ""
    # eager attention holds the scores and their softmax, T x T per head
    return 2 * batch * shape.heads * tokens * tokens * size, ", eager attention's T x T scores"


def _inference_activations(shape: ModelShape, tokens: int, batch: int, dtype: str, eager: bool) -> Term:
    # The prefill of a prompt as long as the whole sequence is the largest forward pass of a generate.
    size = item_size(dtype)
    stream = batch * tokens * (_INFER_HIDDEN * shape.hidden + _INFER_MLP * shape.intermediate) * size
    scores, said = _scores(shape, tokens, batch, size, eager)
    logits = 2 * batch * shape.vocab * 4  # the last position's logits in float32, and their softmax
    return Term(
        "activations",
        stream + scores + logits,
        f"the largest forward pass: {batch} x {tokens} tokens through one layer{said}, and the next-token logits",
    )


def _training_activations(shape: ModelShape, tokens: int, batch: int, dtype: str, eager: bool) -> Term:
    size = item_size(dtype)
    per_layer = batch * tokens * (_TRAIN_HIDDEN * shape.hidden + _TRAIN_MLP * shape.intermediate) * size
    scores, said = _scores(shape, tokens, batch, size, eager)
    logits = 3 * batch * tokens * shape.vocab * 4  # logits, their log-softmax and its gradient, in float32
    return Term(
        "activations",
        (per_layer + scores) * shape.layers + logits,
        f"{batch} x {tokens} tokens kept for backward in each of {shape.layers} layers{said}, and the loss's logits",
    )


def _training_state(params: int, dtype: str, optimizer: str, trainable: float) -> list[Term]:
    size = item_size(dtype)
    train = int(params * trainable)
    who = "every parameter" if trainable >= 1 else f"the LoRA adapters (up to {trainable:.0%} of the parameters)"
    unit, factor = OPTIMIZER_STATES[optimizer]
    per = factor * size if unit == "x" else factor
    name = {"adamw": "AdamW (Trainer's default)", "adamw_8bit": "8-bit AdamW", "sgd": "SGD"}[optimizer]
    return [
        Term("gradients", train * size, f"{who} in {dtype}"),
        Term("optimizer state", int(train * per), f"{name}: {per:g} bytes per trained parameter"),
    ]


def job_memory(
    shape: ModelShape | None,
    params: int,
    task: str,
    dtype: str,
    batch_size: int | None,
    max_length: int | None,
    *,
    optimizer: str = "adamw",
    trainable: float = 1.0,
    eager: bool = False,
) -> JobMemory:
    """The memory ``task`` needs besides the weights, for ``batch_size`` sequences of ``max_length`` tokens.

    Without ``max_length`` and ``batch_size`` an inference job counts nothing besides the weights
    (the placement's headroom is for the KV cache then); training always counts gradients and the
    optimizer's state, and activations once the sequences are known.
    """
    terms: list[Term] = []
    assumed: list[str] = []
    if task == "training":
        terms += _training_state(params, dtype, optimizer, trainable)
    sized = max_length is not None or batch_size is not None
    if shape is None:
        if sized:
            assumed.append("the config does not give layers and heads, so the KV cache and activations are not counted")
        return JobMemory(tuple(terms), tuple(assumed))
    if not sized:
        what = "activations" if task == "training" else "the KV cache and activations"
        assumed.append(f"{what} not counted: pass max_length= (and batch_size=) to size them")
        return JobMemory(tuple(terms), tuple(assumed))
    batch = batch_size or 1
    tokens = max_length or min(shape.max_positions or 2048, 2048)
    if batch_size is None:
        assumed.append("batch_size=1 assumed")
    if max_length is None:
        assumed.append(f"max_length={tokens} assumed (the model's context, at most 2048)")
    terms.append(Term("workspace", WORKSPACE, "the runtime's allocator caches and kernels' scratch"))
    if task == "training":
        terms.append(_training_activations(shape, tokens, batch, dtype, eager))
    else:
        kv = kv_cache_bytes(shape, tokens, batch, dtype)
        window = (
            f", {shape.sliding_layers} sliding layers keep {shape.sliding_window}"
            if shape.sliding_layers and shape.sliding_window and shape.sliding_window < tokens
            else ""
        )
        why = (
            f"2 x {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} x {tokens} tokens x "
            f"{batch} sequences in {dtype}{window}"
        )
        terms += [Term("KV cache", kv, why), _inference_activations(shape, tokens, batch, dtype, eager)]
    return JobMemory(tuple(terms), tuple(assumed))
