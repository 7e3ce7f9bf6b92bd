"""Which attention implementation to ask transformers for, read from installed metadata only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.errors import ConfigConflictError, DeviceError
from whichdevice.probes import package_version

if TYPE_CHECKING:
    from whichdevice.probing import ProbeResult
    from whichdevice.registry import Backend

__all__ = ["KNOWN_IMPLEMENTATIONS", "choose_attention", "flash_attention_package"]

KNOWN_IMPLEMENTATIONS = (
    "sdpa",
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


def flash_attention_package(impl: str) -> str | None:
    """The installed version of the package behind ``impl``, from metadata (flash-attn is never imported)."""
    version_major, package, _ = _FLASH[impl]
    found = package_version(package)
    if found is None and version_major == 3:
        found = package_version("flash_attn_3")
    return found


def _flash_fits(
    impl: str, backend: Backend, result: ProbeResult, dtype: str | None
) -> tuple[bool, str]:
    version_major, package, min_cc = _FLASH[impl]
    if version_major not in backend.flash_attention:
        able = [b for b in ("cuda", "npu", "xpu", "mlu", "musa") if b != backend.name]
        where = "CUDA GPUs only" if version_major > 2 else f"{', '.join(able)}"
        return False, f"{impl} does not run on {backend.name} ({where}); use 'sdpa'"
    if backend.name == "cuda" and result.variant != "rocm":
        cc = result.min_capability
        if cc is not None and cc < min_cc:
            return False, (
                f"{impl} needs compute capability {min_cc[0]}.{min_cc[1]} or newer; this GPU has "
                f"{cc[0]}.{cc[1]}; use " + ("'flash_attention_2' or 'sdpa'" if cc >= (8, 0) else "'sdpa'")
            )
        if version_major == 3 and cc is not None and cc[0] != 9:
            return False, f"{impl} is built for Hopper (compute capability 9.x); use 'flash_attention_2' or 'sdpa'"
    elif version_major > 2:
        return False, f"{impl} runs on NVIDIA CUDA GPUs only; use 'flash_attention_2' or 'sdpa'"
    if dtype == "float32":
        return False, f"{impl} needs fp16 or bf16, and the dtype is fp32; use 'sdpa'"
    return True, f"{impl} fits {backend.name}"


def choose_attention(
    backend: Backend, result: ProbeResult, dtype: str | None, requested: str = "auto"
) -> tuple[str, str]:
    """The attention implementation and the reason: FlashAttention when installed and usable, else sdpa."""
    if requested != "auto":
        if not isinstance(requested, str) or requested not in KNOWN_IMPLEMENTATIONS:
            raise DeviceError(
                f"attn_implementation={requested!r} is not known; use 'auto' or one of "
                f"{', '.join(KNOWN_IMPLEMENTATIONS)}"
            )
        if requested in _FLASH:
            ok, why = _flash_fits(requested, backend, result, dtype)
            if not ok:
                raise ConfigConflictError(f"attn_implementation={requested!r}: {why}")
            if flash_attention_package(requested) is None:
                package = _FLASH[requested][1]
                return requested, (
                    f"{requested} as you asked; its package is not installed, so transformers will "
                    f"look for a Hub kernel or fail: pip install {package}"
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
    if installed:
        return "sdpa", f"sdpa: {', '.join(installed)} installed but unusable here"
    return "sdpa", "sdpa (torch's fused attention): no FlashAttention package is installed"
