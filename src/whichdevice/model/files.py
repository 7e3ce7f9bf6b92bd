"""Reading a model's files (config.json, safetensors headers, the shard index), checked as they are read.

Every problem a download can leave behind (a truncated or corrupt file, a Hub-cache link whose blob
is gone, a link that loops, a config that is not a JSON object or holds values of the wrong type)
becomes a :class:`DamagedModelError` that names the file and the command that fetches it again.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

from whichdevice.core.dtypes import SAFETENSORS_BITS
from whichdevice.core.errors import DamagedModelError, DeviceError
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.untrusted import UntrustedFileError, read_untrusted
from whichdevice.model.header_rules import layout_problem, metadata_problem, size_problem

__all__ = [
    "DamagedModelError",
    "ModelFiles",
    "check_config",
    "check_header",
    "check_link",
    "header_length",
    "is_config_object",
    "read_config",
    "read_header",
    "read_json",
    "read_model_folder",
    "refetch_hint",
    "shard_names",
]

# safetensors refuses a header over 100 MB (MAX_HEADER_SIZE).
_MAX_HEADER = 100_000_000
# Whole-number config fields whichdevice's sizing and transformers' model builders divide and
# multiply by: each must be a whole number from 1 up (None where the architecture allows it).
COUNT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "d_model",
    "num_layers",
    "num_heads",
)
# 0 stands for "derive it" (head_dim = hidden_size // num_attention_heads) in some configs.
_ZERO_OK = {"head_dim"}
# One value per stage or layer is allowed here (Swin's num_heads, Gemma 3n's intermediate_size,
# LXMERT's num_hidden_layers per tower).
_PER_STAGE = {"num_heads", "num_attention_heads", "intermediate_size", "num_hidden_layers"}
# Some configs in transformers itself state it as a float (1200.0).
_FLOAT_OK = {"max_position_embeddings"}
_LARGEST_COUNT = 2**31  # no released architecture comes near; beyond it a value is a typo or damage
_DTYPE_NAMES = re.compile(r"(float|bfloat|int|uint|complex)\d*(_[a-z0-9]+)*|float|half|double|bool|auto")


def _cache_repo(path: Path) -> tuple[str, Path] | None:
    """(repo id, its models--... folder) when ``path`` lies in a Hugging Face Hub cache snapshot."""
    for parent in (path, *path.parents):
        if parent.name.startswith("models--") and (parent / "snapshots").is_dir():
            return parent.name.removeprefix("models--").replace("--", "/"), parent
    return None


def refetch_hint(path: Path) -> str:
    """What to run to replace the model folder ``path`` lies in."""
    cached = _cache_repo(path)
    if cached is not None:
        repo, folder = cached
        return (
            f"download it again with `hf download {repo} --force-download` (huggingface-cli download on "
            f"huggingface_hub < 1.0), or delete {folder} and download it again"
        )
    folder = path.parent if path.suffix in (".json", ".safetensors", ".bin") or not path.is_dir() else path
    return (
        f"replace the model in {folder}: download it again (`hf download <model id> --local-dir {folder} "
        "--force-download`) or save it again with save_pretrained(), or delete the folder"
    )


def _damaged(path: Path | str, problem: str) -> DamagedModelError:
    if isinstance(path, str):  # a config object, not a file
        return DamagedModelError(f"{path}: {problem}; build the config with valid values")
    return DamagedModelError(f"{path}: {problem}; {refetch_hint(path)}")


def check_link(path: Path, *, file: bool = True) -> None:
    """Raise for a link that dangles (a Hub-cache blob gone: an interrupted download) or loops, or
    (``file``) that points at something other than a file."""
    if not path.is_symlink():
        return
    try:
        target = path.resolve(strict=True)
    except RuntimeError:  # pathlib's "Symlink loop" on Python < 3.13
        raise _damaged(path, "is a symbolic link that loops back on itself") from None
    except OSError as exc:
        if getattr(exc, "errno", None) == 40:  # ELOOP
            raise _damaged(path, "is a symbolic link that loops back on itself") from None
        target_text = os.readlink(path)
        what = "a Hub-cache blob" if "blobs" in Path(target_text).parts else "a file"
        raise _damaged(
            path, f"is a link to {what} that is missing ({target_text}): the download was interrupted"
        ) from None
    if file and not target.is_file():
        raise _damaged(path, f"is a link to {target}, which is not a file")


def _check_file(path: Path) -> None:
    check_link(path)
    if path.is_dir():
        raise _damaged(path, "is a folder, not a file")


def _open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file. Opened without blocking and checked
    before anything is read: a named pipe (or a device) in place of a model file would otherwise
    hang the read forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _damaged(path, "is not a regular file (a named pipe, device or socket); whichdevice reads only files")
    return os.fdopen(fd, "rb")


def _open_problem(path: Path, exc: OSError) -> DamagedModelError:
    check_link(path)
    return _damaged(path, f"cannot be read ({exc.strerror or exc})")


def read_json(path: Path) -> Any:
    """The JSON in ``path`` (config.json, an index), or DamagedModelError saying what is wrong with it."""
    _check_file(path)
    try:
        # core.untrusted's reader, as every file a variable names (a Hub cache under XDG_CACHE_HOME): a
        # regular file only, opened without blocking, a config or an index of a few megabytes at most.
        return json.loads(read_untrusted(path, _MAX_HEADER).decode("utf-8"))
    except UntrustedFileError as exc:
        check_link(path)
        raise _damaged(path, exc.problem) from None
    except OSError as exc:
        raise _open_problem(path, exc) from None
    except UnicodeDecodeError:
        raise _damaged(path, "is not UTF-8 text (the file is damaged)") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _damaged(path, f"is not valid JSON ({exc})") from None


def check_config(config: Any, where: str | Path) -> dict[str, Any]:
    """``config`` (a config.json's content, or a transformers config's to_dict()) checked: an object
    with a ``model_type``, and whole-number fields (hidden_size, num_hidden_layers, ...) of 1 or more."""
    path = where
    if not isinstance(config, dict):
        raise _damaged(path, f"holds a JSON {type(config).__name__}, not an object (a config is {{...}})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise _damaged(
            path,
            f"has no model_type (found {model_type!r}); transformers cannot tell which architecture it is",
        )
    _check_values(config, path, "")
    return config


def _check_values(config: dict[str, Any], path: Path | str, prefix: str) -> None:
    for field in COUNT_FIELDS:
        value = config.get(field)
        # One number, or one per stage or layer (Swin's num_heads, Gemma 3n's intermediate_size).
        several = field in _PER_STAGE and isinstance(value, (dict, list))
        values = (list(value.values()) if isinstance(value, dict) else value) if several else [value]
        if value is not None and not (values and all(_count(v, field) for v in values)):
            raise _damaged(
                path,
                f"{prefix}{field}={value!r}: it must be a whole number from 1 to {_LARGEST_COUNT} (or a list of them)",
            )
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is not None and not (isinstance(value, str) and _DTYPE_NAMES.fullmatch(value.removeprefix("torch."))):
            raise _damaged(path, f"{prefix}{field}={value!r} is not a torch dtype name such as 'bfloat16'")
    for key, value in config.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-model's config (vision tower, text model)
            _check_values(value, path, f"{prefix}{key}.")


def _count(value: Any, field: str) -> bool:
    if field in _FLOAT_OK and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (0 if field in _ZERO_OK else 1) <= value <= _LARGEST_COUNT


def read_config(folder: Path) -> dict[str, Any] | None:
    """``folder``'s config.json, checked (see :func:`check_config`); None when there is none."""
    path = folder / "config.json"
    if not path.exists() and not path.is_symlink():
        return None
    return check_config(read_json(path), path)


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets), every entry checked
    against the format and the file's length, so a truncated or corrupt download is caught here."""
    _check_file(path)
    try:
        with _open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            length = header_length(prefix, size, path)
            raw = fh.read(length)
    except OSError as exc:
        raise _open_problem(path, exc) from None
    return check_header(raw, size - 8 - length, path)


def header_length(prefix: bytes, size: int, path: Path) -> int:
    """The header length a safetensors file of ``size`` bytes states in its first 8 bytes (``prefix``),
    checked against the format's limit and the file's length."""
    if len(prefix) < 8:
        raise _damaged(path, f"is {size} bytes, too short for a safetensors file (truncated download)")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > _MAX_HEADER or 8 + length > size:
        raise _damaged(path, f"says its safetensors header is {length} bytes, but the file is {size} bytes (corrupt)")
    return int(length)


def check_header(raw: bytes, data: int, path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of the safetensors header ``raw`` (the JSON after the 8-byte length) of a file with
    ``data`` bytes of tensor data after it, every entry checked: the one check of a header, whether
    it was read from a local file or fetched from the Hub by range request (whichdevice.model.hub)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _damaged(path, "has a safetensors header that is not valid JSON (corrupt)") from None
    if not isinstance(header, dict):
        raise _damaged(path, "has a safetensors header that is not a JSON object (corrupt)")
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    for name, info in tensors.items():
        _check_tensor(path, name, info, data)
    # What safetensors checks beyond each tensor (whichdevice.model.header_rules).
    problem = metadata_problem(header.get("__metadata__")) or layout_problem(tensors, data)
    if problem is not None:
        raise _damaged(path, problem)
    return tensors


def _check_tensor(path: Path, name: str, info: Any, data: int) -> None:
    if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_BITS:
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise _damaged(path, f"tensor {name!r} has dtype {dtype!r}, which safetensors does not know (corrupt)")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _damaged(path, f"tensor {name!r} has shape {shape!r}; a shape is a list of whole numbers >= 0 (corrupt)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _damaged(path, f"tensor {name!r} has data_offsets {offsets!r} (corrupt)")
    huge = size_problem(name, shape, SAFETENSORS_BITS[info["dtype"]], info["dtype"])
    if huge is not None:
        raise _damaged(path, huge)
    if offsets[1] > data:
        raise _damaged(
            path,
            f"tensor {name!r} ends at byte {offsets[1]} of the data, but the file holds {data} bytes of data "
            "(truncated download)",
        )
    if (offsets[1] - offsets[0]) * 8 != math.prod(shape) * SAFETENSORS_BITS[info["dtype"]]:
        raise _damaged(path, f"tensor {name!r}: shape {shape} does not match its {offsets[1] - offsets[0]} bytes")


def is_config_object(model: Any) -> bool:
    """Whether ``model=`` is a transformers config (``LlamaConfig(...)``, ``AutoConfig.from_pretrained``)
    rather than a path: the one place this is decided."""
    return hasattr(model, "model_type") and hasattr(model, "to_dict")


class ModelFiles(NamedTuple):
    """What a model folder (or one safetensors file) holds, read and checked once."""

    folder: Path
    config: dict[str, Any] | None  # config.json, checked; None when there is none
    headers: tuple[tuple[Path, dict[str, dict[str, Any]]], ...]  # each safetensors file's tensors


def read_model_folder(path: Path, *, weights: bool = True) -> ModelFiles:
    """Read every file whichdevice and from_pretrained read first in ``path`` (a folder or one
    safetensors file): config.json, the shard index and the shards it names, safetensors headers;
    each once, each checked. ``weights=False`` reads config.json only."""
    if path.is_file() and path.suffix != ".safetensors":
        raise DeviceError(f"model={str(path)!r} is a file; pass the model's folder (or one .safetensors file)")
    folder = path if path.is_dir() else path.parent
    if not weights:
        return ModelFiles(folder, read_config(folder), ())
    if path.is_dir():
        entries = sorted(folder.iterdir())
        for entry in entries:
            if entry.name.endswith((".safetensors", ".json", ".bin")):
                check_link(entry)
        if not any(e.name == "config.json" or e.name.endswith((".safetensors", ".bin")) for e in entries):
            raise _damaged(path, "holds no config.json and no weights: an empty or incomplete download")
    config = read_config(folder)
    for index in sorted(folder.glob("*.safetensors.index.json")):
        _check_index(index, folder)
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    return ModelFiles(folder, config, tuple((file, read_header(file)) for file in files))


def _check_index(index: Path, folder: Path) -> None:
    for shard in shard_names(read_json(index), index):
        shard_path = folder / shard
        if not shard_path.exists():
            check_link(shard_path)
            raise _damaged(shard_path, f"is named in {index.name} but missing (an incomplete download)")


def shard_names(content: Any, index: Path) -> list[str]:
    """The shard files a shard index (``content``, read from ``index``) names, each checked to be a
    file of the model's own folder."""
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _damaged(index, "has no weight_map of tensor name -> shard file (corrupt)")
    if not weight_map:  # from_pretrained would load no weight at all from it
        raise _damaged(index, "has an empty weight_map: it names no shard (corrupt)")
    shards = sorted(set(weight_map.values()))
    seen: dict[str, str] = {}
    for shard in shards:
        # A shard is a file of this folder (transformers joins the name to it): an absolute name or
        # one that climbs out ("../../etc/passwd") points outside the model, so the index is damaged.
        parts = Path(shard).parts
        if not parts or Path(shard).is_absolute() or ".." in parts or "\\" in shard or "\0" in shard:
            raise _damaged(index, f"names the shard {shard!r}, which is not a file inside the model folder (corrupt)")
        if Path(*parts) == Path(index.name):
            raise _damaged(index, f"names itself ({shard!r}) as a shard of weights (corrupt)")
        # The same file under two spellings ("a.safetensors", "./a.safetensors") would be sized twice.
        same = seen.setdefault(str(Path(*parts)), shard)
        if same != shard:
            raise _damaged(index, f"names the shard {same!r} twice, also as {shard!r} (corrupt)")
    return shards
