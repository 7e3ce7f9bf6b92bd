"""Third-party noise: what an installed package does on import that nobody asked for, with the way out.

bitsandbytes' CPU backend, imported on a CPU with AVX512-BF16 (``transformers.Trainer`` imports it),
asks the Hub for a kernel through the ``kernels`` package: code downloaded and run at import time.
Offline, or without ``kernels``, it logs "Failed to load CPU gemm_4bit_forward ..." instead, which
reads like a failure and is not one. The behaviour is read from the installed bitsandbytes' own
source (never imported here), so the finding goes away with a bitsandbytes that stops doing it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import metadata, util
from pathlib import Path

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import ProbeResult

__all__ = ["HubKernelAtImport", "bitsandbytes_hub_kernel", "third_party_warnings"]

# bitsandbytes' native check (lib.has_avx512bf16_cpu) asks the CPU for this flag itself.
AVX512_BF16 = "avx512_bf16"

# What the CPU backend runs on import: `if has_avx512bf16(): ... get_kernel("org/repo", ...)`.
_FETCH = re.compile(
    r"""^\s*if\s+has_avx512bf16\(\)\s*:.{0,400}?\bget_kernel\(\s*["']([\w.-]+/[\w.-]+)["']""", re.S | re.M
)
# The line it logs when that fails: the format string's text before its first placeholder.
_LOGGED = re.compile(r"""["'](Failed to load CPU [^"'%{}]{1,120}?)(?::\s*)?%s""")

# The source is read only this far: a file this large is not the module the finding describes.
_SOURCE_LIMIT = 1 << 20


@frozen_record
class HubKernelAtImport:
    """The Hub repository bitsandbytes' CPU backend fetches on import, and the line it logs on failure."""

    repo: str
    logged: str


@lru_cache(maxsize=1)
def bitsandbytes_hub_kernel() -> HubKernelAtImport | None:
    """What the installed bitsandbytes fetches from the Hub on import on an AVX512-BF16 CPU, or None.

    Read from ``bitsandbytes/backends/cpu/ops.py`` as text: bitsandbytes imports torch and loads its
    native library, and the report imports neither to find out.
    """
    try:
        spec = util.find_spec("bitsandbytes")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        ops = Path(folder, "backends", "cpu", "ops.py")
        try:
            with ops.open(encoding="utf-8", errors="replace") as fh:
                source = fh.read(_SOURCE_LIMIT)
        except OSError:
            continue
        fetch = _FETCH.search(source)
        if fetch is None:
            return None
        logged = _LOGGED.search(source, fetch.end())
        return HubKernelAtImport(fetch.group(1), logged.group(1).strip() if logged else "Failed to load CPU ...")
    return None


def third_party_warnings(
    env: Mapping[str, str], results: Sequence[ProbeResult], versions: Mapping[str, str | None]
) -> list[dict[str, str]]:
    """The report's findings about third-party packages' import-time behaviour on this machine."""
    message = _bitsandbytes_message(env, results, versions)
    return [{"source": "bitsandbytes", "message": message}] if message else []


def _bitsandbytes_message(
    env: Mapping[str, str], results: Sequence[ProbeResult], versions: Mapping[str, str | None]
) -> str | None:
    bnb = versions.get("bitsandbytes")
    cpu = next((r for r in results if r.backend == "cpu"), None)
    if bnb is None or cpu is None or AVX512_BF16 not in cpu.features or _installed("bitsandbytes") != bnb:
        # Not installed, another CPU, or a replayed machine's bitsandbytes whose source is not here.
        return None
    found = bitsandbytes_hub_kernel()
    if found is None:
        return None
    where = f"bitsandbytes {bnb}, imported on this CPU ({AVX512_BF16}; transformers' Trainer imports it)"
    harmless = f'"{found.logged}: ..." on stderr, which is harmless: bitsandbytes then uses its own CPU code'
    kernels = versions.get("kernels")
    if kernels is None:
        return (
            f"{where}, asks the Hub for the kernel {found.repo}; without the kernels package it logs {harmless}. "
            "Installing kernels would make every such import download and run that kernel"
        )
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline:
        return (
            f"{where}, loads the Hub kernel {found.repo} through kernels {kernels} when the Hub cache holds "
            f"it (HF_HUB_OFFLINE is set, so nothing is downloaded); otherwise it logs {harmless}. "
            f"If you do not use Hub kernels: {shlex.join(['pip', 'uninstall', 'kernels'])}"
        )
    return (
        f"{where}, downloads and runs the Hub kernel {found.repo} through kernels {kernels}: code from the Hub "
        f"that nobody asked for; offline it logs {harmless}. To avoid it: "
        f"{shlex.join(['pip', 'uninstall', 'kernels'])} if you do not use Hub kernels (bitsandbytes then logs "
        "that line naming the missing package), or export HF_HUB_OFFLINE=1 (no download; a copy already in "
        "the Hub cache is still loaded)"
    )


def _installed(name: str) -> str | None:
    # The version on this disk, not a simulated or replayed one: only its source was read.
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
