"""devices= in Lightning's forms, the GPUs this process can use, and the same answer as making them visible."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.device.selection import parse_devices
from whichdevice.testing import simulate
from whichdevice.training.simulated import SimulatedTrainingError

GiB = 1024**3
LAUNCH = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*LAUNCH, "CUDA_VISIBLE_DEVICES", "WHICHDEVICE_DEVICE"):
        monkeypatch.delenv(name, raising=False)


def _launched(monkeypatch: pytest.MonkeyPatch, local_rank: int, world: int = 2) -> None:
    values = {"LOCAL_RANK": local_rank, "RANK": local_rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


# ------------------------------------------------------------------------------ Lightning's forms

ACCEPTED = [
    (2, (2, None)),
    ("2", (2, None)),
    (" 3 ", (3, None)),
    ([1, 3], (None, (1, 3))),
    ((3, 1), (None, (3, 1))),
    ("0,2", (None, (0, 2))),
    ("2,", (None, (2,))),  # Lightning: a trailing comma makes it a list
    (-1, (None, None)),
    ("-1", (None, None)),
]


@pytest.mark.parametrize(("value", "parsed"), ACCEPTED, ids=[repr(v) for v, _ in ACCEPTED])
def test_lightnings_forms(value: object, parsed: tuple[int | None, tuple[int, ...] | None]) -> None:
    asked = parse_devices(value)
    assert asked is not None and (asked.count, asked.indices) == parsed
    assert parse_devices(None) is None


REFUSED = [
    (0, "selects no device"),
    ("0", "selects no device"),
    (-2, "a count is 1 or more"),
    (True, "not device counts"),
    (1.5, "not float"),
    ("two", "give a count"),
    ("0,a", "lists device indices"),
    (",", "lists device indices"),
    ("", "give a count"),
    ([], "names no device"),
    ([1, 1, 2], "names device 1 twice"),
    (["1"], "whole numbers"),
    ([1, True], "whole numbers"),
    ([-1, 2], "start at 0"),
    ({1, 2}, "not set"),
    ("9" * 400, "give a count"),
]


@pytest.mark.parametrize(("value", "words"), REFUSED, ids=[repr(v)[:30] for v, _ in REFUSED])
def test_bad_lists_are_refused_before_anything_is_probed(value: object, words: str) -> None:
    with pytest.raises(wd.DeviceError) as raised:
        wd.resolve_device(devices=value)
    assert words in str(raised.value)
    assert "-1" in str(raised.value) or "cpu" in str(raised.value) or "twice" in str(raised.value)


# ------------------------------------------------------------------------ the same answer as visible


def test_a_list_is_the_answer_of_making_those_devices_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    with simulate("cuda:4"):
        listed = wd.resolve_device(devices=[2, 3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with simulate("cuda:4"):
        visible = wd.resolve_device()
    assert listed.devices == (2, 3) and visible.devices is None
    # This process numbers them 2 and 3; a process started with the variable, 0 and 1: the same GPUs.
    assert listed.device == "cuda:2" and visible.device == "cuda:0"
    assert [d.physical_id for d in listed.probe.devices] == [d.physical_id for d in visible.probe.devices]
    assert listed.device_count == visible.device_count == 2
    assert (listed.dtype_name, listed.attn_implementation) == (visible.dtype_name, visible.attn_implementation)
    command = ["env", "CUDA_VISIBLE_DEVICES=2,3", "torchrun", "--nproc-per-node=2", "train.py"]
    assert listed.launch_command(["train.py"]) == visible.launch_command(["train.py"]) == command
    assert listed.to_dict()["devices"] == [2, 3]


def test_indices_are_the_ones_this_process_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with simulate("cuda:8"):
        res = wd.resolve_device(devices="2,3")
        assert res.launch_command(["t.py"])[:2] == ["env", "CUDA_VISIBLE_DEVICES=6,7"]
        with pytest.raises(wd.DeviceUnavailableError) as raised:
            wd.resolve_device(devices=[5])
    assert "its cuda devices are 0, 1, 2, 3" in str(raised.value) and "physical 4, 5, 6, 7" in str(raised.value)


def test_a_split_names_only_the_listed_devices() -> None:
    from transformers import LlamaConfig

    # A 7B Llama in bf16 (12.6 GiB) fits no 12 GiB GPU alone: split over the two listed.
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
    with simulate("cuda:4,mem=12GiB"):
        res = wd.resolve_device(model=config, devices=[1, 3], dtype="bfloat16", quantize=None)
    assert res.device_map in ("auto", "balanced_low_0")
    assert res.max_memory is not None and set(res.max_memory) == {1, 3}
    assert res.model_kwargs()["max_memory"].keys() == {1, 3}


def test_a_count_passes_over_busy_and_unusable_devices() -> None:
    with simulate("cuda:4,free=1GiB/80GiB/80GiB/80GiB,compute=default/default/prohibited"):
        res = wd.resolve_device(devices=2)
    assert res.devices == (1, 3) and res.device == "cuda:1"
    lines = "\n".join(s.message for s in res.trace if s.topic == "device")
    assert "cuda:2 not used: its compute mode is Prohibited" in lines
    assert "cuda:0 passed over: 1.00 GiB free of 80.00 GiB" in lines


def test_every_device_is_no_selection() -> None:
    with simulate("cuda:4"):
        assert wd.resolve_device(devices=-1).devices is None
        assert wd.resolve_device(devices=4).devices is None


@pytest.mark.parametrize(
    ("spec", "value", "words"),
    [
        ("cuda:4", [5], ("device 5", "its cuda devices are 0, 1, 2, 3")),
        ("cuda:4", 6, ("asks for 6 cuda devices", "sees 4 (0, 1, 2, 3)", "at most 4")),
        (
            "cuda:4,compute=exclusive,held=0/1GiB",
            [1, 2],
            ("cannot use", "busy or unavailable", "usable ones are 0, 2, 3"),
        ),
        ("cuda:4,compute=exclusive,held=0/1GiB", 4, ("1 of them unusable", "at most 3")),
    ],
)
def test_lists_this_machine_cannot_give_name_the_valid_indices(
    spec: str, value: object, words: tuple[str, ...]
) -> None:
    with simulate(spec), pytest.raises(wd.DeviceUnavailableError) as raised:
        wd.resolve_device(devices=value)
    for word in words:
        assert word in str(raised.value)


def test_one_device_and_a_list_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    with simulate("cuda:4"):
        with pytest.raises(wd.ConfigConflictError, match="names one device"):
            wd.resolve_device("cuda:1", devices=[2, 3])
        assert wd.resolve_device("cuda", devices=[2, 3]).device == "cuda:2"
        monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:1")
        with pytest.raises(wd.ConfigConflictError, match="WHICHDEVICE_DEVICE='cuda:1' names one device"):
            wd.resolve_device(devices=[2, 3])


def test_backends_without_indices_have_no_list() -> None:
    with simulate("hpu:8"), pytest.raises(wd.ConfigConflictError, match="HABANA_VISIBLE_MODULES"):
        wd.resolve_device(devices=2)
    with simulate("cpu"), pytest.raises(wd.ConfigConflictError, match="cpu's device strings carry no index"):
        wd.resolve_device(devices=[0])


# ------------------------------------------------------------------- GPUs this process cannot use


def test_an_unusable_gpu_is_left_out_and_the_launch_skips_it() -> None:
    with simulate("cuda:4,compute=default/exclusive,held=0/1GiB"):
        inference = wd.resolve_device()
        training = wd.resolve_device(task="training")
    for res in (inference, training):
        assert res.devices == (0, 2, 3) and res.device_count == 3
        assert res.launch_command(["train.py"])[:3] == ["env", "CUDA_VISIBLE_DEVICES=0,2,3", "torchrun"]
        assert any(s.message.startswith("cuda:1 not used: exclusive-process") for s in res.trace)


def test_check_counts_the_usable_gpus_and_says_why_one_is_left_out() -> None:
    from whichdevice.report.check import check

    spec = ["cuda:4,compute=default/exclusive,held=0/1GiB"]
    assert check("cuda", min_devices=3, simulate=spec)["exit_code"] == 0
    short = check("cuda", min_devices=4, simulate=spec)
    assert short["exit_code"] == 1 and short["device_count"] == 3
    assert "3 devices are usable, fewer than --min-devices 4; cuda:1 not used: exclusive-process" in short["message"]


def test_asking_for_an_unusable_gpu_says_why_and_what_is_usable() -> None:
    with simulate("cuda:4,compute=default/exclusive,held=0/1GiB"), pytest.raises(wd.DeviceUnavailableError) as raised:
        wd.resolve_device("cuda:1")
    assert "busy or unavailable" in str(raised.value) and "cuda:0, cuda:2, cuda:3" in str(raised.value)


# ------------------------------------------------------------------------- training and launches


def test_training_in_one_process_names_the_command_that_selects_the_devices(tmp_path: Path) -> None:
    with simulate("cuda:4"):
        res = wd.resolve_device(task="training", devices=[2, 3])
        assert any("env CUDA_VISIBLE_DEVICES=2,3 python train.py" in s.message for s in res.trace)
        with pytest.raises(wd.ConfigConflictError) as raised:
            wd.training_arguments(str(tmp_path), resolution=res)
    assert "env CUDA_VISIBLE_DEVICES=2,3 python train.py" in str(raised.value)
    assert "env CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc-per-node=2 train.py" in str(raised.value)


def test_started_with_the_variable_the_list_is_every_device_and_the_arguments_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import TrainingArguments

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with simulate("cuda:4"):
        res = wd.resolve_device(task="training", devices=[2, 3])
        assert res.devices is None and res.device == "cuda:0" and res.device_count == 2
        with pytest.raises(SimulatedTrainingError) as raised:
            wd.training_arguments(str(tmp_path), resolution=res)
    # What is handed over builds a real TrainingArguments on this CPU (use_cpu=True stands in for the GPU).
    kwargs = raised.value.kwargs
    args = TrainingArguments(**{**kwargs, "use_cpu": True, "report_to": []})
    assert args.bf16 is kwargs["bf16"] and args.fp16 is kwargs["fp16"]


def test_a_rank_whose_gpu_is_unusable_says_which_launch_works(monkeypatch: pytest.MonkeyPatch) -> None:
    _launched(monkeypatch, local_rank=1, world=4)
    with simulate("cuda:4,compute=default/exclusive,held=0/1GiB"):
        with pytest.raises(wd.DeviceUnavailableError) as raised:
            wd.resolve_device(task="training")
        monkeypatch.setenv("LOCAL_RANK", "2")
        monkeypatch.setenv("RANK", "2")
        res = wd.resolve_device(task="training")
    assert "env CUDA_VISIBLE_DEVICES=0,2,3 with --nproc-per-node=3" in str(raised.value)
    assert res.device == "cuda:2"
    assert any(s.topic == "warning" and "the rank given it will fail" in s.message for s in res.trace)


def test_a_list_in_a_launched_run_must_be_what_the_launch_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    _launched(monkeypatch, local_rank=0)
    with simulate("cuda:4"), pytest.raises(wd.ConfigConflictError, match="the launch selects the devices"):
        wd.resolve_device(task="training", devices=[2, 3])


@pytest.mark.slow
def test_the_launch_command_runs_each_rank_on_its_listed_device(tmp_path: Path) -> None:
    """res.launch_command() run for real (torchrun, CPU processes): every rank resolves devices=[2, 3]
    to its own device of the two, as the variable the command sets makes them visible."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys
            import whichdevice as wd
            from whichdevice.testing import simulate
            with simulate("cuda:4"):
                res = wd.resolve_device(task="training", devices=[2, 3])
            out = {{"device": res.device, "devices": res.devices, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "physical": [d.physical_id for d in res.probe.devices]}}
            with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["LOCAL_RANK"] + ".json"), "w") as f:
                json.dump(out, f)
            """
        )
    )
    with simulate("cuda:4"):
        command = wd.resolve_device(task="training", devices=[2, 3]).launch_command([str(script)])
    assert command[:4] == ["env", "CUDA_VISIBLE_DEVICES=2,3", "torchrun", "--nproc-per-node=2"]
    # torchrun as this interpreter's module, on a free port: the rest of the command as written.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    real = [
        command[0],
        command[1],
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--master-port={port}",
        *command[3:],
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    done = subprocess.run(real, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert all(r["visible"] == "2,3" and r["physical"] == ["2", "3"] and r["devices"] is None for r in ranks)
