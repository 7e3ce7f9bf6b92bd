"""Visible-devices variables, parsed the way each runtime reads them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import whichdevice as wd
from whichdevice.core.errors import DeviceError
from whichdevice.hardware.visible import (
    Visibility,
    parse_cuda,
    parse_habana,
    parse_index_list,
    parse_ranges,
    parse_ze_affinity_mask,
    visible_devices,
)
from whichdevice.testing import simulate

# ---------------------------------------------------------------------------------------------- CUDA


def test_cuda_unset_means_every_gpu() -> None:
    vis = parse_cuda({})
    assert vis == Visibility()
    assert not vis.restricted
    assert vis.count(4) == 4
    assert vis.physical_id(3) == "3"


@pytest.mark.parametrize(
    ("value", "ids"),
    [("0", ("0",)), ("1,3", ("1", "3")), ("3,1", ("3", "1")), ("7", ("7",))],
)
def test_cuda_integer_lists(value: str, ids: tuple[str, ...]) -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": value})
    assert vis.variable == "CUDA_VISIBLE_DEVICES"
    assert vis.raw == value
    assert vis.ids == ids
    assert vis.warnings == ()
    assert vis.count(8) == len(ids)
    assert vis.physical_id(0) == ids[0]


def test_cuda_uuids() -> None:
    gpu = "GPU-8a1c6f3e-1111-2222-3333-444455556666,GPU-9b2d7a4f-aaaa-bbbb-cccc-ddddeeeeffff"
    assert parse_cuda({"CUDA_VISIBLE_DEVICES": gpu}).ids == tuple(gpu.split(","))
    mig = "MIG-4f3e2d1c-0000-1111-2222-333344445555"
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": mig})
    assert vis.ids == (mig,)
    assert vis.physical_id(0) == mig


def test_cuda_uuid_list_stops_at_a_non_uuid_entry() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,1"})
    assert vis.ids == ("GPU-aaaa",)
    assert any("stops reading at '1'" in w for w in vis.warnings)


def test_cuda_repeated_uuid_hides_everything() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-aaaa"})
    assert vis.ids == ()
    assert any("repeats" in w for w in vis.warnings)


def test_cuda_empty_means_no_gpu() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": ""})
    assert vis.ids == ()
    assert vis.restricted
    assert vis.count(8) == 0
    assert any("empty" in w and "hides every GPU" in w for w in vis.warnings)


def test_cuda_minus_one_means_no_gpu() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "-1"})
    assert vis.ids == ()
    assert vis.warnings == ("CUDA_VISIBLE_DEVICES=-1 hides every GPU",)


def test_cuda_minus_one_after_indices_ends_the_list() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "0,-1,2"})
    assert vis.ids == ("0",)
    assert any("stops reading" in w for w in vis.warnings)


def test_cuda_empty_entry_ends_the_list() -> None:
    # The runtime reads "0,,2" as just GPU 0.
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "0,,2"})
    assert vis.ids == ("0",)
    assert any("visible GPUs are: 0" in w for w in vis.warnings)


def test_cuda_repeated_index_hides_everything() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "0,0"})
    assert vis.ids == ()
    assert any("repeats GPU 0" in w for w in vis.warnings)


def test_cuda_garbage_hides_everything_with_a_warning() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "abc"})
    assert vis.ids == ()
    assert any("stops reading at 'abc'" in w and "none" in w for w in vis.warnings)


def test_cuda_number_with_trailing_text_reads_like_strtoul() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "1gpu,2"})
    assert vis.ids == ("1", "2")
    assert any("reads '1gpu' as 1" in w for w in vis.warnings)


def test_cuda_spaces() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": " 0, 1 "})
    assert vis.ids == ("0", "1")
    assert any("surrounding spaces" in w for w in vis.warnings)
    assert parse_cuda({"CUDA_VISIBLE_DEVICES": "0, 1"}).ids == ("0", "1")


def test_cuda_non_ascii_digits_are_not_indices() -> None:
    # C's strtoul reads ASCII digits only; "٣" (Arabic-Indic three) ends the list.
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "0,\u0663"})
    assert vis.ids == ("0",)


def test_cuda_huge_number_ends_the_list_instead_of_crashing() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "1," + "9" * 5000})
    assert vis.ids == ("1",)
    assert vis.warnings


# ---------------------------------------------------------------------------------------------- ROCm


def test_rocm_hip_visible_devices() -> None:
    vis = parse_cuda({"HIP_VISIBLE_DEVICES": "2,3"}, rocm=True)
    assert (vis.variable, vis.ids) == ("HIP_VISIBLE_DEVICES", ("2", "3"))


def test_rocm_rocr_alone() -> None:
    vis = parse_cuda({"ROCR_VISIBLE_DEVICES": "4,5"}, rocm=True)
    assert (vis.variable, vis.ids) == ("ROCR_VISIBLE_DEVICES", ("4", "5"))


def test_rocm_rocr_applies_first_then_hip_selects_among_it() -> None:
    vis = parse_cuda({"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "0,2"}, rocm=True)
    assert vis.variable == "HIP_VISIBLE_DEVICES"
    assert vis.ids == ("4", "6")


def test_rocm_rocr_then_cuda_visible_devices_selects_among_it() -> None:
    # On ROCm, CUDA_VISIBLE_DEVICES acts like HIP_VISIBLE_DEVICES: it indexes what ROCR left.
    vis = parse_cuda({"ROCR_VISIBLE_DEVICES": "4,5,6", "CUDA_VISIBLE_DEVICES": "1"}, rocm=True)
    assert vis.variable == "CUDA_VISIBLE_DEVICES"
    assert vis.ids == ("5",)


def test_rocm_cuda_visible_devices_alone_is_honoured() -> None:
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": "1"}, rocm=True)
    assert (vis.variable, vis.ids) == ("CUDA_VISIBLE_DEVICES", ("1",))


def test_rocm_hip_wins_over_cuda_with_a_warning() -> None:
    vis = parse_cuda({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}, rocm=True)
    assert vis.ids == ("1",)
    assert any("HIP_VISIBLE_DEVICES wins" in w for w in vis.warnings)


def test_rocm_hip_longer_than_rocr_raises() -> None:
    with pytest.raises(DeviceError, match="ROCR_VISIBLE_DEVICES"):
        parse_cuda({"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1"}, rocm=True)


def test_rocm_hip_index_beyond_rocr_is_a_wrong_setting() -> None:
    with pytest.raises(DeviceError, match=r"ROCR_VISIBLE_DEVICES='4,5' leaves only 2.*write HIP_VISIBLE_DEVICES=0,1"):
        parse_cuda({"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "3"}, rocm=True)


def test_rocr_ignored_on_nvidia_builds() -> None:
    vis = parse_cuda({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"})
    assert vis == Visibility()


def test_visible_devices_dispatches_on_variant() -> None:
    env = {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert visible_devices("cuda", env).ids == ("0",)
    assert visible_devices("cuda", env, variant="rocm").ids == ("1",)


# ----------------------------------------------------------------------------------------------- XPU


@pytest.mark.parametrize(
    ("value", "ids"),
    [("0", ("0",)), ("0,1", ("0", "1")), ("0.1", ("0.1",)), ("0.0,0.1,1", ("0.0", "0.1", "1"))],
)
def test_ze_affinity_mask(value: str, ids: tuple[str, ...]) -> None:
    vis = visible_devices("xpu", {"ZE_AFFINITY_MASK": value})
    assert (vis.variable, vis.ids, vis.warnings) == ("ZE_AFFINITY_MASK", ids, ())


@pytest.mark.parametrize("value", ["a", "0..1", "0.1.2", "0,0", "-1", "0,,1"])
def test_ze_affinity_mask_rejects(value: str) -> None:
    with pytest.raises(DeviceError, match="ZE_AFFINITY_MASK"):
        parse_ze_affinity_mask(value)


def test_ze_affinity_mask_empty_hides_every_device() -> None:
    vis = visible_devices("xpu", {"ZE_AFFINITY_MASK": ""})
    assert vis.ids == ()
    assert any("hides every device" in w for w in vis.warnings)


# ------------------------------------------------------------------------------------------- Gaudi


def test_habana_modules() -> None:
    vis = parse_habana({"HABANA_VISIBLE_MODULES": "0,1,2,3"})
    assert (vis.variable, vis.ids, vis.warnings) == ("HABANA_VISIBLE_MODULES", ("0", "1", "2", "3"), ())


def test_habana_devices() -> None:
    vis = parse_habana({"HABANA_VISIBLE_DEVICES": "4,5"})
    assert (vis.variable, vis.ids) == ("HABANA_VISIBLE_DEVICES", ("4", "5"))


def test_habana_devices_all() -> None:
    vis = parse_habana({"HABANA_VISIBLE_DEVICES": "all"})
    assert vis.ids is None
    assert vis.variable == "HABANA_VISIBLE_DEVICES"


def test_habana_modules_win_and_disagreement_warns() -> None:
    vis = parse_habana({"HABANA_VISIBLE_MODULES": "0,1", "HABANA_VISIBLE_DEVICES": "2,3"})
    assert (vis.variable, vis.ids) == ("HABANA_VISIBLE_MODULES", ("0", "1"))
    assert len(vis.warnings) == 1
    assert "disagree" in vis.warnings[0] and "HABANA_VISIBLE_MODULES" in vis.warnings[0]


def test_habana_agreement_does_not_warn() -> None:
    vis = parse_habana({"HABANA_VISIBLE_MODULES": "0,1", "HABANA_VISIBLE_DEVICES": "1,0"})
    assert vis.warnings == ()
    vis = parse_habana({"HABANA_VISIBLE_MODULES": "0,1", "HABANA_VISIBLE_DEVICES": "all"})
    assert vis.warnings == ()


def test_habana_bad_value_raises() -> None:
    with pytest.raises(DeviceError, match="HABANA_VISIBLE_MODULES"):
        parse_habana({"HABANA_VISIBLE_MODULES": "0,x"})


# ------------------------------------------------------------------------------------------ Neuron


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        ("0", ("0",)),
        ("0-3", ("0", "1", "2", "3")),
        ("0,2,4-5", ("0", "2", "4", "5")),
        (" 8-9 ", ("8", "9")),
        ("3-3", ("3",)),
    ],
)
def test_neuron_ranges(value: str, ids: tuple[str, ...]) -> None:
    vis = visible_devices("neuron", {"NEURON_RT_VISIBLE_CORES": value})
    assert (vis.variable, vis.ids) == ("NEURON_RT_VISIBLE_CORES", ids)


@pytest.mark.parametrize(
    ("value", "match"),
    [("3-1", "backwards"), ("0-2,1", "twice"), ("a-b", "not a core"), ("0-", "not a core"), ("1,,2", "not a core")],
)
def test_neuron_ranges_reject(value: str, match: str) -> None:
    with pytest.raises(DeviceError, match=match):
        parse_ranges(value, "NEURON_RT_VISIBLE_CORES")


def test_neuron_huge_range_is_rejected_quickly() -> None:
    with pytest.raises(DeviceError, match="NEURON_RT_VISIBLE_CORES"):
        parse_ranges("0-100000000", "NEURON_RT_VISIBLE_CORES")


# --------------------------------------------------------------------------- plain index lists


@pytest.mark.parametrize(
    ("backend", "variable"),
    [
        ("npu", "ASCEND_RT_VISIBLE_DEVICES"),
        ("mlu", "MLU_VISIBLE_DEVICES"),
        ("musa", "MUSA_VISIBLE_DEVICES"),
        ("tpu", "TPU_VISIBLE_CHIPS"),
    ],
)
def test_index_list_backends(backend: str, variable: str) -> None:
    assert visible_devices(backend, {}) == Visibility()
    vis = visible_devices(backend, {variable: "0,2"})
    assert (vis.variable, vis.raw, vis.ids, vis.warnings) == (variable, "0,2", ("0", "2"), ())
    assert vis.physical_id(1) == "2"
    empty = visible_devices(backend, {variable: ""})
    assert empty.ids == () and empty.warnings
    with pytest.raises(DeviceError, match=variable):
        visible_devices(backend, {variable: "0,x"})
    with pytest.raises(DeviceError, match="twice"):
        visible_devices(backend, {variable: "1,1"})


def test_index_list_accepts_spaces_and_normalises_leading_zeros() -> None:
    assert parse_index_list(" 0 , 01 ", "X") == ("0", "1")


@pytest.mark.parametrize("value", ["-1", "1.5", "\u0663", "0,,1", "9" * 5000])
def test_index_list_rejects(value: str) -> None:
    with pytest.raises(DeviceError):
        parse_index_list(value, "ASCEND_RT_VISIBLE_DEVICES")


def test_backends_without_a_variable_see_everything() -> None:
    assert visible_devices("cpu", {"CUDA_VISIBLE_DEVICES": ""}) == Visibility()
    assert visible_devices("mps", {}) == Visibility()


def test_visible_devices_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    assert visible_devices("npu").ids == ("3",)


def test_unknown_backend_raises_device_error() -> None:
    with pytest.raises(DeviceError, match="Did you mean 'cuda'"):
        visible_devices("gpu", {})


# --------------------------------------------------------------------------------- property tests

_ENV_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=30) | st.text(
    alphabet="0123456789,.- GPUMI\t\u0663", max_size=20
)

_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "HABANA_VISIBLE_MODULES",
    "HABANA_VISIBLE_DEVICES",
    "NEURON_RT_VISIBLE_CORES",
    "TPU_VISIBLE_CHIPS",
    "ASCEND_RT_VISIBLE_DEVICES",
    "MLU_VISIBLE_DEVICES",
    "MUSA_VISIBLE_DEVICES",
)


@settings(max_examples=300, deadline=None)
@given(
    env=st.dictionaries(st.sampled_from(_VARIABLES), _ENV_TEXT, max_size=4),
    backend=st.sampled_from(["cuda", "rocm", "xpu", "hpu", "neuron", "tpu", "npu", "mlu", "musa"]),
)
def test_any_text_parses_or_raises_device_error(env: dict[str, str], backend: str) -> None:
    try:
        name, variant = ("cuda", "rocm") if backend == "rocm" else (backend, None)
        vis = visible_devices(name, env, variant=variant)
    except DeviceError as exc:
        assert str(exc)
        return
    assert isinstance(vis, Visibility)
    if vis.ids is not None:
        assert all(isinstance(i, str) and i for i in vis.ids)
        assert len(set(vis.ids)) == len(vis.ids)
        assert vis.count(99) == len(vis.ids)


_INDEX_LISTS = st.lists(st.integers(min_value=0, max_value=10_000), unique=True, max_size=16)


@settings(max_examples=200, deadline=None)
@given(indices=_INDEX_LISTS)
def test_valid_index_lists_round_trip(indices: list[int]) -> None:
    text = ",".join(map(str, indices))
    expected = tuple(map(str, indices))
    assert parse_index_list(text, "MLU_VISIBLE_DEVICES") == expected
    assert parse_ze_affinity_mask(text) == expected
    if indices:
        assert parse_ranges(text, "NEURON_RT_VISIBLE_CORES") == expected
        vis = parse_cuda({"CUDA_VISIBLE_DEVICES": text})
        assert vis.ids == expected
        assert vis.warnings == ()
        assert [vis.physical_id(i) for i in range(len(indices))] == list(expected)


@settings(max_examples=100, deadline=None)
@given(lo=st.integers(min_value=0, max_value=200), width=st.integers(min_value=0, max_value=64))
def test_neuron_range_round_trip(lo: int, width: int) -> None:
    hi = lo + width
    assert parse_ranges(f"{lo}-{hi}", "NEURON_RT_VISIBLE_CORES") == tuple(str(i) for i in range(lo, hi + 1))


# ------------------------------------------------------------- every error names the value to write

# (backend, variant, environment, the fix the error must name)
_WRONG_SETTINGS = [
    ("npu", None, {"ASCEND_RT_VISIBLE_DEVICES": "1,1"}, "write ASCEND_RT_VISIBLE_DEVICES=1"),
    ("npu", None, {"ASCEND_RT_VISIBLE_DEVICES": "0,2,0"}, "write ASCEND_RT_VISIBLE_DEVICES=0,2"),
    ("mlu", None, {"MLU_VISIBLE_DEVICES": "0,x"}, "write MLU_VISIBLE_DEVICES=0"),
    ("musa", None, {"MUSA_VISIBLE_DEVICES": "a"}, "unset MUSA_VISIBLE_DEVICES"),
    ("tpu", None, {"TPU_VISIBLE_CHIPS": "0," + "9" * 40}, "write TPU_VISIBLE_CHIPS=0"),
    ("hpu", None, {"HABANA_VISIBLE_MODULES": "2,2"}, "write HABANA_VISIBLE_MODULES=2"),
    ("hpu", None, {"HABANA_VISIBLE_DEVICES": "0,-1"}, "write HABANA_VISIBLE_DEVICES=0"),
    ("neuron", None, {"NEURON_RT_VISIBLE_CORES": "0-3,1"}, "write NEURON_RT_VISIBLE_CORES=0-3"),
    ("neuron", None, {"NEURON_RT_VISIBLE_CORES": "0,2,2,4-5"}, "write NEURON_RT_VISIBLE_CORES=0,2,4-5"),
    ("neuron", None, {"NEURON_RT_VISIBLE_CORES": "0-99999"}, "unset NEURON_RT_VISIBLE_CORES"),
    ("neuron", None, {"NEURON_RT_VISIBLE_CORES": "3-1"}, "write 1-3"),
    ("neuron", None, {"NEURON_RT_VISIBLE_CORES": "x"}, "unset NEURON_RT_VISIBLE_CORES"),
    ("xpu", None, {"ZE_AFFINITY_MASK": "0.1,0.1"}, "write ZE_AFFINITY_MASK=0.1"),
    ("xpu", None, {"ZE_AFFINITY_MASK": "0:1"}, "unset ZE_AFFINITY_MASK"),
    ("cuda", "rocm", {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1"}, "write HIP_VISIBLE_DEVICES=0"),
    ("cuda", "rocm", {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "2"}, "write HIP_VISIBLE_DEVICES=0,1"),
    ("cuda", "rocm", {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1,2"}, "write HIP_VISIBLE_DEVICES=1"),
    ("cuda", "rocm", {"ROCR_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "0,1,2"}, "CUDA_VISIBLE_DEVICES=0,1"),
    ("cuda", "rocm", {"ROCR_VISIBLE_DEVICES": "x"}, "ROCR_VISIBLE_DEVICES"),
]


@pytest.mark.parametrize(("backend", "variant", "env", "fix"), _WRONG_SETTINGS, ids=str)
def test_visible_devices_errors_name_the_value_to_write(
    backend: str, variant: str | None, env: dict[str, str], fix: str
) -> None:
    from whichdevice.hardware.visible import visibility_error

    try:
        vis = visible_devices(backend, env, variant=variant)
    except DeviceError as exc:
        assert fix in str(exc)
        assert visibility_error(backend, env, variant=variant) is not None
    else:  # a value the runtime reads its own way: the warning names the fix
        assert any(fix in w for w in vis.warnings), vis.warnings


def test_a_failed_probe_finds_the_rocm_setting_that_stopped_it() -> None:
    from whichdevice.hardware.visible import visibility_error

    env = {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(DeviceError) as raised:
        visible_devices("cuda", env, variant="rocm")
    # The failed probe no longer knows its build; the reason it recorded picks the right one.
    found = visibility_error("cuda", env, reason=f"cuda: {raised.value}")
    assert found is not None and str(found) == str(raised.value)
    assert visibility_error("cuda", env, reason="cuda: something else") is None
    assert visibility_error("cuda", {}, reason="cuda: anything") is None


@pytest.mark.parametrize(
    "env",
    [
        {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0,1"},
        {"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "3"},
        {"ROCR_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"},
    ],
    ids=str,
)
def test_rocm_mismatch_is_a_wrong_setting_for_check(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from whichdevice import cli
    from whichdevice.core.errors import DeviceUnavailableError

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with simulate("cuda:4,variant=rocm"):
        with pytest.raises(DeviceError) as raised:
            wd.resolve_device("cuda")
        assert not isinstance(raised.value, DeviceUnavailableError)
        assert "ROCR_VISIBLE_DEVICES" in str(raised.value) and "write" in str(raised.value)
    assert cli.main(["--simulate", "cuda:4,variant=rocm", "check", "cuda"]) == 2


def test_misread_values_name_the_value_to_write_too() -> None:
    uuid = "GPU-00000000-0000-0000-0000-000000000001"
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": f"{uuid},{uuid}"})
    assert vis.ids == () and any(f"write CUDA_VISIBLE_DEVICES={uuid}" in w for w in vis.warnings)
    vis = parse_cuda({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}, rocm=True)
    assert any("unset CUDA_VISIBLE_DEVICES" in w for w in vis.warnings)


@pytest.mark.parametrize("value", ["GPU-", "MIG-", "GPU-0c6b4d1e,GPU-", " GPU- "])
def test_an_empty_uuid_prefix_is_an_error_naming_the_form(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime matches a UUID by prefix, so "GPU-" would pick any GPU: refused, not read as GPU 0.
    with pytest.raises(DeviceError, match="has no UUID after it; write the whole UUID as `nvidia-smi -L` prints"):
        parse_cuda({"CUDA_VISIBLE_DEVICES": value})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with simulate("cuda:2"), pytest.raises(DeviceError, match="has no UUID after it"):
        wd.resolve_device("cuda")
