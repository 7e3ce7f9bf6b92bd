"""Property tests for every parser of user input: device strings, visible-devices variables, launchers.

Two properties throughout: any input either parses or raises ``DeviceError`` (never anything else),
and valid input round-trips (what a parser returns, written back, parses to the same thing). Error
messages that suggest a fix suggest one that parses.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
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
from whichdevice.launch.distributed import detect_distributed

SETTINGS = settings(max_examples=200, deadline=None)

NAMES = tuple(b.name for b in wd.backends())

# Text that reaches every branch: random Unicode, and the characters device strings are made of.
ANY_TEXT = st.text(max_size=40) | st.text(alphabet="cudahpnmsx:0123456789-. ,\t\n\u0661\u00b2GPUMIC", max_size=24)

# Near misses of valid device strings: names in any case, odd separators and indices, stray spaces.
NEAR_MISS = st.builds(
    lambda pad1, name, sep, index, pad2: f"{pad1}{name}{sep}{index}{pad2}",
    st.sampled_from(["", "", " ", "\t"]),
    st.sampled_from(NAMES).flatmap(lambda n: st.sampled_from([n, n.upper(), n.capitalize()]))
    | st.sampled_from(["gpu", "GPU", "nvidia", "gaudi", "trainium", "xla", "metal", "cdua", "meta"]),
    st.sampled_from(["", ":", "::", ": ", "-", " "]),
    st.sampled_from(["", "0", "1", "07", "-1", "x", "1.0", "0:1", "abc:1", "\u0661", "99999999", " 2"]),
    st.sampled_from(["", "", " ", "\n"]),
)

_FIX = re.compile(r"(?:write(?: e\.g\.)?|or just|Did you mean) '([^']*)'")


def _parse_or_error(value: Any, source: str = "device") -> tuple[str, int | None] | DeviceError:
    try:
        return wd.parse_device(value, source)
    except DeviceError as exc:
        return exc


def _check_parsed(parsed: tuple[str, int | None]) -> None:
    name, index = parsed
    assert name in NAMES
    assert index is None or (isinstance(index, int) and index >= 0)
    # Written back the canonical way, it parses to the same thing.
    assert wd.parse_device(name if index is None else f"{name}:{index}") == parsed


# ================================================================================ device strings


@SETTINGS
@given(text=ANY_TEXT | NEAR_MISS)
def test_any_text_parses_or_raises_device_error(text: str) -> None:
    result = _parse_or_error(text, "WHICHDEVICE_DEVICE")
    if isinstance(result, DeviceError):
        assert str(result).startswith("WHICHDEVICE_DEVICE")  # the error names where the value came from
    else:
        _check_parsed(result)


@SETTINGS
@given(text=ANY_TEXT | NEAR_MISS)
def test_every_suggested_fix_parses(text: str) -> None:
    result = _parse_or_error(text)
    if isinstance(result, DeviceError):
        for fix in _FIX.findall(str(result)):
            assert not isinstance(_parse_or_error(fix), DeviceError), (text, str(result), fix)


@SETTINGS
@given(
    value=st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.binary(max_size=8)
    | st.lists(st.sampled_from(NAMES), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    | st.tuples(st.sampled_from(NAMES), st.integers())
)
def test_any_object_parses_or_raises_device_error(value: object) -> None:
    result = _parse_or_error(value)
    assert isinstance(result, DeviceError)  # only strings and torch.device objects are devices
    assert "not " + type(value).__name__ in str(result)


@SETTINGS
@given(name=st.sampled_from(NAMES), index=st.none() | st.integers(min_value=0, max_value=9_999_999))
def test_valid_device_strings_round_trip(name: str, index: int | None) -> None:
    text = name if index is None else f"{name}:{index}"
    assert wd.parse_device(text) == (name, index)
    if index is not None:
        assert wd.parse_device(f"{name}:{index:08d}") == (name, index)  # leading zeros are the same index


_TORCH_NAMES = []
for _name in NAMES:
    try:
        torch.device(_name, 0)
        _TORCH_NAMES.append(_name)
    except RuntimeError:  # out-of-tree backends parse only once their extension is imported
        pass


@SETTINGS
# torch keeps a device index in 8 bits: torch.device("cuda", 128) is cuda:-128.
@given(name=st.sampled_from(_TORCH_NAMES), index=st.none() | st.integers(min_value=0, max_value=127))
def test_torch_devices_round_trip(name: str, index: int | None) -> None:
    device = torch.device(name) if index is None else torch.device(name, index)
    assert wd.parse_device(device) == (name, index)


# ================================================================== visible-devices variables

# Values a person might export: random Unicode, or made of the characters these variables use.
ENV_TEXT = st.text(max_size=30) | st.text(alphabet="0123456789,.- \tGPUMI-abcdef\u0663all", max_size=30)


def _check_visibility(vis: Visibility) -> None:
    assert isinstance(vis, Visibility)
    if vis.ids is None:
        assert vis.count(5) == 5
        return
    assert all(isinstance(i, str) and i and i == i.strip() for i in vis.ids)
    assert len(set(vis.ids)) == len(vis.ids)
    assert vis.count(99) == len(vis.ids)
    assert [vis.physical_id(i) for i in range(len(vis.ids))] == list(vis.ids)


@SETTINGS
@given(
    env=st.fixed_dictionaries(
        {},
        optional={
            "CUDA_VISIBLE_DEVICES": ENV_TEXT,
            "HIP_VISIBLE_DEVICES": ENV_TEXT,
            "ROCR_VISIBLE_DEVICES": ENV_TEXT,
        },
    ),
    rocm=st.booleans(),
)
def test_parse_cuda_parses_or_raises_and_is_idempotent(env: dict[str, str], rocm: bool) -> None:
    try:
        vis = parse_cuda(env, rocm=rocm)
    except DeviceError as exc:
        # Only ROCm's two-level selection can be contradictory, and a UUID prefix with no UUID after it
        # ("GPU-", "MIG-") is refused rather than read as device 0 (issue 23).
        bare = any(part.strip() in ("GPU-", "MIG-") for value in env.values() for part in value.split(","))
        assert (rocm or bare) and str(exc)
        return
    _check_visibility(vis)
    if vis.ids:
        # The GPUs it found, written back as a plain list, are read the same and cleanly.
        again = parse_cuda({"CUDA_VISIBLE_DEVICES": ",".join(vis.ids)})
        assert again.ids == vis.ids and again.warnings == ()


@pytest.mark.parametrize(
    "parser",
    [
        lambda v: parse_index_list(v, "TPU_VISIBLE_CHIPS"),
        lambda v: parse_ranges(v, "NEURON_RT_VISIBLE_CORES"),
        parse_ze_affinity_mask,
    ],
    ids=["index-list", "neuron-ranges", "ze-affinity-mask"],
)
@SETTINGS
@given(value=ENV_TEXT)
def test_list_parsers_parse_or_raise_and_are_idempotent(parser: Any, value: str) -> None:
    try:
        ids = parser(value)
    except DeviceError as exc:
        assert str(exc)
        return
    assert len(set(ids)) == len(ids) and all(i and i == i.strip() for i in ids)
    assert parser(",".join(ids)) == ids or not ids


@SETTINGS
@given(
    env=st.fixed_dictionaries(
        {}, optional={"HABANA_VISIBLE_MODULES": ENV_TEXT, "HABANA_VISIBLE_DEVICES": ENV_TEXT | st.just("all")}
    )
)
def test_parse_habana_parses_or_raises_and_is_idempotent(env: dict[str, str]) -> None:
    try:
        vis = parse_habana(env)
    except DeviceError as exc:
        assert "HABANA_VISIBLE_" in str(exc)
        return
    _check_visibility(vis)
    if vis.ids:
        assert parse_habana({"HABANA_VISIBLE_MODULES": ",".join(vis.ids)}).ids == vis.ids


_VARIABLES = sorted(
    {var for b in wd.backends() for var in b.visible_devices_env}
    | {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HABANA_VISIBLE_MODULES"}
)


@pytest.mark.parametrize("backend", [*NAMES, "cuda-rocm"])
@settings(max_examples=60, deadline=None)
@given(env=st.dictionaries(st.sampled_from(_VARIABLES), ENV_TEXT, max_size=4))
def test_visible_devices_for_every_backend(backend: str, env: dict[str, str]) -> None:
    name, _, variant = backend.partition("-")
    try:
        vis = visible_devices(name, env, variant=variant or None)
    except DeviceError as exc:
        assert str(exc)
        return
    _check_visibility(vis)


# Structured valid values, each read back exactly.


@SETTINGS
@given(uuids=st.lists(st.uuids(), min_size=1, max_size=8, unique=True), kind=st.sampled_from(["GPU-", "MIG-"]))
def test_cuda_uuid_lists_round_trip(uuids: list[Any], kind: str) -> None:
    ids = tuple(f"{kind}{u}" for u in uuids)
    vis = parse_cuda({"CUDA_VISIBLE_DEVICES": ",".join(ids)})
    assert vis.ids == ids and vis.warnings == ()


@SETTINGS
@given(
    rocr=st.lists(st.integers(min_value=0, max_value=63), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_rocm_selection_within_rocr_round_trips(rocr: list[int], data: st.DataObject) -> None:
    hip = data.draw(st.lists(st.integers(min_value=0, max_value=len(rocr) - 1), max_size=len(rocr), unique=True))
    env = {"ROCR_VISIBLE_DEVICES": ",".join(map(str, rocr)), "HIP_VISIBLE_DEVICES": ",".join(map(str, hip))}
    vis = parse_cuda(env, rocm=True)
    assert vis.ids == tuple(str(rocr[i]) for i in hip)
    assert vis.variable == "HIP_VISIBLE_DEVICES"


@SETTINGS
@given(tiles=st.lists(st.tuples(st.integers(0, 63), st.none() | st.integers(0, 7)), max_size=8, unique=True))
def test_ze_affinity_masks_round_trip(tiles: list[tuple[int, int | None]]) -> None:
    ids = tuple(str(d) if t is None else f"{d}.{t}" for d, t in tiles)
    assert parse_ze_affinity_mask(",".join(ids)) == ids


@SETTINGS
@given(modules=st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=8, unique=True), data=st.data())
def test_habana_modules_round_trip(modules: list[int], data: st.DataObject) -> None:
    text = ",".join(map(str, modules))
    same_set = ",".join(map(str, data.draw(st.permutations(modules))))
    for devices in (None, "all", same_set):
        env = {"HABANA_VISIBLE_MODULES": text} | ({} if devices is None else {"HABANA_VISIBLE_DEVICES": devices})
        vis = parse_habana(env)
        assert vis.ids == tuple(map(str, modules)) and vis.warnings == ()


# ========================================================================== launcher variables

_LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
)
_NUMBERISH = st.integers(min_value=-2, max_value=9).map(str) | ENV_TEXT


@SETTINGS
@given(env=st.dictionaries(st.sampled_from(_LAUNCH_VARIABLES), _NUMBERISH, max_size=5))
def test_launcher_variables_parse_or_raise(env: dict[str, str]) -> None:
    try:
        ctx = detect_distributed(env)
    except DeviceError as exc:
        assert any(var in str(exc) for var in env)  # the error names the variable to fix
        return
    if ctx is not None:
        assert 0 <= ctx.rank < ctx.world_size
        assert ctx.local_rank >= 0
        if ctx.local_world_size is not None:
            assert ctx.local_rank < ctx.local_world_size <= ctx.world_size


@SETTINGS
@given(
    local_world=st.integers(min_value=1, max_value=16),
    nodes=st.integers(min_value=1, max_value=8),
    data=st.data(),
)
def test_torchrun_variables_round_trip(local_world: int, nodes: int, data: st.DataObject) -> None:
    world = local_world * nodes
    node = data.draw(st.integers(min_value=0, max_value=nodes - 1))
    local_rank = data.draw(st.integers(min_value=0, max_value=local_world - 1))
    rank = node * local_world + local_rank
    env = {
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "TORCHELASTIC_RUN_ID": "none",  # torchrun's mark in every worker
    }
    ctx = detect_distributed(env)
    assert ctx is not None
    assert (ctx.launcher, ctx.local_rank, ctx.rank, ctx.world_size, ctx.local_world_size) == (
        "torchrun",
        local_rank,
        rank,
        world,
        local_world,
    )
