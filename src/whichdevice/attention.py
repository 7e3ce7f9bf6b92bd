"""Which attention implementation to ask transformers for, read from installed metadata only."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from whichdevice.errors import ConfigConflictError, DeviceError
from whichdevice.probes import package_version

if TYPE_CHECKING:
    from whichdevice.probing import ProbeResult
    from whichdevice.registry import Backend

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

# attn_implementation -> (FlashAttention version, pip package, minimum NVIDIA compute capability)
_FLASH = {
    "flash_attention_2": (2, "flash-attn", (8, 0)),
    "flash_attention_3": (3, "flash-attn-3", (9, 0)),
    "flash_attention_4": (4, "flash-attn-4", (9, 0)),
}


def is_hub_kernel(value: str) -> bool:
    """Whether ``value`` names a Hub kernel ("org/repo", "org/repo@rev", "org/repo:name"), as
    transformers' ``is_kernel`` accepts for attn_implementation."""
    return re.fullmatch(r"[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?", value) is not None


def flash_attention_package(impl: str) -> str | None:
    """The installed version of the package behind ``impl``, from metadata (flash-attn is never imported)."""
    version_major, package, _ = _FLASH[impl]
    found = package_version(package)
    if found is None and version_major == 3:
        found = package_version("flash_attn_3")
    return found


def _flash_fits(impl: str, backend: Backend, result: ProbeResult, dtype: str | None) -> tuple[bool, str]:
    version_major, _, min_cc = _FLASH[impl]
    if version_major not in backend.flash_attention:
        able = [b for b in ("cuda", "npu", "xpu", "mlu", "musa") if b != backend.name]
        where = "CUDA GPUs only" if version_major > 2 else f"{', '.join(able)}"
        instead = "'flash_attention_2' or 'sdpa'" if 2 in backend.flash_attention else "'sdpa'"
        return False, f"{impl} does not run on {backend.name} ({where}); use {instead}"
    if backend.name == "cuda" and result.variant != "rocm":
        cc = result.min_capability
        if cc is not None and cc < min_cc:
            return False, (
                f"{impl} needs compute capability {min_cc[0]}.{min_cc[1]} or newer; this GPU has "
                f"{cc[0]}.{cc[1]}; use " + ("'flash_attention_2' or 'sdpa'" if cc >= (8, 0) else "'sdpa'")
            )
        if version_major == 3 and cc is not None and cc[0] != 9:
            newer = "'flash_attention_4', " if cc[0] >= 10 else ""
            return False, (
                f"{impl} is built for Hopper (compute capability 9.x); use {newer}'flash_attention_2' or 'sdpa'"
            )
    elif version_major > 2:
        return False, f"{impl} runs on NVIDIA CUDA GPUs only; use 'flash_attention_2' or 'sdpa'"
    if dtype == "float32":
        return False, f"{impl} needs fp16 or bf16, and the dtype is fp32; use 'sdpa'"
    return True, f"{impl} fits {backend.name}"


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
        if isinstance(requested, str) and is_hub_kernel(requested):
            from whichdevice.kernels_support import hub_access, kernels_compatibility

            problems = [
                why
                for ok, why in (kernels_compatibility(), hub_access(requested.split("@")[0].split(":")[0]))
                if not ok
            ]
            return requested, f"{requested}: a Hub kernel, as you asked" + (
                f"; transformers will not load it: {'; '.join(problems)}" if problems else ""
            )
        if not isinstance(requested, str) or requested not in KNOWN_IMPLEMENTATIONS:
            raise DeviceError(
                f"attn_implementation={requested!r} is not known; use 'auto', '{AUTO_HUB}' (also a Hub "
                f"FlashAttention kernel), a Hub kernel ('org/repo') or one of {', '.join(KNOWN_IMPLEMENTATIONS)}"
            )
        if requested in _FLASH:
            ok, why = _flash_fits(requested, backend, result, dtype)
            if not ok:
                raise ConfigConflictError(f"attn_implementation={requested!r}: {why}")
            if requested == "flash_attention_2" and backend.name == "npu":
                return requested, f"{requested} as you asked: served by torch_npu's own FlashAttention"
            if flash_attention_package(requested) is None:
                from whichdevice.kernels_support import hub_flash_attention

                package = _FLASH[requested][1]
                repo, why = hub_flash_attention(backend, result, dtype, requested)
                if repo is not None:
                    return requested, (
                        f"{requested} as you asked; {package} is not installed, so transformers loads "
                        f"the Hub kernel {why}"
                    )
                return requested, (
                    f"{requested} as you asked, but {package} is not installed and transformers cannot "
                    f"use a Hub kernel instead ({why}), so loading the model will fail: pip install {package}"
                )
        return requested, "as you asked"
    for impl in ("flash_attention_3", "flash_attention_2"):
        version = flash_attention_package(impl)
        if version is None:
            continue
        ok, why = _flash_fits(impl, backend, result, dtype)
        if ok:
            return impl, f"{_FLASH[impl][1]} {version} is installed and fits this {backend.name} and dtype"
    installed = [impl for impl in _FLASH if flash_attention_package(impl)]
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


def _without_flash(backend: Backend, dtype: str | None, task: str, model: Any, no_flash: str) -> tuple[str, str]:
    """sdpa, or on the CPU in bf16/fp16 for inference the decode attention (see decode_attention)."""
    from whichdevice.decode_attention import ATTENTION_NAME, VERIFIED_MODEL_TYPES, model_type_of

    sdpa = f"sdpa (torch's fused attention): {no_flash}"
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
