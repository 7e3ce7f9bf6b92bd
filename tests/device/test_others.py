"""A second usable accelerator is said in the trace and the report, with what the Trainer would take."""

from __future__ import annotations

import inspect
import re

import whichdevice as wd
from whichdevice.device.others import TRAINER_ORDER
from whichdevice.report import gather
from whichdevice.testing import simulate


def test_trainer_order_is_the_installed_transformers_order() -> None:
    from transformers import TrainingArguments

    source = inspect.getsource(TrainingArguments._setup_devices.func)
    single = source[source.index("DistributedType.NO") :]
    found = re.findall(r"elif is_torch_(\w+)_available\(\)", single)
    assert tuple(found) == TRAINER_ORDER[:-1] and "torch.cuda.is_available()" in single


def test_a_second_accelerator_is_warned_with_what_the_trainer_takes() -> None:
    with simulate("xpu:1", "cuda:1,cc=8.0"):
        res = wd.resolve_device(task="training")
        chosen_xpu = wd.resolve_device(device="xpu", task="training")
    assert res.backend.name == "cuda" and chosen_xpu.backend.name == "xpu"
    (warning,) = [s.message for s in res.trace if s.topic == "warning" and "second accelerator" in s.message]
    assert "(xpu) besides cuda" in warning and "Trainer in a single process would train on xpu" in warning
    assert "device='xpu'" in warning
    report = gather(simulate=["xpu:1", "cuda:1,cc=8.0"])
    assert any("second accelerator" in w["message"] for w in report["warnings"])


def test_one_accelerator_has_no_such_warning() -> None:
    with simulate("cuda:1,cc=8.0"):
        res = wd.resolve_device()
    assert not any("second accelerator" in s.message for s in res.trace)
