"""Hub kernels (``use_kernels=True``): on only where the kernels package, the backend and the Hub allow."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whichdevice.core import envview
from whichdevice.core.errors import ConfigConflictError
from whichdevice.core.packages import package_version, pip_install, version_at_least, version_before

if TYPE_CHECKING:
    from whichdevice.core.records import TraceStep
    from whichdevice.device.target import Target

__all__ = [
    "ENV_VARIABLES",
    "HUB_FLASH_ATTENTION",
    "HUB_FLASH_KERNEL_DEVICES",
    "decide_kernels",
    "hub_access",
    "hub_flash_attention",
    "kernels_compatibility",
    "kernels_key",
    "transformers_kernels_range",
]


@lru_cache(maxsize=1)
def transformers_kernels_range() -> tuple[str | None, str | None]:
    """(minimum, exclusive maximum) kernels version the installed transformers accepts.

    Read as text, so transformers is not imported: ``KERNELS_MIN_VERSION``/``KERNELS_MAX_VERSION``
    in utils/import_utils.py (what ``is_kernels_available()`` checks), else the dependency table.
    """
    spec = find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        text = (root / "utils" / "import_utils.py").read_text(encoding="utf-8")
    except OSError:
        text = ""
    low_match = re.search(r'^KERNELS_MIN_VERSION\s*=\s*"([^"]+)"', text, re.MULTILINE)
    high_match = re.search(r'^KERNELS_MAX_VERSION\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if low_match or high_match:
        return (low_match.group(1) if low_match else None, high_match.group(1) if high_match else None)
    try:
        table = (root / "dependency_versions_table.py").read_text(encoding="utf-8")
    except OSError:
        return None, None
    match = re.search(r'"kernels":\s*"kernels([^"]*)"', table)
    if not match:
        return None, None
    low = re.search(r">=\s*([\w.]+)", match.group(1))
    high = re.search(r"<\s*([\w.]+)", match.group(1))
    return (low.group(1) if low else None, high.group(1) if high else None)


def kernels_compatibility() -> tuple[bool, str]:
    """Whether the installed ``kernels`` is one the installed transformers will use, and why."""
    installed = package_version("kernels")
    low, high = transformers_kernels_range()
    wanted = ",".join(p for p in (f">={low}" if low else "", f"<{high}" if high else "") if p)
    tf = package_version("transformers") or "?"
    if installed is None:
        return False, (
            f"the kernels package is not installed (transformers {tf} wants kernels{wanted}): "
            f"{pip_install(f'kernels{wanted}')}"
        )
    if (low and version_before(installed, low)) or (high and version_at_least(installed, high)):
        return False, (
            f"kernels {installed} is installed but transformers {tf} wants kernels{wanted}, so it "
            f"ignores Hub kernels: {pip_install(f'kernels{wanted}')}"
        )
    return True, f"kernels {installed} is within transformers {tf}'s range (kernels{wanted})"


# The cuda row covers two vendors: on the ROCm build of torch (probe variant "rocm") kernels has a
# target of its own while the device string stays "cuda".
_VARIANT_KEYS = {"rocm": "rocm"}


def kernels_key(target: Target) -> str | None:
    """The kernels device key: the row's own, except ROCm which is its own target ("rocm")."""
    if target.name == "cuda" and target.variant in _VARIANT_KEYS:
        return _VARIANT_KEYS[target.variant]
    return target.backend.kernels_key


def kernels_keys() -> tuple[str, ...]:
    """Every kernels device key a registered backend has, the variants' included."""
    from whichdevice.hardware.registry import backends

    keys = [b.kernels_key for b in backends() if b.kernels_key]
    return tuple(dict.fromkeys([*keys, *_VARIANT_KEYS.values()]))


# The variables this module reads: whether the Hub may be used, where kernels and the Hub cache
# live, local kernel builds (the memo key holds them; see whichdevice.resolve.memo).
ENV_VARIABLES = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "LOCAL_KERNELS",
    "KERNELS_CACHE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
)

_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's ENV_VARS_TRUE_VALUES


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) read the way huggingface_hub reads it."""
    value = envview.environ().get("HF_HUB_OFFLINE") or envview.environ().get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def kernels_cache_dir() -> Path:
    """Where kernels keeps downloaded kernels: KERNELS_CACHE, else the Hugging Face Hub cache."""
    env = envview.environ()
    explicit = env.get("KERNELS_CACHE") or env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def local_kernels() -> dict[str, str]:
    """LOCAL_KERNELS ("org/repo=path:org/repo2=path2", kernels' own format) as repo -> path.

    An entry without "=" is refused as kernels refuses it (ValueError when it loads a kernel)."""
    raw = envview.environ().get("LOCAL_KERNELS")
    out: dict[str, str] = {}
    for entry in (raw or "").split(":") if raw is not None else ():
        repo, eq, path = entry.partition("=")
        if not eq or not repo.strip() or not path.strip():
            raise ConfigConflictError(
                f"LOCAL_KERNELS={raw!r}: entry {entry!r} is not repo=path; the form is "
                "'org/repo=/path/to/build' (several joined by ':'), which kernels requires too; fix or unset it"
            )
        out[repo.strip()] = path
    return out


def hub_access(repo: str | None = None) -> tuple[bool, str]:
    """Whether a Hub kernel (``repo``, or any kernels-community kernel) can be had, and why.

    Read from the environment and the cache only. whichdevice never opens a connection to find out
    whether the Hub is reachable: a resolution must be fast, work the same on air-gapped machines
    and in tests, and never block on a network timeout. So "HF_HUB_OFFLINE unset" counts as "can
    download on first use"; if the Hub then turns out to be unreachable, transformers reports it
    when it fetches the kernel (and falls back for FlashAttention). Set HF_HUB_OFFLINE=1 to make
    whichdevice check the cache instead.
    """
    local = local_kernels()
    if local and (repo is None or repo in local):
        where = f" ({repo} -> {local[repo]})" if repo else ""
        return True, f"LOCAL_KERNELS points at local kernel builds{where}"
    if hub_offline():
        cache = kernels_cache_dir()
        if repo is not None:
            cached = (cache / ("models--" + repo.replace("/", "--"))).is_dir()
            what = repo
        else:
            cached = cache.is_dir() and any(cache.glob("models--kernels-community--*"))
            what = "a kernels-community kernel"
        if cached:
            return True, f"HF_HUB_OFFLINE=1 and {what} is in the cache ({cache})"
        return False, f"HF_HUB_OFFLINE=1 and {what} is not in the cache ({cache}); download it while online first"
    return True, "the Hub is not switched off (HF_HUB_OFFLINE unset), so kernels download on first use"


# transformers' FLASH_ATTN_KERNEL_FALLBACK and FLASH_ATTN_KERNEL_DEVICES (modeling_flash_attention_utils.py,
# 5.24): the Hub kernel that stands in for a missing FlashAttention package (per kernels device key;
# ROCm gets aiter), and the device keys each kernel ships builds for. Copied, not imported, so that
# a simulated ROCm machine gets the ROCm answer; tests check the copy against transformers.
HUB_FLASH_ATTENTION: dict[str, dict[str, str]] = {
    "flash_attention_2": {"rocm": "kernels-community/aiter-flash-attn", "*": "kernels-community/flash-attn2"},
    "flash_attention_3": {"rocm": "kernels-community/aiter-flash-attn", "*": "kernels-community/vllm-flash-attn3"},
    "flash_attention_4": {"*": "kernels-community/flash-attn4"},
}
HUB_FLASH_KERNEL_DEVICES: dict[str, tuple[str, ...]] = {
    "kernels-community/flash-attn2": ("cuda", "xpu"),
    "kernels-community/flash-attn3": ("cuda",),
    "kernels-community/vllm-flash-attn3": ("cuda",),
    "kernels-community/aiter-flash-attn": ("rocm",),
    "kernels-community/flash-attn4": ("cuda",),
    "kernels-community/metal-flash-sdpa": ("mps",),
}


def hub_flash_attention(target: Target, dtype: str | None, impl: str = "flash_attention_2") -> tuple[str | None, str]:
    """(the Hub kernel repo transformers loads for ``impl`` here when its package is missing, or
    None; why). Checks the kernel's builds, the hardware and dtype, the kernels version and access."""
    from whichdevice.attention.flash import FLASH, flash_fits

    key = kernels_key(target)
    choices = HUB_FLASH_ATTENTION[impl]
    repo = choices.get(key or "", choices["*"])
    problems = []
    if key is None or key not in HUB_FLASH_KERNEL_DEVICES.get(repo, (key,)):
        builds = ", ".join(f"{r} ({'/'.join(HUB_FLASH_KERNEL_DEVICES[r])})" for r in dict.fromkeys(choices.values()))
        problems.append(f"no {impl} Hub kernel is built for {key or target.name} (only {builds})")
        if FLASH[impl][0] in target.backend.flash_attention_native:
            problems.append(
                f"on {target.name}, attn_implementation={impl!r} runs {target.backend.module}'s own FlashAttention"
            )
    else:
        fits, fit_why = flash_fits(impl, target, dtype)
        if not fits:
            problems.append(fit_why.split("; use ")[0])
    compatible, compat_why = kernels_compatibility()
    if not compatible:
        problems.append(compat_why)
    access_ok, access_why = hub_access(repo)
    if not access_ok:
        problems.append(access_why)
    if problems:
        return None, "; ".join(problems)
    return repo, f"{repo} is built for {key}; {compat_why}; {access_why}"


def decide_kernels(target: Target, requested: Any) -> tuple[tuple[bool, str | None], list[TraceStep]]:
    """(use_kernels, kernels device key) and the trace line that says why: off unless asked ("auto":
    on where every check passes; True: on, or ConfigConflictError with the reasons)."""
    from whichdevice.core.records import TraceStep

    key = kernels_key(target)
    if requested is False:
        # Off unless asked, as in transformers: on, transformers downloads compiled code from the Hub and runs it.
        off = TraceStep(
            "kernels",
            f"Hub kernels off (use_kernels={requested!r}, the default, as in transformers); "
            "use_kernels='auto' turns them on where they can work (they download and run compiled code "
            "from the Hub)",
        )
        return (False, key), [off]
    if requested not in ("auto", True):
        raise ConfigConflictError(f"use_kernels={requested!r}: use 'auto', True or False (the default False: off)")
    checks = [kernels_compatibility()]
    if key is None:
        keys = ", ".join(kernels_keys())
        checks.append((False, f"Hub kernels have no device key for {target.name} (keys: {keys})"))
    else:
        checks.append((True, f"kernel device key {key!r}"))
    checks.append(hub_access())
    failed = [why for ok, why in checks if not ok]
    if failed:
        if requested is True:
            raise ConfigConflictError("use_kernels=True cannot work here: " + "; ".join(failed))
        return (False, key), [TraceStep("kernels", "Hub kernels off: " + "; ".join(failed))]
    return (True, key), [TraceStep("kernels", "Hub kernels on: " + "; ".join(why for _, why in checks))]
