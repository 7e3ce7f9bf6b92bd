"""Reading a model's files (whichdevice.model.files) as untrusted input: only regular files are read,
no name in the folder reaches outside it, and a safetensors header is accepted only where the
safetensors library itself accepts it."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hub_constants
from safetensors import safe_open

import whichdevice as wd
from whichdevice.core.errors import DamagedModelError
from whichdevice.model.files import read_header, read_model_folder

F32 = {"dtype": "F32", "shape": [1]}


def _safetensors(path: Path, header: dict[str, Any], data: int, *, raw: bytes | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * data)
    return path


def _config(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    return folder


# ------------------------------------------------------------------ only regular files


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_named_pipe_in_place_of_a_model_file_is_refused_at_once(tmp_path, name):
    folder = _config(tmp_path / "model")
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    outcome: list[BaseException | None] = []

    def resolve() -> None:
        try:
            wd.resolve_device(model=folder)
            outcome.append(None)
        except BaseException as error:  # handed to the test thread
            outcome.append(error)

    reader = threading.Thread(target=resolve, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # blocked in open(): a writer lets it go, so the suite does not hang
        os.close(os.open(folder / name, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"resolve_device(model=) hung on a named pipe as {name}")
    assert isinstance(outcome[0], DamagedModelError), outcome
    # config.json through core.untrusted's reader names the kind ("is a named pipe (FIFO), not a file").
    assert f"{folder / name}: is " in str(outcome[0]) and "named pipe" in str(outcome[0])


def test_a_path_too_long_for_the_system_is_a_device_error_quoting_it_short():
    with pytest.raises(wd.DeviceError, match="cannot be used as a path") as error:
        wd.resolve_device(model="m" * 5000)
    assert "5000 characters" in str(error.value) and len(str(error.value)) < 600
    with pytest.raises(wd.DeviceError):  # a NUL in the name: no ValueError from the OS layer escapes
        wd.resolve_device(model="model\0folder")


# ------------------------------------------------------------------ paths out of bounds


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"])
def test_a_shard_index_naming_a_file_outside_the_folder_is_damaged(tmp_path, shard):
    folder = _config(tmp_path / "model")
    index = {"metadata": {}, "weight_map": {"w": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DamagedModelError, match=r"not a file inside the model folder"):
        read_model_folder(folder)
    with pytest.raises(DamagedModelError):
        wd.resolve_device(model=folder)


def test_a_hub_cache_ref_pointing_outside_its_snapshots_is_damaged(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("../../../outside")
    _config(tmp_path / "outside")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DamagedModelError, match="outside its snapshots folder") as error:
        wd.resolve_device(model="org/name")
    assert "hf download org/name --force-download" in str(error.value)


# ------------------------------------------------------- safetensors headers, as the library reads them

REFUSED = {
    "overlapping": ({"a": {**F32, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 8]}}, 8),
    "a gap between tensors": ({"a": {**F32, "data_offsets": [0, 4]}, "b": {**F32, "data_offsets": [8, 12]}}, 12),
    "data not fully covered": ({"a": {**F32, "data_offsets": [0, 4]}}, 8),
    "metadata a list": ({"__metadata__": [1], "a": {**F32, "data_offsets": [0, 4]}}, 4),
    "metadata a number": ({"__metadata__": {"format": 1}, "a": {**F32, "data_offsets": [0, 4]}}, 4),
    "metadata nested": ({"__metadata__": {"x": {"y": "z"}}, "a": {**F32, "data_offsets": [0, 4]}}, 4),
}
ACCEPTED = {
    "metadata null": ({"__metadata__": None, "a": {**F32, "data_offsets": [0, 4]}}, 4),
    "metadata text": ({"__metadata__": {"format": "pt"}, "a": {**F32, "data_offsets": [0, 4]}}, 4),
    "an empty tensor first": (
        {"e": {**F32, "shape": [0], "data_offsets": [0, 0]}, "a": {**F32, "data_offsets": [0, 4]}},
        4,
    ),
    "no tensors": ({}, 0),
    "listed out of order": ({"b": {**F32, "data_offsets": [4, 8]}, "a": {**F32, "data_offsets": [0, 4]}}, 8),
}


def _library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "np") as handle:
            list(handle.keys())
    except Exception:  # SafetensorError, whatever the library calls it
        return False
    return True


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_header_the_safetensors_library_refuses_is_damaged(tmp_path, case):
    path = _safetensors(tmp_path / "model.safetensors", *REFUSED[case])
    assert not _library_accepts(path)  # the rule is the library's, read from the installed one
    with pytest.raises(DamagedModelError, match="corrupt"):
        read_header(path)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_a_header_the_safetensors_library_accepts_is_read(tmp_path, case):
    path = _safetensors(tmp_path / "model.safetensors", *ACCEPTED[case])
    assert _library_accepts(path)
    assert set(read_header(path)) == {k for k in ACCEPTED[case][0] if k != "__metadata__"}


def test_a_shape_no_machine_could_hold_is_called_that_not_a_mismatch(tmp_path):
    huge = {"a": {**F32, "shape": [10**12, 10**6], "data_offsets": [0, 4]}}
    path = _safetensors(tmp_path / "model.safetensors", huge, 4)
    assert not _library_accepts(path)
    with pytest.raises(DamagedModelError, match=r"4 EB, more than any machine holds") as error:
        read_header(path)
    assert "does not match" not in str(error.value)
