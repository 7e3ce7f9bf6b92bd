"""Which FlashAttention versions exist, which package serves each, and whether one fits a device.

The backends that run FlashAttention are the registry rows whose ``flash_attention`` lists the
version; the NVIDIA compute-capability floors are this module's own facts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.packages import package_version
from whichdevice.hardware.registry import backends

if TYPE_CHECKING:
    from whichdevice.device.target import Target

__all__ = ["FLASH", "flash_attention_package", "flash_fits"]

# attn_implementation -> (FlashAttention version, pip package, minimum NVIDIA compute capability)
FLASH = {
    "flash_attention_2": (2, "flash-attn", (8, 0)),
    "flash_attention_3": (3, "flash-attn-3", (9, 0)),
    "flash_attention_4": (4, "flash-attn-4", (9, 0)),
}


def flash_attention_package(impl: str) -> str | None:
    """The installed version of the package behind ``impl``, from metadata (flash-attn is never imported)."""
    version_major, package, _ = FLASH[impl]
    found = package_version(package)
    if found is None and version_major == 3:
        found = package_version("flash_attn_3")
    return found


def flash_fits(impl: str, target: Target, dtype: str | None) -> tuple[bool, str]:
    version_major, _, min_cc = FLASH[impl]
    if version_major not in target.backend.flash_attention:
        able = [b.name for b in backends() if version_major in b.flash_attention and b.name != target.name]
        where = ", ".join(able) if version_major == 2 else f"{'/'.join(n.upper() for n in able)} GPUs only"
        instead = "'flash_attention_2' or 'sdpa'" if 2 in target.backend.flash_attention else "'sdpa'"
        return False, f"{impl} does not run on {target.name} ({where}); use {instead}"
    if target.name == "cuda" and target.variant != "rocm":
        # Compute-capability floors are NVIDIA's own facts (FLASH above); ROCm has none.
        cc = target.capability
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
    return True, f"{impl} fits {target.name}"
