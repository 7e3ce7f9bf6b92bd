"""Each fact once: the deciders read what a backend can do from its registry row, plugins included.

A plugin backend gets FlashAttention, Hub kernels, bitsandbytes, its visible-devices variable, its
memory key and its precision rules from the fields of its ``Backend`` row alone; no decider holds a
list of backend names that a new row would be missing from.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import whichdevice as wd
from kernels_versions import GOOD_KERNELS
from whichdevice.attention import flash
from whichdevice.attention import kernels as kernels_support
from whichdevice.core.packages import simulated_packages
from whichdevice.device.target import Target
from whichdevice.hardware.probing import DeviceInfo, ProbeResult
from whichdevice.hardware.registry import backends
from whichdevice.hardware.visible import visible_devices
from whichdevice.memory import capacity, quantization
from whichdevice.precision import hardware as precision
from whichdevice.precision import training as training_settings

GiB = 1024**3


def _probe(backend: wd.Backend) -> ProbeResult:
    devices = tuple(DeviceInfo(i, name="Plug 1", total_memory=16 * GiB, bf16=True) for i in range(2))
    return ProbeResult(backend.name, installed=True, available=True, device_count=2, devices=devices)


def _row(name: str = "plugdev", **fields: object) -> wd.Backend:
    return wd.Backend(
        name=name,
        hardware="Plug accelerator",
        package=f"{name}-torch",
        module=f"torch_{name}",
        probe_ref=_probe,
        distributed_backend="plugccl",
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
def capable() -> wd.Backend:
    """A plugin row that says: bitsandbytes runs here, kernels key "x", FlashAttention 2."""
    return wd.register_backend(_row(bitsandbytes=True, kernels_key="x", flash_attention=(2,)))


@pytest.fixture
def kernels_usable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # As tests/attention/test_kernels_support.py: a kernels version transformers accepts, and the Hub not off.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LOCAL_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    with simulated_packages({"kernels": GOOD_KERNELS, "bitsandbytes": "0.50.0"}):
        yield


def test_a_plugin_row_is_treated_as_its_fields_say(capable, kernels_usable):
    result = wd.probe("plugdev")
    assert quantization.bitsandbytes_supports(Target.of(capable, result))[0]
    assert kernels_support.kernels_key(Target.of(capable, result)) == "x"
    assert "x" in kernels_support.kernels_keys()
    assert flash.flash_fits("flash_attention_2", Target.of(capable, result), "bfloat16")[0]
    ok, why = flash.flash_fits("flash_attention_3", Target.of(capable, result), "bfloat16")
    assert not ok and "CUDA GPUs only" in why
    # The other backends name it among those that run FlashAttention 2.
    ok, why = flash.flash_fits("flash_attention_2", Target.of(wd.get_backend("hpu"), wd.probe("cpu")), "bfloat16")
    assert not ok and "plugdev" in why

    res = wd.resolve_device("plugdev", quantize="4bit", attn_implementation="flash_attention_2", use_kernels="auto")
    assert res.device == "plugdev:0" and res.dtype_name == "bfloat16"
    assert res.quantization is not None and res.quantization.bits == 4
    assert res.use_kernels is True and res.kernels_key == "x"
    assert res.attn_implementation == "flash_attention_2"


def test_a_plugin_row_without_those_fields_gets_none_of_them(kernels_usable):
    plain = wd.register_backend(_row())
    result = wd.probe("plugdev")
    ok, why = quantization.bitsandbytes_supports(Target.of(plain, result))
    assert not ok and "it supports " + ", ".join(b.name for b in backends() if b.bitsandbytes) in why
    assert kernels_support.kernels_key(Target.of(plain, result)) is None
    assert not flash.flash_fits("flash_attention_2", Target.of(plain, result), "bfloat16")[0]
    res = wd.resolve_device("plugdev", use_kernels="auto")
    assert res.use_kernels is False and res.attn_implementation is None
    with pytest.raises(wd.ConfigConflictError, match="bitsandbytes does not support plugdev"):
        wd.resolve_device("plugdev", quantize="4bit")


def test_native_flash_attention_comes_from_the_row():
    wd.register_backend(_row(flash_attention=(2,), flash_attention_native=(2,)))
    res = wd.resolve_device("plugdev", attn_implementation="flash_attention_2")
    assert "served by torch_plugdev's own FlashAttention" in next(
        s.message for s in res.trace if s.topic == "attention"
    )


def test_fast_fp16_decides_precision_and_training():
    bf16_chip = wd.register_backend(_row(fast_fp16=False, default_dtype="bfloat16"))
    result = wd.probe("plugdev")
    assert precision.supports(Target.of(bf16_chip, result), "bfloat16")[0]
    assert not precision.supports(Target.of(bf16_chip, result), "float16")[0]
    assert training_settings.training_precision(Target.of(bf16_chip, result), "bfloat16")[0] == "bf16"
    no_bf16 = ProbeResult("plugdev", installed=True, available=True, device_count=1, devices=(DeviceInfo(0),))
    plain = _row(fast_fp16=False)
    assert precision.choose_dtype(Target.of(plain, no_bf16))[0] == "float32"
    assert training_settings.training_precision(Target.of(plain, no_bf16), None)[0] is None


def test_memory_by_name_and_shared_device_come_from_the_row():
    pooled = wd.register_backend(_row(memory_by_name=True))
    result = wd.probe("plugdev")
    assert capacity.capacities(Target.of(pooled, result), None) == {"plugdev": 16 * GiB}
    shared = _row(shared_device=True)
    wd.register_backend(shared, replace=True)
    assert wd.resolve_device("plugdev:0").device == "plugdev"


def test_a_plugins_visible_devices_variable_comes_from_its_row():
    wd.register_backend(_row(visible_devices_env=("PLUGDEV_VISIBLE_DEVICES",)))
    vis = visible_devices("plugdev", {"PLUGDEV_VISIBLE_DEVICES": "3,1"})
    assert vis.variable == "PLUGDEV_VISIBLE_DEVICES" and vis.ids == ("3", "1")


@pytest.mark.parametrize("row", [b for b in backends() if b.visible_devices_env], ids=lambda b: b.name)
def test_visible_devices_reads_each_variable_of_each_row(row):
    for variable in row.visible_devices_env:
        variant = "rocm" if variable in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") else None
        vis = visible_devices(row.name, {variable: "0"}, variant=variant)
        assert vis.variable == variable and vis.ids == ("0",), variable


def test_distributed_backends_follow_the_row(monkeypatch):
    wd.register_backend(_row(other_distributed_backends=("mpi",)))
    for name, value in {
        "LOCAL_RANK": "0",  # what accelerate reads on an accelerator; the ranks come from Open MPI
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    import torch.distributed

    from whichdevice.launch.distributed import detect_distributed, process_group_backend

    expected = "mpi" if torch.distributed.is_mpi_available() else "plugccl"
    assert process_group_backend(wd.get_backend("plugdev"), detect_distributed()) == expected
