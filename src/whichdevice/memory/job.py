"""What a job needs besides the weights: the records (Term, JobMemory), and an inference job's KV cache and activations.

Each figure is a named :class:`Term` with its size and the formula it came from, so the trace can say
it. The shape facts (layers, KV heads, head size, sliding window) come from the model's config
(:class:`whichdevice.model.shape.ModelShape`, read once with the model's other facts). The inference
formulas are upper bounds (``benchmarks/placement_memory.py`` checks them against measured peaks on the
CPU); a training job is priced by memory/training_job.py from what autograd keeps.
"""

from __future__ import annotations

from whichdevice.core.dtypes import item_size
from whichdevice.core.frozen import frozen_record
from whichdevice.core.job import Job
from whichdevice.core.sizes import format_bytes
from whichdevice.model.shape import ModelShape

__all__ = [
    "OFFLOADS",
    "WORKSPACE",
    "Job",
    "JobMemory",
    "ModelShape",
    "Term",
    "headroom_tokens",
    "job_memory",
    "kv_cache_bytes",
    "state_cache_bytes",
]

# A generation's hidden states and MLP intermediates, per token, as multiples of hidden and intermediate
# sizes (residual, norm, q/k/v/o, gate/up/act): measured peaks on the CPU stay below these.
_INFER_HIDDEN, _INFER_MLP = 8, 4
# The runtime's own working memory once a job runs (allocator caches, kernels' scratch, autograd's
# bookkeeping): measured 3-15 MiB on the CPU for tiny models; cuBLAS keeps up to 32 MiB per stream.
WORKSPACE = 32 * 1024**2


OFFLOADS = ("cpu", "disk")


@frozen_record
class Term:
    """One part of the job's memory: its name, its size in bytes and how it was computed."""

    name: str
    bytes: int
    why: str

    def __str__(self) -> str:
        return f"{self.name} {format_bytes(self.bytes)} ({self.why})"


@frozen_record
class JobMemory:
    """The terms besides the weights, and what was assumed where the caller did not say. ``peak``: where
    the terms do not all coexist (training: activations are freed as gradients are made), the bytes
    besides the weights at the job's highest moment, which ``phase`` names; None: their sum."""

    terms: tuple[Term, ...] = ()
    assumed: tuple[str, ...] = ()
    peak: int | None = None
    phase: str | None = None

    @property
    def bytes(self) -> int:
        return self.peak if self.peak is not None else sum(t.bytes for t in self.terms)

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    def figures(self, weights: int) -> str:
        """The terms' sizes alone, for an error that must stay short."""
        return ", ".join(
            [f"weights {format_bytes(weights)}", *(f"{t.name} {format_bytes(t.bytes)}" for t in self.terms)]
        )

    def describe(self, weights: int) -> str:
        parts = [f"weights {format_bytes(weights)}", *(str(t) for t in self.terms)]
        if self.peak is None:
            return " + ".join(parts) + f" = {format_bytes(weights + self.bytes)}"
        return "; ".join(parts) + f"; {self.phase}: {format_bytes(weights + self.bytes)}"


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, dtype: str) -> int:
    """2 (keys, values) x layers x KV heads x head size x tokens x batch x bytes, sliding layers capped."""
    per_token = 2 * shape.kv_heads * shape.head_dim * batch * item_size(dtype)
    full_layers = shape.layers - shape.sliding_layers
    window_tokens = min(tokens, shape.sliding_window or tokens)
    return per_token * (full_layers * tokens + shape.sliding_layers * window_tokens)


def state_cache_bytes(shape: ModelShape, batch: int, dtype: str) -> int:
    """A state-space model's cache, the same at any length: per layer and sequence, the convolution's last
    ``conv_kernel`` inputs of its channels (the intermediate ones, and Mamba2's B and C groups) in ``dtype``,
    and the scan's state (intermediate x state size) in float32, as transformers' cache layers hold them."""
    if not shape.state_size:
        return 0
    per_layer = shape.conv_channels * shape.conv_kernel * item_size(dtype) + shape.intermediate * shape.state_size * 4
    return shape.layers * batch * per_layer


def headroom_tokens(shape: ModelShape, headroom: int, dtype: str) -> int:
    """How many tokens of one sequence's KV cache fit in ``headroom`` bytes."""
    per_token = kv_cache_bytes(shape, 1, 1, dtype)
    return headroom // per_token if per_token else 0


def _scores(shape: ModelShape, tokens: int, batch: int, size: int, eager: bool) -> tuple[int, str]:
    if not eager or not shape.heads:  # no attention (a state-space model): no scores
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


def _cache(shape: ModelShape, tokens: int, batch: int, dtype: str) -> Term:
    """What generating keeps between steps: a state-space model's states, else the KV cache."""
    if shape.state_size:
        why = (
            f"{shape.layers} layers x {batch} sequences x (a convolution window of {shape.conv_kernel} over "
            f"{shape.conv_channels} channels in {dtype}, and a scan state of {shape.intermediate} x "
            f"{shape.state_size} in float32), at any length"
        )
        return Term("state cache", state_cache_bytes(shape, batch, dtype), why)
    window = (
        f", {shape.sliding_layers} sliding layers keep {shape.sliding_window}"
        if shape.sliding_layers and shape.sliding_window and shape.sliding_window < tokens
        else ""
    )
    why = (
        f"2 x {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} x {tokens} tokens x "
        f"{batch} sequences in {dtype}{window}"
    )
    return Term("KV cache", kv_cache_bytes(shape, tokens, batch, dtype), why)


def job_memory(
    shape: ModelShape | None,
    dtype: str,
    batch_size: int | None,
    max_length: int | None,
    *,
    eager: bool = False,
) -> JobMemory:
    """The memory an inference job needs besides the weights, for ``batch_size`` sequences of ``max_length``
    tokens (training: memory/training_job.py). Without ``max_length`` and ``batch_size`` it counts nothing
    besides the weights (the placement's headroom is for the KV cache then)."""
    terms: list[Term] = []
    assumed: list[str] = []
    sized = max_length is not None or batch_size is not None
    if shape is None:
        if sized:
            assumed.append("the config does not give layers and heads, so the KV cache and activations are not counted")
        return JobMemory(tuple(terms), tuple(assumed))
    if not sized:
        assumed.append("the KV cache and activations not counted: pass max_length= (and batch_size=) to size them")
        return JobMemory(tuple(terms), tuple(assumed))
    batch = batch_size or 1
    tokens = max_length or min(shape.max_positions or 2048, 2048)
    if batch_size is None:
        assumed.append("batch_size=1 assumed")
    if max_length is None:
        assumed.append(f"max_length={tokens} assumed (the model's context, at most 2048)")
    terms.append(Term("workspace", WORKSPACE, "the runtime's allocator caches and kernels' scratch"))
    terms += [_cache(shape, tokens, batch, dtype), _inference_activations(shape, tokens, batch, dtype, eager)]
    return JobMemory(tuple(terms), tuple(assumed))
