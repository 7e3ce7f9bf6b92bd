"""A PEFT adapter folder (adapter_config.json and adapter weights): the base model it names.

The base comes from ``base_model_name_or_path`` in adapter_config.json (what peft's
``PeftConfig.from_pretrained`` and transformers' adapter loading read); ``locate.resolve_model_path``
finds it as a local folder or in the local Hugging Face cache (never downloaded), and sizing adds the
adapter's own weights (``size.adapter_bytes``: safetensors headers, or a .bin file's length, never
unpickled).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

from whichdevice.core.errors import DamagedModelError, DeviceError

__all__ = ["ADAPTER_CONFIG", "adapter_base_name", "checked_base", "missing_base"]

ADAPTER_CONFIG = "adapter_config.json"  # peft/utils/constants.py CONFIG_NAME
_MAX_CONFIG = 10_000_000  # an adapter config is a few KiB; beyond this it is not one


def adapter_base_name(folder: Path) -> str | None:
    """The base model an adapter-only folder names (None: not an adapter-only folder)."""
    where = folder / ADAPTER_CONFIG
    if not folder.is_dir() or not where.is_file() or (folder / "config.json").exists():
        return None
    if where.stat().st_size > _MAX_CONFIG:
        raise DamagedModelError(f"{where} is {where.stat().st_size} bytes, too large for an adapter config")
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DamagedModelError(f"{where} cannot be read as JSON ({type(exc).__name__}); re-save the adapter") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base.strip() or len(base) > 1000:
        raise DeviceError(
            f"{where} names no base model (base_model_name_or_path); pass model=<the base model's folder>"
        )
    if Path(base).expanduser().resolve() == folder.resolve():
        raise DeviceError(f"{where} names its own folder as its base model; pass model=<the base model's folder>")
    return base


def missing_base(folder: Path, base: str) -> DeviceError:
    """The error for an adapter whose base model is not on this machine."""
    quoted = shlex.quote(base.encode("unicode_escape").decode("ascii"))
    return DeviceError(
        f"{folder / ADAPTER_CONFIG} is a PEFT adapter for {base!r}, which is not here (neither a local folder "
        f"nor in the local Hugging Face cache; whichdevice never downloads): hf download {quoted}, or pass "
        "model=<the base model's folder>"
    )


def checked_base(adapter: Path, base: str, resolve: Callable[[str], Path]) -> Path:
    """The base model folder an adapter's ``base_model_name_or_path`` names, checked to be a model.

    transformers follows one adapter to its base and loads that as a model (AutoModel*.from_pretrained,
    models/auto/auto_factory.py, "base_model_name_or_path", 5.25): a base that is an adapter in turn
    (a chain, or a cycle back) cannot load, and a folder without config.json or weights is not a model,
    whatever the adapter claims. Both are the adapter config's fault, so the error names that file.
    ``resolve`` finds ``base`` as a local folder or in the Hub cache without following adapters
    (model/files.py's resolve_model_path).
    """
    claim = f"{adapter / ADAPTER_CONFIG} names {base!r} as its base model (base_model_name_or_path)"
    try:
        found = resolve(base)
    except DeviceError:
        raise missing_base(adapter, base) from None
    fix = (
        f"set base_model_name_or_path in {adapter / ADAPTER_CONFIG} to the base model's folder or Hub id, "
        "or pass model=<the base model's folder>"
    )
    if found.is_dir():
        onward = adapter_base_name(found)
        if onward is not None:
            back = Path(onward).expanduser().resolve() == adapter.resolve()
            raise DamagedModelError(
                f"{claim}, which is a PEFT adapter too: {found / ADAPTER_CONFIG} names {onward!r}"
                + (" back, a cycle" if back else "")
                + f". transformers loads an adapter's base as a model and follows no second adapter; {fix}"
            )
        if not any(e.name == "config.json" or e.name.endswith((".safetensors", ".bin")) for e in found.iterdir()):
            raise DamagedModelError(
                f"{claim}, which is {found}: a folder with no config.json and no weights, not a model; {fix}"
            )
    return found
