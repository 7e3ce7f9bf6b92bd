"""Where ``model=`` is: a local folder or file, the local Hugging Face cache's copy of a model id, or
a Hub id whose metadata whichdevice.model.hub fetches (NotHereError says which).

A PEFT adapter folder is followed to the base model it names. Nothing here downloads.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from whichdevice.core.errors import DeviceError
from whichdevice.model.adapter import adapter_base_name, checked_base
from whichdevice.model.files import _damaged, check_link

__all__ = ["NotHereError", "resolve_model_path"]


class NotHereError(DeviceError):
    """``model=`` is neither a local folder nor in the local Hugging Face cache; ``hub_id`` is set when
    it reads as a Hub model id, whose metadata whichdevice.model.hub can fetch."""

    def __init__(self, message: str, hub_id: str | None) -> None:
        super().__init__(message)
        self.hub_id = hub_id


def resolve_model_path(model: str | os.PathLike[str], revision: str | None = None, *, adapter: bool = True) -> Path:
    """A local folder or file, or the local Hugging Face cache's copy of a model id at ``revision``
    (never downloads: NotHereError for a model id that is not cached); a PEFT adapter folder resolves
    to its base model's unless ``adapter`` is False."""
    text = str(model)
    if not text.strip():
        raise DeviceError(f"model={model!r} is empty; pass a local folder, a cached model id or a config")
    try:
        return _local_or_cached(model, text, revision, adapter=adapter)
    except DeviceError:
        raise
    except (OSError, ValueError) as exc:  # ENAMETOOLONG, EACCES on a parent folder, a NUL in the name
        shown = text if len(text) <= 200 else f"{text[:100]}...{text[-60:]} ({len(text)} characters)"
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DeviceError(
            f"model={shown!r} cannot be used as a path ({reason}); pass a local folder, a cached model id or a config"
        ) from None


def _local_or_cached(model: str | os.PathLike[str], text: str, revision: str | None, *, adapter: bool) -> Path:
    path = Path(model).expanduser()
    check_link(path, file=path.suffix == ".safetensors")
    if path.exists():
        # A PEFT adapter folder is sized, placed and loaded as the base model it names (one adapter:
        # a chain, a cycle or a base that is not a model is the adapter config's fault, checked_base).
        base = adapter_base_name(path) if adapter else None
        if base is None:
            return path
        return checked_base(path, base, lambda name: resolve_model_path(name, adapter=False))
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and not text.startswith((".", "/"))
    if hub_id:
        try:
            from huggingface_hub import snapshot_download

            found = Path(snapshot_download(text, revision=revision, local_files_only=True))
        except Exception:
            found = None
        if found is not None:
            return _inside_snapshots(found)
    # A Hub id gets the command that fetches it (quoted for the shell: the id is the caller's text).
    fetch = f", fetch it first (hf download {shlex.quote(text)})" if hub_id else ""
    raise NotHereError(
        f"model={text!r} is neither a local folder nor a model in the local Hugging Face cache; "
        f"pass a local path{fetch} or a config (transformers.AutoConfig)",
        text if hub_id else None,
    )


def _inside_snapshots(found: Path) -> Path:
    """``found`` (the Hub cache's snapshot folder) when it is one: a ref such as refs/main holding
    "../../../outside" would point the model at any folder on the machine."""
    snapshots = found.parent
    if found.name in ("", ".", "..") or snapshots.name != "snapshots" or ".." in found.parts:
        raise _damaged(found, "is where the Hub cache's ref points, which is outside its snapshots folder (corrupt)")
    return found
