"""Which attention implementation to ask transformers for, read from installed metadata only."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from whichdevice.errors import ConfigConflictError, DeviceError
from whichdevice.flash import FLASH, flash_attention_package, flash_fits

if TYPE_CHECKING:
    from whichdevice.records import Backend, ProbeResult

__all__ = ["AUTO_HUB", "KNOWN_IMPLEMENTATIONS", "choose_attention", "flash_attention_package", "is_hub_kernel"]

# Opt-in: like "auto", but when no FlashAttention package is usable, the Hub kernel transformers
# swaps in for it (kernels-community/flash-attn2, ...) where one exists and can be had.
AUTO_HUB = "auto-hub"

KNOWN_IMPLEMENTATIONS = (
    "sdpa",
    "whichdevice_sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


def is_hub_kernel(value: str) -> bool:
    """Whether ``value`` names a Hub kernel ("org/repo", "org/repo@rev", "org/repo:name"), as
    transformers' ``is_kernel`` accepts for attn_implementation."""
    return re.fullmatch(r"[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?", value) is not None


def choose_attention(
    backend: Backend,
    result: ProbeResult,
    dtype: str | None,
    requested: str = "auto",
    *,
    task: str = "inference",
    model: Any = None,
) -> tuple[str, str]:
    """The attention implementation and the reason: FlashAttention when installed and usable, else
    sdpa, or on the CPU whichdevice's decode attention where it is faster and verified."""
    if requested not in ("auto", AUTO_HUB):
        return _as_requested(backend, result, dtype, requested)
    for impl in ("flash_attention_3", "flash_attention_2"):
        version = flash_attention_package(impl)
        if version is None:
            continue
        ok, why = flash_fits(impl, backend, result, dtype)
        if ok:
            return impl, f"{FLASH[impl][1]} {version} is installed and fits this {backend.name} and dtype"
    installed = [impl for impl in FLASH if flash_attention_package(impl)]
    if requested == AUTO_HUB:
        from whichdevice.kernels_support import hub_flash_attention

        repo, why = hub_flash_attention(backend, result, dtype)
        have = f"{', '.join(installed)} installed but unusable here" if installed else "no FlashAttention package"
        if repo is not None:
            return repo, (
                f"{repo}: {have}, so the Hub kernel transformers uses in its place "
                f"(attn_implementation='{AUTO_HUB}' opts in): {why}"
            )
        return _without_flash(
            backend, dtype, task, model, f"{have}, and attn_implementation='{AUTO_HUB}' found no Hub kernel: {why}"
        )
    if installed:
        return _without_flash(backend, dtype, task, model, f"{', '.join(installed)} installed but unusable here")
    return _without_flash(backend, dtype, task, model, "no FlashAttention package is installed")


def _as_requested(backend: Backend, result: ProbeResult, dtype: str | None, requested: Any) -> tuple[str, str]:
    """An explicit attn_implementation: kept as asked, checked, and said what it will do."""
    if isinstance(requested, str) and is_hub_kernel(requested):
        from whichdevice.kernels_support import hub_access, kernels_compatibility

        kernel = requested.split("@")[0].split(":")[0]
        problems = [why for ok, why in (kernels_compatibility(), hub_access(kernel)) if not ok]
        return requested, f"{requested}: a Hub kernel, as you asked" + (
            f"; transformers will not load it: {'; '.join(problems)}" if problems else ""
        )
    if not isinstance(requested, str) or requested not in KNOWN_IMPLEMENTATIONS:
        raise DeviceError(
            f"attn_implementation={requested!r} is not known; use 'auto', '{AUTO_HUB}' (also a Hub "
            f"FlashAttention kernel), a Hub kernel ('org/repo') or one of {', '.join(KNOWN_IMPLEMENTATIONS)}"
        )
    if requested not in FLASH:
        return requested, "as you asked"
    ok, why = flash_fits(requested, backend, result, dtype)
    if not ok:
        raise ConfigConflictError(f"attn_implementation={requested!r}: {why}")
    if FLASH[requested][0] in backend.flash_attention_native:
        return requested, f"{requested} as you asked: served by {backend.module}'s own FlashAttention"
    if flash_attention_package(requested) is not None:
        return requested, "as you asked"
    from whichdevice.kernels_support import hub_flash_attention

    package = FLASH[requested][1]
    repo, why = hub_flash_attention(backend, result, dtype, requested)
    if repo is not None:
        return requested, (
            f"{requested} as you asked; {package} is not installed, so transformers loads the Hub kernel {why}"
        )
    return requested, (
        f"{requested} as you asked, but {package} is not installed and transformers cannot "
        f"use a Hub kernel instead ({why}), so loading the model will fail: pip install {package}"
    )


def _without_flash(backend: Backend, dtype: str | None, task: str, model: Any, no_flash: str) -> tuple[str, str]:
    """sdpa, or on the CPU in bf16/fp16 for inference the decode attention (see decode_attention)."""
    from whichdevice.decode_attention import ATTENTION_NAME, VERIFIED_MODEL_TYPES, model_type_of

    sdpa = f"sdpa (torch's fused attention): {no_flash}"
    # The decode attention is a fix for torch's fused CPU kernel: a fact about the CPU, not a capability.
    if backend.name != "cpu" or task != "inference" or dtype not in ("bfloat16", "float16"):
        return "sdpa", sdpa
    # Read only here: everywhere else the architecture does not change the answer.
    model_type = model_type_of(model)
    faster = f"torch's fused CPU kernel takes 2-8x as long as a matmul for a one-token {dtype} query"
    if model is None:
        return "sdpa", f"{sdpa}; pass model= to get {ATTENTION_NAME} ({faster}) for a verified architecture"
    if model_type is None:
        return "sdpa", f"{sdpa}; {ATTENTION_NAME} needs the model's architecture, and model= has no readable model_type"
    if model_type not in VERIFIED_MODEL_TYPES:
        return "sdpa", f"{sdpa}; {ATTENTION_NAME} is not verified for model_type {model_type!r}"
    return ATTENTION_NAME, (
        f"{ATTENTION_NAME}: sdpa for prompts and a plain matmul for one-token decode steps, since "
        f"{faster}; verified for model_type {model_type!r}; {no_flash}"
    )
