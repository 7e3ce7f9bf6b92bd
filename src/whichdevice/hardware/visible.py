"""Visible-devices variables, parsed the way each runtime reads them.

Which variable each backend reads is its registry row's ``visible_devices_env``. Each parser answers
"which physical devices sit behind visible indices 0, 1, ...?" and returns a
:class:`Visibility`. ``ids is None`` means the variable is unset (every device is visible). Values a
runtime silently misreads (``CUDA_VISIBLE_DEVICES=0,,2`` shows only GPU 0) parse the way the runtime
reads them and carry a warning that says so; values no runtime accepts raise ``DeviceError``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

from whichdevice.core.errors import DeviceError, shown
from whichdevice.core.records import Visibility

__all__ = ["Visibility", "parse_cuda", "parse_index_list", "visibility_error", "visible_devices"]


# More devices than any runtime numbers; also keeps int() away from its 4300-digit limit.
_MAX_INDEX = 1 << 20


def _strtoul(text: str) -> int:
    # The CUDA runtime reads each entry like C's strtoul: "1gpu" is 1, "" or "x" ends the list.
    # Only ASCII digits count (C's isdigit), and an absurdly large number ends the list too.
    match = re.match(r"[+-]?[0-9]+", text)
    if not match or len(match.group().lstrip("+-0")) > 7:
        return -1
    number = int(match.group())
    return number if number <= _MAX_INDEX else -1


def _index(entry: str, variable: str, value: str) -> int:
    if len(entry.lstrip("0")) > 7 or int(entry) > _MAX_INDEX:
        raise DeviceError(
            f"{variable}={shown(value)}: {entry[:20]!r} is too large to be a device index; "
            f"{_fix(variable, value, _well_formed(value))}"
        )
    return int(entry)


def _well_formed(value: str, pattern: str = r"[0-9]+") -> list[str]:
    """The entries of ``value`` a runtime reads as written, each once (what was most likely meant)."""
    meant: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if re.fullmatch(pattern, entry) and entry.isascii():
            if entry.isdigit():
                if len(entry.lstrip("0")) > 7:
                    continue
                entry = str(int(entry))
            if entry not in meant:
                meant.append(entry)
    return meant


def _fix(variable: str, value: str, meant: list[str], example: str = "0,1") -> str:
    """The value to write instead of ``value``: its well-formed entries, or an example and unset."""
    if meant and ",".join(meant) != value.strip():
        return f"write {variable}={','.join(meant)}"
    return f"write e.g. {variable}={example}, or unset {variable} to see every device"


def parse_cuda(environ: Mapping[str, str] | None = None, *, rocm: bool = False) -> Visibility:
    """CUDA_VISIBLE_DEVICES (and on ROCm, ROCR_VISIBLE_DEVICES then HIP_VISIBLE_DEVICES)."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    variable = "CUDA_VISIBLE_DEVICES"
    value = env.get(variable)
    rocr_prefix: tuple[str, ...] | None = None
    rocr: str | None = None
    if rocm:
        # ROCR is applied first by the ROCm runtime; HIP then selects among what ROCR left, through
        # HIP_VISIBLE_DEVICES or, when that is unset, CUDA_VISIBLE_DEVICES (which HIP honours too).
        rocr = env.get("ROCR_VISIBLE_DEVICES")
        hip = env.get("HIP_VISIBLE_DEVICES")
        if rocr is not None:
            rocr_prefix = _parse_cuda_value(rocr, "ROCR_VISIBLE_DEVICES", warnings)
        if hip is not None:
            if value is not None:
                warnings.append(
                    "both HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES are set; HIP_VISIBLE_DEVICES wins: "
                    "unset CUDA_VISIBLE_DEVICES"
                )
            variable, value = "HIP_VISIBLE_DEVICES", hip
        if value is None and rocr is not None:
            return Visibility("ROCR_VISIBLE_DEVICES", rocr, rocr_prefix, tuple(warnings))
        if rocr_prefix is not None and value is not None and len(value.split(",")) > len(rocr_prefix):
            # A wrong setting (exit 2), not missing hardware: HIP counts within what ROCR left.
            keep = ",".join(str(i) for i in range(len(rocr_prefix))) or "''"
            raise DeviceError(
                f"{variable}={shown(value)} names more GPUs than ROCR_VISIBLE_DEVICES={shown(rocr)} leaves "
                f"visible ({len(rocr_prefix)}); HIP numbers the GPUs ROCR shows from 0, so write "
                f"{variable}={keep}, or unset {variable} and choose the GPUs with ROCR_VISIBLE_DEVICES alone"
            )
    if value is None:
        return Visibility(None, None, None, tuple(warnings))
    ids = _parse_cuda_value(value, variable, warnings)
    if rocr_prefix is not None and ids and all(i.isdigit() for i in ids):
        # HIP indices count within the ROCR selection.
        beyond = [i for i in ids if int(i) >= len(rocr_prefix)]
        if beyond:
            # The two variables disagree: a wrong setting (exit 2), whatever the runtime then shows.
            within = [i for i in ids if int(i) < len(rocr_prefix)]
            keep = ",".join(within or (str(i) for i in range(len(rocr_prefix)))) or "''"
            raise DeviceError(
                f"{variable}={shown(value)} names GPU {', '.join(beyond)} but "
                f"ROCR_VISIBLE_DEVICES={shown(rocr)} leaves "
                f"only {len(rocr_prefix)} GPU(s) visible, which HIP numbers from 0: write {variable}={keep}, "
                f"or unset {variable} and choose the GPUs with ROCR_VISIBLE_DEVICES alone"
            )
        ids = tuple(rocr_prefix[int(i)] for i in ids)
    return Visibility(variable, value, ids, tuple(warnings))


def _parse_cuda_value(value: str, variable: str, warnings: list[str]) -> tuple[str, ...]:
    text = value.strip()
    if text != value:
        warnings.append(f"{variable}={shown(value)} has surrounding spaces; read as {shown(text)}")
    if text == "":
        warnings.append(f"{variable} is set but empty, which hides every GPU")
        return ()
    for prefix in ("GPU-", "MIG-"):
        if text.startswith(prefix):
            uuids: list[str] = []
            for entry in text.split(","):
                entry = entry.strip()
                if entry == prefix:
                    # The runtime matches a UUID by its prefix, and an empty one matches any GPU.
                    raise DeviceError(
                        f"{variable}={shown(value)}: {prefix!r} has no UUID after it; write the whole UUID as "
                        f"`nvidia-smi -L` prints it ({variable}={prefix}1f0e2d3c-...), or an index ({variable}=0)"
                    )
                if entry in uuids:
                    once = ",".join(dict.fromkeys(e.strip() for e in text.split(",")))
                    warnings.append(
                        f"{variable}={shown(value)} repeats {entry}; the runtime then shows no GPU at all: "
                        f"list each GPU once (write {variable}={once})"
                    )
                    return ()
                if not entry.startswith(prefix):
                    warnings.append(
                        f"{variable}={shown(value)}: the runtime stops reading at {shown(entry)}; list {prefix} UUIDs "
                        "only, or indices only"
                    )
                    break
                uuids.append(entry)
            return tuple(uuids)
    indices: list[str] = []
    for entry in text.split(","):
        number = _strtoul(entry.strip())
        if str(number) in indices:
            warnings.append(
                f"{variable}={shown(value)} repeats GPU {number}; the runtime then shows no GPU at all: "
                f"list each GPU once ({_fixed(variable, text)})"
            )
            return ()
        if number < 0:
            if entry.strip() == "-1" and not indices:
                warnings.append(f"{variable}=-1 hides every GPU")
            else:
                kept = ",".join(indices) or "none"
                warnings.append(
                    f"{variable}={shown(value)}: the runtime stops reading at {shown(entry)}, "
                    f"so the visible GPUs are: {kept}; {_fixed(variable, text)}"
                )
            break
        if entry.strip() != str(number):
            warnings.append(f"{variable}={shown(value)}: the runtime reads {shown(entry)} as {number}; write {number}")
        indices.append(str(number))
    return tuple(indices)


def _fixed(variable: str, text: str) -> str:
    """The fix for a misread list: its well-formed indices, each once (what was most likely meant)."""
    meant = _well_formed(text)
    if meant:
        return f"write {variable}={','.join(meant)}"
    return f"unset {variable} or list GPU indices such as {variable}=0,1"


def parse_index_list(value: str, variable: str) -> tuple[str, ...]:
    """A plain comma-separated list of non-negative device indices ("0,1,3")."""
    text = value.strip()
    if text == "":
        return ()
    out: list[str] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry.isdigit() or not entry.isascii():
            raise DeviceError(
                f"{variable}={shown(value)}: {shown(entry)} is not a device index; use comma-separated indices "
                f"such as {variable}=0,1: {_fix(variable, value, _well_formed(value))}"
            )
        index = str(_index(entry, variable, value))
        if index in out:
            raise DeviceError(
                f"{variable}={shown(value)} names device {entry} twice; list each device once: "
                f"{_fix(variable, value, _well_formed(value))}"
            )
        out.append(index)
    return tuple(out)


# Far more NeuronCores than one machine has (a trn2.48xlarge shows 128 logical cores).
_MAX_CORES = 4096


def parse_ranges(value: str, variable: str) -> tuple[str, ...]:
    """Indices and inclusive ranges, as NEURON_RT_VISIBLE_CORES takes them ("0-3", "0,2,4-5")."""
    out: list[str] = []
    seen: set[int] = set()
    for entry in value.strip().split(","):
        entry = entry.strip()
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", entry)
        if not match:
            raise DeviceError(
                f"{variable}={shown(value)}: {shown(entry)} is not a core index or range; "
                f"write e.g. {variable}=0-1 or {variable}=0,1, or unset {variable} to use every core"
            )
        lo = _index(match.group(1), variable, value)
        hi = _index(match.group(2), variable, value) if match.group(2) else lo
        if hi < lo:
            raise DeviceError(
                f"{variable}={shown(value)}: range {shown(entry)} runs backwards; write {hi}-{lo} (low-high)"
            )
        if len(seen) + hi - lo + 1 > _MAX_CORES:
            raise DeviceError(
                f"{variable}={shown(value)} names more than {_MAX_CORES} cores; no Neuron machine has that many: "
                f"name the cores this process should use, e.g. {variable}=0-1 (`neuron-ls` lists them), "
                f"or unset {variable} to use every core"
            )
        for i in range(lo, hi + 1):
            if i in seen:
                raise DeviceError(
                    f"{variable}={shown(value)} names core {i} twice; name each core once: "
                    f"write {variable}={_core_ranges(value)}"
                )
            seen.add(i)
            out.append(str(i))
    return tuple(out)


def _core_ranges(value: str) -> str:
    """``value``'s cores, each once, as the shortest list of ranges ("0-3,6")."""
    cores: set[int] = set()
    for entry in value.split(","):
        match = re.fullmatch(r"([0-9]{1,7})(?:-([0-9]{1,7}))?", entry.strip())
        if match:
            lo = int(match.group(1))
            hi = int(match.group(2) or lo)
            cores.update(range(lo, min(hi, lo + _MAX_CORES) + 1))
    out: list[str] = []
    for i in sorted(cores):
        if out and i - 1 in cores:
            start = out[-1].split("-")[0]
            out[-1] = f"{start}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def parse_ze_affinity_mask(value: str, variable: str = "ZE_AFFINITY_MASK") -> tuple[str, ...]:
    """Level Zero's mask: "0,1" (devices) or "0.0,0.1" (device.sub-device tiles)."""
    text = value.strip()
    if text == "":
        return ()
    out: list[str] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not re.fullmatch(r"\d+(\.\d+)?", entry) or not entry.isascii():
            raise DeviceError(
                f"{variable}={shown(value)}: {shown(entry)} is neither a device index nor device.tile; "
                f"write e.g. {variable}=0,1 or {variable}=0.0,0.1, or unset {variable} to see every device"
            )
        if entry in out:
            meant = _well_formed(value, r"\d+(\.\d+)?")
            raise DeviceError(
                f"{variable}={shown(value)} names {entry} twice; list each once: write {variable}={','.join(meant)}"
            )
        out.append(entry)
    return tuple(out)


def parse_habana(environ: Mapping[str, str] | None = None) -> Visibility:
    """HABANA_VISIBLE_MODULES (stable module ids) wins over HABANA_VISIBLE_DEVICES (indices)."""
    env = os.environ if environ is None else environ
    modules = env.get("HABANA_VISIBLE_MODULES")
    devices = env.get("HABANA_VISIBLE_DEVICES")
    warnings: list[str] = []
    if modules is not None:
        ids = parse_index_list(modules, "HABANA_VISIBLE_MODULES")
        if devices is not None and devices.strip().lower() != "all":
            other = parse_index_list(devices, "HABANA_VISIBLE_DEVICES")
            if len(other) != len(ids) or set(other) != set(ids):
                warnings.append(
                    f"HABANA_VISIBLE_MODULES={modules!r} and HABANA_VISIBLE_DEVICES={devices!r} "
                    "disagree; whichdevice follows HABANA_VISIBLE_MODULES (module ids are stable, "
                    "device indices may change): unset one of them"
                )
        return Visibility("HABANA_VISIBLE_MODULES", modules, ids, tuple(warnings))
    if devices is not None:
        if devices.strip().lower() == "all":
            return Visibility("HABANA_VISIBLE_DEVICES", devices, None, ())
        ids = parse_index_list(devices, "HABANA_VISIBLE_DEVICES")
        return Visibility("HABANA_VISIBLE_DEVICES", devices, ids, ())
    return Visibility()


def _single_variable(
    variable: str, parser: Callable[[str, str], tuple[str, ...]]
) -> Callable[[Mapping[str, str]], Visibility]:
    def parse(env: Mapping[str, str]) -> Visibility:
        value = env.get(variable)
        if value is None:
            return Visibility()
        ids = parser(value, variable)
        warnings = (f"{variable} is set but empty, which hides every device",) if not ids else ()
        return Visibility(variable, value, ids, warnings)

    return parse


# The visible-devices variables are the registry rows' ``visible_devices_env``; what is written
# here is how a runtime reads a value when it is not a plain list of indices.
_FORMATS: dict[str, Callable[[str, str], tuple[str, ...]]] = {
    "NEURON_RT_VISIBLE_CORES": parse_ranges,
    "ZE_AFFINITY_MASK": parse_ze_affinity_mask,
}


def visible_devices(
    backend: str, environ: Mapping[str, str] | None = None, *, variant: str | None = None
) -> Visibility:
    """The :class:`Visibility` for ``backend`` from ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    # Two runtimes read several variables with rules of their own: CUDA/ROCm (parse_cuda) and
    # Gaudi (parse_habana); every other row names one variable.
    if backend == "cuda":
        return parse_cuda(env, rocm=variant == "rocm")
    if backend == "hpu":
        return parse_habana(env)
    from whichdevice.hardware.registry import get_backend

    record = get_backend(backend)
    if record.visible_devices_env:
        variable = record.visible_devices_env[0]
        return _single_variable(variable, _FORMATS.get(variable, parse_index_list))(env)
    return Visibility()


# The builds of one row whose runtimes read its variables differently (the ROCm build of torch reads
# HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES, which the CUDA build ignores).
_BUILDS: dict[str, tuple[str | None, ...]] = {"cuda": (None, "rocm")}


def visibility_error(
    backend: str, environ: Mapping[str, str] | None = None, *, variant: str | None = None, reason: str | None = None
) -> DeviceError | None:
    """The error a malformed visible-devices setting gives ``backend``, or None when it parses.

    A probe that failed on such a setting no longer knows its build (``variant`` None): then each
    build's reading is tried and the error is the one ``reason`` (the failed probe's) quotes.
    """
    builds = (variant,) if variant is not None else _BUILDS.get(backend, (None,))
    for build in builds:
        try:
            visible_devices(backend, environ, variant=build)
        except DeviceError as exc:
            if variant is not None or reason is None or str(exc) in reason:
                return exc
    return None
