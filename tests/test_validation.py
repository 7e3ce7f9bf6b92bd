"""Hostile inputs (issue 16, classes 2-5): configuration values, damaged model files, arguments of
the wrong shape, and the memo under threads. Each table row is an input and the DeviceError whose
text names the fix; the thread tests use real threads."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice import testing
from whichdevice.core.errors import DamagedModelError, DeviceError
from whichdevice.resolve import opening
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
    real = opening.read_request

    def changed_meanwhile(device: object) -> object:
        os.environ["WHICHDEVICE_DEVICE"] = "cuda:1"
        return real(device)

    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:0")
    with simulate("cuda:2"):
        monkeypatch.setattr(opening, "read_request", changed_meanwhile)
        assert wd.resolve_device().device == "cuda:0"
        monkeypatch.setattr(opening, "read_request", real)
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
        ({"model_type": "no-such-architecture"}, "has no model_type 'no-such-architecture'"),
        ({"hidden_size": None, "n_embd": -3}, "n_embd=-3"),
    ],
)
def test_a_config_only_folder_is_checked_before_transformers_reads_it(tmp_path, changes, says) -> None:
    from tiny_models import tiny_config

    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**tiny_config().to_dict(), **changes}))
    # An architecture this transformers lacks is not damage: a DeviceError saying it cannot be sized.
    with pytest.raises(wd.DeviceError, match=re.escape(says)):
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


# ----------------------------------------------------------------------------- class 4: arguments of the wrong shape

R = wd.resolve_device
FORM = "a dict of device -> size"
# (id, call, machine spec or None for this machine, words the DeviceError must hold)
SHAPES: list[tuple[str, Callable[[], object], str | None, tuple[str, ...]]] = [
    ("max_memory a string", lambda: R(max_memory="20GiB"), None, ("max_memory='20GiB'", FORM)),
    ("max_memory a list", lambda: R(max_memory=["20GiB"]), None, (FORM,)),
    ("max_memory an int", lambda: R(max_memory=5), None, (FORM,)),
    ("max_memory a set", lambda: R(max_memory={"20GiB"}), None, (FORM,)),
    ("max_memory empty", lambda: R(max_memory={}), None, ("names no device",)),
    ("max_memory with device_map, a list", lambda: R(device_map="cpu", max_memory=[1]), None, (FORM,)),
    ("max_memory a float key", lambda: R(max_memory={0.5: "1GiB"}), None, ("key 0.5", "device indices")),
    ("max_memory a bool key", lambda: R(max_memory={True: "1GiB"}), None, ("key True",)),
    ("max_memory a negative key", lambda: R(max_memory={-1: "1GiB"}), None, ("key -1",)),
    ("max_memory 'cuda:0' key", lambda: R(max_memory={"cuda:0": "1GiB"}), "cuda:2", ("write 0 for 'cuda:0'",)),
    ("max_memory 'gpu' key", lambda: R(max_memory={"gpu": "1GiB"}), "cuda:2", ("key 'gpu'", "'cpu'", "'disk'")),
    ("max_memory device 7 of 2", lambda: R(max_memory={7: "1GiB"}), "cuda:2", ("device 7", "cuda devices 0, 1")),
    ("max_memory device 2 of 2", lambda: R(max_memory={0: "1GiB", 2: "1GiB"}), "cuda:2", ("device 2", "remove")),
    ("max_memory device 0 on a CPU", lambda: R(max_memory={0: "1GiB", "cpu": "1GiB"}), None, ("device 0",)),
    ("max_memory 'mps' on cuda", lambda: R(max_memory={0: "1GiB", "mps": "1GiB"}), "cuda:1", ("'mps'", "cuda")),
    (
        "max_memory device with device_map",
        lambda: R(device_map="auto", max_memory={5: "1GiB"}),
        "cuda:2",
        ("device 5",),
    ),
    ("size 1e30", lambda: R(max_memory={"cpu": 1e30}), None, ("1e+30", "larger than any machine")),
    ("size 2**70", lambda: R(max_memory={"cpu": 2**70}), None, ("larger than any machine",)),
    ("size inf", lambda: R(max_memory={"cpu": float("inf")}), None, ("inf", "larger than any machine")),
    ("size nan", lambda: R(max_memory={"cpu": float("nan")}), None, ("nan", "not a size")),
    ("size negative", lambda: R(max_memory={"cpu": -1}), None, ("negative",)),
    ("size None", lambda: R(max_memory={"cpu": None}), None, ("None", "not a size")),
    ("size a list", lambda: R(max_memory={"cpu": [1]}), None, ("not a size",)),
    ("size '2EiB'", lambda: R(max_memory={"cpu": "2EiB"}), None, ("not a size",)),
    ("size '1e30GB'", lambda: R(max_memory={"cpu": "1e30GB"}), None, ("not a size",)),
    ("size '9999999TiB'", lambda: R(max_memory={"cpu": "9999999TiB"}), None, ("larger than any machine",)),
    ("size 'lots'", lambda: R(max_memory={"cpu": "lots"}), None, ("'lots'", "20GiB")),
    ("torch_compile 'false'", lambda: R(torch_compile="false"), None, ("torch_compile='false'", "True or False")),
    ("torch_compile 'true'", lambda: R(torch_compile="true"), None, ("a string is not read",)),
    ("torch_compile 1", lambda: R(torch_compile=1), None, ("torch_compile=1",)),
    ("torch_compile None", lambda: R(torch_compile=None), None, ("torch_compile=None",)),
    ("refresh 'no'", lambda: R(refresh="no"), None, ("refresh='no'", "True or False")),
    ("use_kernels 'false'", lambda: R(use_kernels="false"), None, ("use_kernels='false'", "'auto'")),
    ("use_kernels 1", lambda: R(use_kernels=1), None, ("use_kernels=1",)),
    ("task a list", lambda: R(task=["training"]), None, ("task=['training']", "'inference'")),
    ("device_map 'everywhere'", lambda: R(device_map="everywhere"), None, ("'auto'", "'balanced'")),
    ("device_map a list", lambda: R(device_map=["cpu"]), None, ("device_map=['cpu']", "dict of module name")),
    ("device_map a float", lambda: R(device_map=1.5), None, ("device_map=1.5",)),
    ("device_map -1", lambda: R(device_map=-1), None, ("start at 0",)),
    ("device_map module -> 'gpu'", lambda: R(device_map={"": "gpu"}), None, ("device_map['']", "'cuda'")),
    ("device_map module -> 3.5", lambda: R(device_map={"": 3.5}), None, ("device_map['']=3.5",)),
    ("device_map int key", lambda: R(device_map={0: "cpu"}), None, ("key 0", "module name")),
    ("model an int", lambda: R(model=5), None, ("model=", "not int")),
    ("model_kwargs device_map", lambda: R().model_kwargs(device_map="anywhere"), None, ("'auto'",)),
    ("model_kwargs device 3 of 2", lambda: R().model_kwargs(device_map=3), "cuda:2", ("cuda:3", "cuda:0, cuda:1")),
    ("model_kwargs dtype", lambda: R().model_kwargs(dtype="float17"), None, ("dtype='float17'", "'bfloat16'")),
    ("model_kwargs torch_dtype", lambda: R().model_kwargs(torch_dtype=16), None, ("torch_dtype=16",)),
    ("pipeline_kwargs device 5.5", lambda: R().pipeline_kwargs(device=5.5), None, ("device=5.5",)),
    ("pipeline_kwargs device_map", lambda: R().pipeline_kwargs(device_map=[0]), None, ("device_map=[0]",)),
    ("training_kwargs 'false'", lambda: R().training_kwargs(torch_compile="false"), None, ("torch_compile='false'",)),
    ("launch_command an int", lambda: R().launch_command(5), "cuda:2", ("list of strings",)),
    ("launch_command ints", lambda: R().launch_command([1, 2]), "cuda:2", ("list of strings",)),
]


@pytest.mark.parametrize(("call", "spec", "says"), [c[1:] for c in SHAPES], ids=[c[0] for c in SHAPES])
def test_an_argument_of_the_wrong_shape_names_the_form(call, spec, says) -> None:
    with simulate(spec) if spec else contextlib.nullcontext(), pytest.raises(DeviceError) as error:
        call()
    check(error, DeviceError, says)


TA = wd.training_arguments
TRAINING_SHAPES: list[tuple[str, Callable[[str], object], tuple[str, ...]]] = [
    ("resolution a string", lambda out: TA(out, resolution="cuda"), ("resolution='cuda'", "device='cuda'")),
    ("resolution an int", lambda out: TA(out, resolution=3), ("resolution=3", "resolve_device(task='training')")),
    ("resolution a dict", lambda out: TA(out, resolution={"device": "cpu"}), ("resolution=",)),
    ("output_dir an int", lambda out: TA(5), ("output_dir=5", "folder path")),
    ("torch_compile 'false'", lambda out: TA(out, torch_compile="false"), ("torch_compile='false'", "True or False")),
    ("bf16 'false'", lambda out: TA(out, bf16="false"), ("bf16='false'",)),
    ("fp16 'yes'", lambda out: TA(out, fp16="yes"), ("fp16='yes'",)),
    ("use_cpu 'false'", lambda out: TA(out, use_cpu="false"), ("use_cpu='false'",)),
    ("gradient_checkpointing 'true'", lambda out: TA(out, gradient_checkpointing="true"), ("gradient_checkpointing",)),
    ("tf32 0", lambda out: TA(out, tf32=0), ("tf32=0",)),
]


@pytest.mark.parametrize(("call", "says"), [c[1:] for c in TRAINING_SHAPES], ids=[c[0] for c in TRAINING_SHAPES])
def test_training_arguments_of_the_wrong_shape(call, says, tmp_path: Path) -> None:
    with pytest.raises(DeviceError) as error:
        call(str(tmp_path))
    check(error, DeviceError, says)


@pytest.mark.parametrize(
    ("kwargs", "spec"),
    [
        ({"max_memory": {"cpu": "1GiB"}}, None),
        ({"max_memory": {"cpu": 1.5e9, "disk": "100GiB"}}, None),
        ({"max_memory": {0: "10GiB", 1: 5 * 2**30, "cpu": "64GB"}}, "cuda:2"),
        ({"device_map": {"": "cpu"}}, None),
        ({"device_map": {"model.embed": 0, "lm_head": "cpu", "model.norm": "disk"}}, "cuda:1"),
        ({"device_map": 1}, "cuda:2"),
        ({"torch_compile": True, "refresh": True}, None),
        # use_kernels=None is not a documented value (False, "auto", True): tests/resolve/test_arguments.py refuses it.
        ({"use_kernels": "auto"}, None),
    ],
)
def test_valid_shapes_still_resolve(kwargs, spec) -> None:
    with simulate(spec) if spec else contextlib.nullcontext():
        assert wd.resolve_device(**kwargs).device


def test_gradient_checkpointing_none_is_the_fields_own_default(tmp_path: Path) -> None:
    args = wd.training_arguments(str(tmp_path), gradient_checkpointing=None, report_to=[])
    assert args.gradient_checkpointing in (None, False)


# ----------------------------------------------------------------------------- class 2: configuration values

ENVIRONMENT: list[tuple[str, str, tuple[str, ...]]] = [
    ("LOCAL_KERNELS", "kernels-community/flash-attn2", ("LOCAL_KERNELS=", "repo=path", "org/repo=/path/to/build")),
    ("LOCAL_KERNELS", "a=/x:broken", ("'broken'", "fix or unset it")),
    ("LOCAL_KERNELS", "", ("LOCAL_KERNELS=''",)),
    ("LOCAL_KERNELS", "=/opt/k", ("'=/opt/k'",)),
    ("WHICHDEVICE_DEVICE", "gpu", ("WHICHDEVICE_DEVICE='gpu'", "Did you mean 'cuda'")),
    ("WHICHDEVICE_DEVICE", "cuda:inf", ("not a device index",)),
    ("WHICHDEVICE_DEVICE", "cuda:1e10", ("not a device index",)),
    ("WHICHDEVICE_DEVICE", "cuda:99999999999", ("too large",)),
    ("LOCAL_RANK", "abc", ("LOCAL_RANK='abc'", "whole number")),
    ("LOCAL_RANK", "inf", ("LOCAL_RANK='inf'", "whole number")),
    ("LOCAL_RANK", "1e10", ("LOCAL_RANK='1e10'",)),
    ("LOCAL_RANK", "-2", ("must be 0 or more",)),
    ("WORLD_SIZE", "0", ("WORLD_SIZE='0'", "1 or more")),
    ("WORLD_SIZE", "nan", ("WORLD_SIZE='nan'",)),
]


@pytest.mark.parametrize(("name", "value", "says"), ENVIRONMENT, ids=[f"{n}={v!r}" for n, v, _ in ENVIRONMENT])
def test_a_bad_variable_names_the_valid_form(name, value, says, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(DeviceError) as error:
        wd.resolve_device(use_kernels="auto")
    check(error, DeviceError, says)


def test_a_huge_local_rank_names_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "99999999999999999999")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with simulate("cuda:2"), pytest.raises(DeviceError) as error:
        wd.resolve_device()
    assert "LOCAL_RANK" in str(error.value)


@pytest.mark.parametrize(
    ("device_map", "spec", "says"),
    [
        (3, "cuda:2", ("cuda:3", "cuda:0, cuda:1")),
        ("cuda:5", "cuda:2", ("cuda:5",)),
        ({"": 2}, "cuda:2", ("cuda:2", "this machine has")),
        ({"model": 0, "lm_head": 9}, "cuda:2", ("cuda:9",)),
        ("xpu:0", "cuda:1", ("'xpu:0'", "use 'cuda'")),
        (0, None, ("no accelerator", "cpu")),
    ],
)
def test_a_device_map_that_names_a_missing_device(device_map, spec, says) -> None:
    with simulate(spec) if spec else contextlib.nullcontext(), pytest.raises(DeviceError) as error:
        wd.resolve_device(device_map=device_map)
    check(error, DeviceError, says)


def test_a_link_to_an_intact_folder_is_fine_and_an_empty_folder_is_not(intact: Path, tmp_path: Path) -> None:
    link = tmp_path / "linked"
    link.symlink_to(intact)
    assert wd.resolve_device(model=link).device
    (tmp_path / "empty").mkdir()
    with pytest.raises(DamagedModelError, match=r"no config\.json and no weights"):
        wd.resolve_device(model=tmp_path / "empty")
    with pytest.raises(DeviceError, match="is empty"):
        wd.resolve_device(model="")
    with pytest.raises(DeviceError, match="pass the model's folder"):
        wd.resolve_device(model=intact / "config.json")


def test_an_empty_cache_snapshot_is_an_incomplete_download(intact, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    snapshot = _hub_cache(tmp_path / "hub", intact)
    for file in snapshot.iterdir():
        file.unlink()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DamagedModelError) as error:
        wd.resolve_device(model="acme/tiny", device_map="cpu")
    check(error, DamagedModelError, ("incomplete download", "hf download acme/tiny --force-download"))


def test_no_default_config_of_this_transformers_is_called_damaged() -> None:
    # The checks hold every architecture's own defaults: lists of heads per stage (Swin), per-layer
    # sizes (Gemma 3n), head_dim=0 for "derive it", a float max_position_embeddings.
    import warnings

    from transformers import CONFIG_MAPPING

    from whichdevice.model.files import check_config

    refused = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CONFIG_MAPPING:
            try:
                config = CONFIG_MAPPING[name]().to_dict()
            except Exception:
                continue  # a config that needs arguments or a package this machine lacks
            try:
                check_config(config, f"<{name}>")
            except DamagedModelError as exc:
                refused.append(str(exc))
    assert not refused


LORA: list[tuple[str, dict[str, object], tuple[str, ...]]] = [
    ("r zero", {"r": 0}, ("r=0", "rank")),
    ("r a string", {"r": "16"}, ("r='16'",)),
    ("r a float", {"r": 16.0}, ("r=16.0",)),
    ("alpha negative", {"lora_alpha": -1}, ("lora_alpha=-1",)),
    ("alpha inf", {"lora_alpha": float("inf")}, ("lora_alpha=inf",)),
    ("dropout 1.5", {"lora_dropout": 1.5}, ("lora_dropout=1.5", "probability")),
    ("dropout a string", {"lora_dropout": "0.1"}, ("lora_dropout='0.1'",)),
    ("targets an int", {"target_modules": 3}, ("target_modules=3", "'all-linear'")),
    ("targets empty", {"target_modules": []}, ("target_modules=[]",)),
    ("targets of ints", {"target_modules": [1, 2]}, ("target_modules=[1, 2]",)),
    ("checkpointing 'false'", {"gradient_checkpointing": "false"}, ("gradient_checkpointing='false'",)),
    ("resolution a string", {"resolution": "cuda"}, ("resolution='cuda'", "device='cuda'")),
]


@pytest.mark.parametrize(("kwargs", "says"), [c[1:] for c in LORA], ids=[c[0] for c in LORA])
def test_lora_arguments_of_the_wrong_shape(kwargs, says) -> None:
    with pytest.raises(DeviceError) as error:
        wd.lora_training(object(), **kwargs)
    check(error, DeviceError, says)


@pytest.mark.parametrize(("args", "says"), [(("cuda", 4), ("resolution='cuda'",)), ((None, 3), ("bits=3",))])
def test_kbit_training_kwargs_arguments(args, says) -> None:
    from whichdevice.training.lora import kbit_training_kwargs

    resolution, bits = args
    with pytest.raises(DeviceError) as error:
        kbit_training_kwargs(wd.resolve_device(task="training") if resolution is None else resolution, bits)
    check(error, DeviceError, says)
