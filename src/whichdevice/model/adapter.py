"""A PEFT adapter folder (adapter_config.json and adapter weights): the base model it names, and its bytes.

The base comes from ``base_model_name_or_path`` in adapter_config.json (what peft's
``PeftConfig.from_pretrained`` and transformers' adapter loading read), found as a local folder or in
the local Hugging Face cache; whichdevice never downloads it. The adapter's weights are counted from
their safetensors header, or from the file's length for ``adapter_model.bin`` (never unpickled).
"""

from __future__ import annotations

import math
from pathlib import Path

from whichdevice.core.errors import DeviceError

__all__ = ["ADAPTER_CONFIG", "adapter_base", "adapter_bytes"]

ADAPTER_CONFIG = "adapter_config.json"  # peft/utils/constants.py CONFIG_NAME


def adapter_base(folder: Path) -> tuple[Path, str] | None:
    """(the base model's path, the name adapter_config.json gives it) for an adapter-only folder; None otherwise."""
    if not folder.is_dir() or not (folder / ADAPTER_CONFIG).exists() or (folder / "config.json").exists():
        return None
    from whichdevice.model.files import read_json, resolve_model_path

    config = read_json(folder / ADAPTER_CONFIG)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    where = folder / ADAPTER_CONFIG
    if not isinstance(base, str) or not base.strip() or len(base) > 1000:
        raise DeviceError(
            f"{where} names no base model (base_model_name_or_path); pass model=<the base model's folder>"
        )
    if Path(base).expanduser().resolve() == folder.resolve():
        raise DeviceError(f"{where} names its own folder as its base model; pass model=<the base model's folder>")
    try:
        return resolve_model_path(base), base
    except DeviceError:
        raise DeviceError(
            f"{where} is a PEFT adapter for {base!r}, which is not here (neither a local folder nor in the "
            f"local Hugging Face cache; whichdevice never downloads): hf download {_quote(base)}, or pass "
            "model=<the base model's folder>"
        ) from None


def adapter_bytes(folder: Path) -> int:
    """The adapter's weights in bytes: safetensors headers, else the .bin file's length."""
    from whichdevice.model.files import SAFETENSORS_DTYPES, read_header

    total = 0
    for file in sorted(folder.glob("adapter_model*.safetensors")):
        for info in read_header(file).values():
            total += math.prod(info["shape"]) * SAFETENSORS_DTYPES.get(info["dtype"], 32) // 8
    if total == 0:
        total = sum(f.stat().st_size for f in folder.glob("adapter_model*.bin"))
    return total


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text.encode("unicode_escape").decode("ascii"))
