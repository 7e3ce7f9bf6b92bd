"""Hostile inputs (issue 16, classes 2-5): configuration values, damaged model files, arguments of
the wrong shape, and the memo under threads. Each table row is an input and the DeviceError whose
text names the fix; the thread tests use real threads."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice import resolver, testing
from whichdevice.errors import DeviceError
from whichdevice.modelfiles import DamagedModelError
from whichdevice.testing import simulate


@pytest.fixture(autouse=True)
def _no_device_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WHICHDEVICE_DEVICE", raising=False)


def check(error: pytest.ExceptionInfo[BaseException], kind: type[DeviceError], says: tuple[str, ...]) -> None:
    assert isinstance(error.value, kind), f"{type(error.value).__name__}: {error.value}"
    for fragment in says:
        assert fragment in str(error.value), f"{fragment!r} not in {str(error.value)!r}"


# ----------------------------------------------------------------------------- class 5: the memo


def test_a_change_made_while_resolving_is_not_stored_under_the_old_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread changes WHICHDEVICE_DEVICE between the key and the resolution: the answer
    # follows the reading the key was made from, and the next call sees the new value.
    real = resolver.read_request

    def changed_meanwhile(device: object) -> object:
        os.environ["WHICHDEVICE_DEVICE"] = "cuda:1"
        return real(device)

    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:0")
    with simulate("cuda:2"):
        monkeypatch.setattr(resolver, "read_request", changed_meanwhile)
        assert wd.resolve_device().device == "cuda:0"
        monkeypatch.setattr(resolver, "read_request", real)
        assert wd.resolve_device().device == "cuda:1"
        monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:0")
        assert wd.resolve_device().device == "cuda:0"


def test_threads_changing_the_variable_never_poison_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    wrong: list[str] = []

    def flip() -> None:
        while not stop.is_set():
            for value in ("cuda:0", "cuda:1", "cpu"):
                os.environ["WHICHDEVICE_DEVICE"] = value

    def ask() -> None:
        for _ in range(300):
            res = wd.resolve_device()
            if res.source == "WHICHDEVICE_DEVICE" and res.device not in ("cuda:0", "cuda:1", "cpu"):
                wrong.append(res.device)

    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cpu")
    with simulate("cuda:2"):
        threads = [threading.Thread(target=flip), *(threading.Thread(target=ask) for _ in range(2))]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        stop.set()
        threads[0].join()
        assert not wrong
        # Quiet again: every value answers with its own device, whatever was stored during the storm.
        for value in ("cuda:0", "cuda:1", "cpu", "cuda:0"):
            monkeypatch.setenv("WHICHDEVICE_DEVICE", value)
            res = wd.resolve_device()
            assert res.device == value
            assert any(f"WHICHDEVICE_DEVICE={value!r}" in step.message for step in res.trace)


def test_a_simulation_is_seen_by_threads_started_inside_it() -> None:
    seen: list[str] = []
    with simulate("cuda:2"):
        t = threading.Thread(target=lambda: seen.append(wd.resolve_device().device))
        t.start()
        t.join()
    assert seen == ["cuda:0"]
    assert wd.resolve_device().backend.name != "cuda"


def test_simulations_in_two_threads_take_turns() -> None:
    # A simulation is per process: the second thread's waits for the first one's to end, so each
    # thread sees its own machine throughout.
    answers: dict[str, list[str]] = {"hpu:8": [], "cuda:4": []}
    entered = threading.Event()

    def run(spec: str) -> None:
        with simulate(spec):
            entered.set()
            for _ in range(5):
                answers[spec].append(wd.resolve_device().backend.name)
                time.sleep(0.01)

    first = threading.Thread(target=run, args=("hpu:8",))
    first.start()
    entered.wait()
    second = threading.Thread(target=run, args=("cuda:4",))
    second.start()
    first.join()
    second.join()
    assert answers == {"hpu:8": ["hpu"] * 5, "cuda:4": ["cuda"] * 5}


def test_a_simulation_held_too_long_by_another_thread_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "WAIT_S", 0.2)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with simulate("hpu:1"):
                pass
        except DeviceError as exc:
            errors.append(exc)

    with simulate("cuda:1"):
        t = threading.Thread(target=other, name="second")
        t.start()
        t.join()
        assert wd.resolve_device().backend.name == "cuda"
    assert len(errors) == 1
    assert "per process" in str(errors[0]) and "one thread at a time" in str(errors[0])
    with simulate("hpu:1"):  # free again
        assert wd.resolve_device().backend.name == "hpu"


def test_nested_simulations_in_one_thread_still_nest() -> None:
    with simulate("cuda:1"):
        with simulate("hpu:2"):
            assert wd.resolve_device().backend.name == "hpu"
        assert wd.resolve_device().backend.name == "cuda"


# ----------------------------------------------------------------------------- class 3: damaged model files


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("intact") / "llama", tokenizer=False)


def write_safetensors(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def one_tensor(**info: object) -> dict[str, object]:
    return {"w.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], **info}}


def _config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


ST = "model.safetensors"
# (name, damage done to a copy of a tiny saved Llama folder, words the error must hold)
DAMAGE: list[tuple[str, object, tuple[str, ...]]] = [
    ("empty weights file", lambda f: (f / ST).write_bytes(b""), (ST, "too short", "truncated")),
    ("4-byte weights file", lambda f: _truncate(f / ST, 4), (ST, "too short")),
    ("cut in the header", lambda f: _truncate(f / ST, 40), (ST, "header is", "corrupt")),
    ("cut in the data", lambda f: _truncate(f / ST, (f / ST).stat().st_size // 2), (ST, "truncated download")),
    ("one byte short", lambda f: _truncate(f / ST, (f / ST).stat().st_size - 1), (ST, "truncated download")),
    ("absurd header length", lambda f: write_safetensors(f / ST, {}, length=2**63), (ST, "corrupt")),
    ("header not UTF-8", lambda f: (f / ST).write_bytes(struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"), (ST, "JSON")),
    ("header not JSON", lambda f: (f / ST).write_bytes(struct.pack("<Q", 4) + b"{no]"), (ST, "not valid JSON")),
    ("header a list", lambda f: write_safetensors(f / ST, [1, 2]), (ST, "not a JSON object")),
    ("negative shape", lambda f: write_safetensors(f / ST, one_tensor(shape=[-2, 2]), bytes(16)), ("shape", "-2")),
    ("float shape", lambda f: write_safetensors(f / ST, one_tensor(shape=[2.0, 2]), bytes(16)), ("shape",)),
    ("string shape", lambda f: write_safetensors(f / ST, one_tensor(shape="2x2"), bytes(16)), ("shape",)),
    ("unknown dtype", lambda f: write_safetensors(f / ST, one_tensor(dtype="F17"), bytes(16)), ("'F17'",)),
    ("entry not an object", lambda f: write_safetensors(f / ST, {"w": 3}), ("dtype",)),
    ("no data_offsets", lambda f: write_safetensors(f / ST, one_tensor(data_offsets=None)), ("data_offsets",)),
    ("reversed offsets", lambda f: write_safetensors(f / ST, one_tensor(data_offsets=[16, 0]), bytes(16)), ("data_",)),
    ("offsets past the end", lambda f: write_safetensors(f / ST, one_tensor(), bytes(8)), ("truncated download",)),
    ("shape and bytes disagree", lambda f: write_safetensors(f / ST, one_tensor(shape=[3, 3]), bytes(16)), ("shape",)),
    ("weights file a folder", lambda f: ((f / ST).unlink(), (f / ST).mkdir()), (ST, "not a file")),
    ("config not JSON", lambda f: (f / "config.json").write_text("{not json"), ("config.json", "not valid JSON")),
    ("config empty", lambda f: (f / "config.json").write_text(""), ("config.json", "not valid JSON")),
    ("config not UTF-8", lambda f: (f / "config.json").write_bytes(b"\xff\xfe{}"), ("config.json", "UTF-8")),
    ("config a list", lambda f: (f / "config.json").write_text("[]"), ("config.json", "not an object")),
    ("config a string", lambda f: (f / "config.json").write_text('"llama"'), ("config.json", "str")),
    ("config without model_type", lambda f: _config(f, model_type=None), ("config.json", "no model_type")),
    ("model_type a number", lambda f: _config(f, model_type=7), ("no model_type", "7")),
    ("hidden_size negative", lambda f: _config(f, hidden_size=-64), ("hidden_size=-64", "whole number")),
    ("hidden_size zero", lambda f: _config(f, hidden_size=0), ("hidden_size=0",)),
    ("hidden_size a string", lambda f: _config(f, hidden_size="64"), ("hidden_size='64'",)),
    ("hidden_size a float", lambda f: _config(f, hidden_size=64.5), ("hidden_size=64.5",)),
    ("hidden_size huge", lambda f: _config(f, hidden_size=10**30), ("hidden_size=",)),
    ("layers a bool", lambda f: _config(f, num_hidden_layers=True), ("num_hidden_layers=True",)),
    ("heads zero", lambda f: _config(f, num_attention_heads=0), ("num_attention_heads=0",)),
    ("vocab a list", lambda f: _config(f, vocab_size=[256]), ("vocab_size=[256]",)),
    ("dtype a number", lambda f: _config(f, dtype=16), ("dtype=16", "bfloat16")),
    ("dtype unknown", lambda f: _config(f, torch_dtype="fp16!"), ("torch_dtype='fp16!'",)),
    (
        "sub-config value",
        lambda f: _config(f, text_config={"model_type": "llama", "hidden_size": -1}),
        ("text_config",),
    ),
]


@pytest.mark.parametrize(("damage", "says"), [(d, s) for _, d, s in DAMAGE], ids=[n for n, _, _ in DAMAGE])
def test_a_damaged_model_folder_is_named_with_the_fix(intact: Path, tmp_path: Path, damage, says) -> None:
    folder = tmp_path / "model"
    shutil.copytree(intact, folder)
    damage(folder)
    for call in (
        lambda: wd.resolve_device(model=folder),
        lambda: wd.resolve_device(model=str(folder), device_map="auto"),
    ):
        with pytest.raises(DamagedModelError) as error:
            call()
        check(error, DamagedModelError, (*says, "download it again", "save_pretrained"))


def _hub_cache(root: Path, intact: Path, repo: str = "acme/tiny") -> Path:
    """A Hub cache holding ``repo`` as huggingface_hub lays it out: blobs, and a snapshot of links to them."""
    entry = root / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("a" * 40)
    for file in intact.iterdir():
        blob = entry / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.mark.parametrize("missing", [ST, "config.json"])
def test_a_cache_snapshot_whose_blob_is_gone(intact, tmp_path, monkeypatch, missing) -> None:
    from huggingface_hub import constants

    snapshot = _hub_cache(tmp_path / "hub", intact)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert wd.resolve_device(model="acme/tiny").device_map  # intact: found through the cache
    (snapshot / missing).resolve().unlink()  # an interrupted download: the link stays, the blob is gone
    for model in ("acme/tiny", snapshot):
        with pytest.raises(DamagedModelError) as error:
            wd.resolve_device(model=model)
        check(error, DamagedModelError, (missing, "missing", "interrupted", "hf download acme/tiny --force-download"))


def test_links_that_dangle_or_loop(intact: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(intact, folder)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(folder / "config.json")
    with pytest.raises(DamagedModelError, match="loops"):
        wd.resolve_device(model=folder)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(DamagedModelError, match="missing"):
        wd.resolve_device(model=folder)
    link = tmp_path / "link-to-nothing"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(DamagedModelError, match="missing"):
        wd.resolve_device(model=link)
    link.unlink()
    link.symlink_to(link)
    with pytest.raises(DamagedModelError, match="loops"):
        wd.resolve_device(model=link)


def test_a_shard_index_that_names_a_missing_shard(intact: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(intact, folder)
    (folder / ST).rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DamagedModelError) as error:
        wd.resolve_device(model=folder)
    check(error, DamagedModelError, ("model-00002-of-00002.safetensors", "incomplete download"))
    (folder / "model.safetensors.index.json").write_text("{")
    with pytest.raises(DamagedModelError, match=r"index\.json: is not valid JSON"):
        wd.resolve_device(model=folder)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(DamagedModelError, match="weight_map"):
        wd.resolve_device(model=folder)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"model_type": "no-such-architecture"}, "transformers cannot build a config"),
        ({"hidden_size": None, "n_embd": -3}, "n_embd=-3"),
    ],
)
def test_a_config_only_folder_is_checked_before_transformers_reads_it(tmp_path, changes, says) -> None:
    from tiny_models import tiny_config

    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**tiny_config().to_dict(), **changes}))
    with pytest.raises(DamagedModelError, match=re.escape(says)):
        wd.resolve_device(model=folder)


def test_a_config_object_with_bad_values(tmp_path: Path) -> None:
    from tiny_models import tiny_config

    config = tiny_config()
    config.num_hidden_layers = -2
    with pytest.raises(DamagedModelError, match=r"num_hidden_layers=-2.*build the config with valid values"):
        wd.resolve_device(model=config)


def test_the_intact_folder_still_resolves(intact: Path) -> None:
    res = wd.resolve_device(model=intact)
    assert any("safetensors headers" in step.message for step in res.trace)
