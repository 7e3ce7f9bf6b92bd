"""Serving many requests: continuous batching (``model.generate_batch``), the attention it runs, what it is handed.

A job is *serving* when ``resolve_device(serving=True)`` says so: many independent requests of their
own lengths, which ``generate_batch`` (transformers' ``ContinuousMixin``) schedules into one running
batch, joining and leaving at every step. It is its own argument, not read from ``batch_size``:
``batch_size`` describes the padded batch one ``generate()`` call runs, and the CPU decode attention
(``whichdevice_sdpa``), measured 6-16x faster for those steps, is an attention ``generate_batch``
refuses (``ContinuousBatchingManager.switch_to_cb_friendly_attn`` raises for anything but sdpa, eager
and FlashAttention), so inferring serving from a batch would take it from every batched ``generate()``.

What is checked, and handed over:

- **Whether it applies**: the installed transformers has ``generate_batch`` (read from its files), for
  inference. Otherwise the trace says why, and nothing is handed over.
- **The attention**: the one the resolution loads the model with is asked of transformers' own rule
  (``switch_to_cb_friendly_attn`` on a stand-in with that name), so a refused one never reaches
  ``from_pretrained``; the CPU decode attention is not chosen for such a job.
- **auto_switch_to_flash=False** (``ContinuousBatchingConfig``), where no FlashAttention fits this
  device and dtype: ``generate_batch`` otherwise switches a half-precision sdpa or eager model to
  FlashAttention whenever ``is_flash_attn_3_available(kernels_fallback_ok=True)`` (or 2) says yes,
  and with the ``kernels`` package installed that calls ``get_kernel`` on the Hub FlashAttention
  repository: it downloads and runs compiled code that ``use_kernels`` never asked for (on a CPU, or
  offline, it reaches for the Hub and fails), and the model no longer runs the attention announced.
- **Accelerator graphs and async batching**, said, not handed over: on a device with graphs (CUDA, XPU),
  transformers turns both off for a model that runs no FlashAttention (``_graphs_off``).
- **Everything else** is left to transformers, and the trace says so: the cache's blocks, batch tokens
  and memory share are sized by it from the memory free after loading, CUDA graphs and compile
  settings inferred for the device, which whichdevice's probe cannot see better than it does.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from whichdevice.attention.flash import FLASH, flash_attention_package, flash_fits
from whichdevice.attention.record import Serving
from whichdevice.core.packages import package_version

if TYPE_CHECKING:
    from whichdevice.core.job import Job
    from whichdevice.core.records import Backend, TraceStep
    from whichdevice.device.target import Target

__all__ = ["continuous_batching_available", "decide_serving", "generate_batch_refusal"]

# Where generate_batch lives (transformers 5.x): read as text, so transformers is not imported to answer.
_API_FILE = ("generation", "continuous_batching", "continuous_api.py")


@lru_cache(maxsize=1)
def continuous_batching_available() -> tuple[bool, str]:
    """Whether the installed transformers has ``generate_batch``, and why (read from its files)."""
    version = package_version("transformers") or "?"
    spec = find_spec("transformers")
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    for root in roots:
        try:
            text = Path(root, *_API_FILE).read_text(encoding="utf-8")
        except OSError:
            continue
        if "def generate_batch(" in text and "continuous_batching_config" in text:
            return True, f"transformers {version} has generate_batch (generation/continuous_batching)"
    return False, (
        f"transformers {version} has no generate_batch with a continuous_batching_config "
        "(generation/continuous_batching/continuous_api.py): requests are served by generate() one batch at a time"
    )


def generate_batch_refusal(attention: str | None) -> str | None:
    """Why ``generate_batch`` refuses a model loaded with ``attention`` (None: it runs it), asked of
    transformers' own rule: ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` on a stand-in
    model that carries the name (float32, no FlashAttention support: it is never switched)."""
    if attention is None:
        return None  # transformers' own pick: sdpa, or eager, which generate_batch runs as paged|eager
    import torch
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    def set_attn_implementation(name: str) -> None:
        stand_in.config._attn_implementation = name

    stand_in = SimpleNamespace(
        config=SimpleNamespace(_attn_implementation=attention),
        dtype=torch.float32,
        _supports_flash_attn=False,
        set_attn_implementation=set_attn_implementation,
    )
    try:
        ContinuousBatchingManager.switch_to_cb_friendly_attn(SimpleNamespace(), stand_in, False)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # another transformers: the rule could not be asked
        return None if attention in ("sdpa", "eager") else f"generate_batch's attention rule could not be read ({exc})"
    return None


def decide_serving(
    target: Target,
    job: Job,
    *,
    attention: str | None,
    dtype: str | None,
    use_kernels: bool,
) -> tuple[Serving | None, list[TraceStep]]:
    """Whether continuous batching applies to this job, and the ContinuousBatchingConfig fields
    whichdevice checked for it; the trace lines say why, and what is left to transformers."""
    from whichdevice.core.records import TraceStep

    if not job.serving:
        return None, []
    task = job.task
    available, why = continuous_batching_available()
    if task != "inference" or not available:
        reason = why if available is False else "serving is an inference job"
        return Serving(False), [TraceStep("serving", f"continuous batching does not apply: {reason}")]
    refusal = generate_batch_refusal(attention)
    if refusal is not None:  # choose_attention keeps refused names away from serving jobs; a guard, said
        return Serving(False), [TraceStep("serving", f"continuous batching does not apply: {refusal}")]
    config: dict[str, Any] = {}
    steps = [
        TraceStep(
            "serving",
            f"continuous batching applies: serving=True, and {why}; model.generate_batch(inputs, "
            "**res.generate_batch_kwargs()) runs the requests, joining and leaving the batch at every step",
        )
    ]
    switch, switch_why = _auto_switch(target, attention, dtype, use_kernels)
    if switch is not None:
        config["auto_switch_to_flash"] = switch
    steps.append(TraceStep("serving", switch_why))
    graphs = _graphs_off(target, attention, runs_flash=switch is None and dtype in ("float16", "bfloat16"))
    if graphs is not None:
        steps.append(TraceStep("serving", graphs))
    sizes, sizes_why = _cpu_cache(target.backend, job)
    config.update(sizes)
    steps.append(TraceStep("warning" if target.name == "cpu" and not sizes else "serving", sizes_why))
    return Serving(True, config), steps


# Measured here (transformers 5.25, torch 2.13, an AMD EPYC machine with 24 GiB shared with other
# jobs): generate_batch on a 107k-parameter bf16 Llama with its own sizing, two prompts of 5 and 2
# tokens and 6 new ones, logged 14,234 MB "available for cache allocation" (8,192 batch tokens, 3,403
# sectors), peaked at 14.7 GB resident and took 33 s; with num_blocks=16, max_batch_tokens=64, 1.5 s.
_CPU_DEFAULT_COST = "a 107k-parameter Llama's two short prompts peaked at 14.7 GB resident and took 33 s here"


def _cpu_cache(backend: Backend, job: Job) -> tuple[dict[str, int], str]:
    """num_blocks and max_batch_tokens for a CPU job whose sequences are said; on a GPU, left to transformers.

    transformers sizes the paged cache, and sdpa's attention mask over it, from the memory free after
    loading (``max_memory_percent`` of it): a GPU's own memory, but on a CPU the machine's RAM, which
    it then takes nearly all of. ``num_blocks`` is, by its docstring, the number of whole-model blocks
    of ``page_size`` tokens the cache must hold: ``batch_size`` requests of ``max_length`` tokens need
    ``batch_size * ceil(max_length / page_size)``; no step schedules more tokens than all of them
    together, ``batch_size * max_length``, the cap given to ``max_batch_tokens``."""
    left = (
        "left to transformers: the cache's blocks, batch tokens and memory share (sized from the memory free "
        "after loading), CUDA graphs and compile settings (inferred for the device), the scheduler"
    )
    if backend.name != "cpu":
        return {}, left
    if job.batch_size is None or job.max_length is None:
        return {}, (
            "generate_batch on a CPU sizes its cache and attention mask from the machine's free memory, nearly all "
            f"of it ({_CPU_DEFAULT_COST}): pass batch_size= (requests at once) and max_length= (tokens each, prompt "
            "included) to get num_blocks and max_batch_tokens sized to the job, or set them in "
            "ContinuousBatchingConfig yourself"
        )
    page = _page_size()
    blocks = job.batch_size * -(-job.max_length // page)
    tokens = job.batch_size * job.max_length
    return {"num_blocks": blocks, "max_batch_tokens": tokens}, (
        f"num_blocks={blocks}, max_batch_tokens={tokens}: {job.batch_size} requests of {job.max_length} tokens "
        f"in blocks of {page} tokens (ContinuousBatchingConfig's page_size), where transformers would size the "
        f"cache from the machine's free memory on a CPU ({_CPU_DEFAULT_COST}); more requests than "
        "batch_size wait for blocks. Left to transformers: the memory share, compile settings, the scheduler"
    )


def _page_size() -> int:
    """ContinuousBatchingConfig's own default page_size on the installed transformers."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    (page,) = [f.default for f in dataclasses.fields(ContinuousBatchingConfig) if f.name == "page_size"]
    return int(page)  # type: ignore[arg-type]


def _graphs_off(target: Target, attention: str | None, *, runs_flash: bool) -> str | None:
    """What transformers turns off for a model that runs no FlashAttention under generate_batch, on a device
    with accelerator graphs; None where it runs FlashAttention or the device has no graphs.

    transformers' continuous_batching/initialization.py: with ``use_cuda_graph`` unset (and no
    ``q_padding_interval_size``/``kv_padding_interval_size``), ``decide_use_cuda_graphs`` turns graphs on
    only where no attention mask is needed, which is FlashAttention (``is_flash_attention_requested``);
    ``decide_use_async_batching`` then turns async batching on only with graphs and no mask. Graphs exist
    where ``DEVICE_TYPE_TO_GRAPH_NAME`` (continuous_batching/utils.py) names the device type."""
    if runs_flash or (attention is not None and "flash" in attention):
        return None
    try:
        from transformers.generation.continuous_batching.utils import DEVICE_TYPE_TO_GRAPH_NAME
    except ImportError:  # another transformers: the rule is not there to read
        return None
    graph = DEVICE_TYPE_TO_GRAPH_NAME.get(target.name)
    if graph is None:
        return None
    shown = attention or "transformers' own pick (sdpa or eager)"
    return (
        f"accelerator graphs and async batching off: generate_batch runs {shown}, not FlashAttention, and "
        f"transformers turns {graph}s on only where no attention mask is needed (FlashAttention: "
        "decide_use_cuda_graphs) and async batching only with them (decide_use_async_batching), so each step "
        "launches its kernels one by one and the CPU's scheduling is not overlapped with the device's work; "
        "a FlashAttention package that fits this device turns both on, or ContinuousBatchingConfig("
        "use_cuda_graph=True, use_async_batching=True) asks for them with sdpa's padded mask"
    )


def _auto_switch(
    target: Target, attention: str | None, dtype: str | None, use_kernels: bool
) -> tuple[bool | None, str]:
    """auto_switch_to_flash=False where generate_batch's switch would leave the attention announced
    for a FlashAttention that does not fit here or is fetched from the Hub unasked; None: left as is."""
    shown = attention or "transformers' own pick (sdpa or eager)"
    if attention is not None and "flash" in attention:
        return None, f"auto_switch_to_flash left to transformers: the model runs {attention} already"
    if dtype not in ("float16", "bfloat16"):
        return None, (
            f"auto_switch_to_flash left to transformers: it switches only fp16/bf16 models, and the dtype is {dtype}"
        )
    fitting = [
        impl
        for impl in ("flash_attention_3", "flash_attention_2")
        if flash_attention_package(impl) is not None and flash_fits(impl, target, dtype)[0]
    ]
    if fitting:
        return None, (
            f"auto_switch_to_flash left to transformers: {FLASH[fitting[0]][1]} is installed and fits, "
            f"so its switch from {shown} to {fitting[0]} is one whichdevice would make too"
        )
    if use_kernels:
        return None, (
            "auto_switch_to_flash left to transformers: Hub kernels are on (use_kernels), so its switch to a "
            "Hub FlashAttention kernel is one you opted into"
        )
    return False, (
        f"auto_switch_to_flash=False: no FlashAttention package fits {target.name} in {dtype}, and generate_batch "
        f"would otherwise leave {shown} for FlashAttention fetched from the Hub (with the kernels package, "
        "is_flash_attn_3_available(kernels_fallback_ok=True) downloads kernels-community's build to answer), "
        "code use_kernels never asked for; the model keeps the attention announced here"
    )
