"""The hardware check: what whichdevice finds and does on a real machine, in one run of a few minutes.

    python benchmarks/hardware_check.py                      # derive the spec from the real probe
    python benchmarks/hardware_check.py --spec "cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200"
    python benchmarks/hardware_check.py --out results/       # where the JSON and the summary go

Sections, each ok / failed / skipped (with the reason) / differs:
  probe         the real probe of every backend, field by field
  resolution    resolve_device() for inference and training, with the trace
  smoke         a tiny Llama (built from a config, never the Hub) loaded with model_kwargs(),
                generating, and 3 Trainer steps with training_arguments() at the resolved precision
  flash         each installed FlashAttention package: load with it, generate
  bnb4          bitsandbytes 4-bit: load the tiny model quantized, generate
  simulation    the real report against the report of simulate(spec) for the same machine,
                field by field: where the simulation's idea of this hardware differs from reality
                (the CPU's calibration compared as the spec carries it: 4 digits, named simulated)
It writes hardware_check.json and hardware_check.txt (the summary, also printed). Exit 0 when no
section failed or differs, else 1. Nothing reaches the network (HF_HUB_OFFLINE=1 for the run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# harness sits beside this file; appended, not prepended: loaded by path (tests/test_hardware_check.py),
# this folder must not shadow any module of the process that loads it.
sys.path.append(str(Path(__file__).resolve().parent))

import harness

import whichdevice as wd
from whichdevice.attention.flash import FLASH, flash_attention_package
from whichdevice.core.errors import DeviceError
from whichdevice.core.packages import known_versions, package_version
from whichdevice.report import gather
from whichdevice.smoke import run_smoke, tiny_llama_config
from whichdevice.testing import simulate
from whichdevice.testing.replay import comparable, differences
from whichdevice.testing.spec import family

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
NEW_TOKENS = 8


class SkippedError(Exception):
    """A section that cannot run here; the message says why."""


class DiffersError(Exception):
    """The simulation disagrees with the real machine; the message lists where."""


# ------------------------------------------------------------------------------------- sections


def check_probe(state: dict[str, Any]) -> tuple[str, Any]:
    results = wd.probe_all()
    state["results"] = results
    lines = []
    for r in results:
        if not r.installed:
            continue
        fields = r.to_dict()
        lines.append(f"{r.backend}:")
        lines += [f"    {key} = {value!r}" for key, value in fields.items() if key != "backend"]
    missing = [r.backend for r in results if not r.installed]
    lines.append(f"not installed: {', '.join(missing) or 'none'}")
    return "\n".join(lines), {r.backend: r.to_dict() for r in results}


def check_resolution(state: dict[str, Any]) -> tuple[str, Any]:
    data: dict[str, Any] = {}
    lines: list[str] = []
    for task in ("inference", "training"):
        res = state[task] = wd.resolve_device(task=task)
        data[task] = {"resolution": res.to_dict(), "explanation": res.explain()}
        lines.append(
            f"{task}: {res.device}, {res.dtype_name}, attention {res.attn_implementation or 'left to transformers'}"
        )
    return "\n".join(lines), data


def check_smoke(state: dict[str, Any]) -> tuple[str, Any]:
    result = run_smoke(progress_stream=sys.stderr)
    if not result["ok"]:
        raise RuntimeError(f"smoke failed: {result['error']['message']}")
    lines = []
    for task in ("inference", "training"):
        part = result[task] or {}
        lines.append(f"{task}: " + ", ".join(f"{k} {v}" for k, v in part.items()))
    return "\n".join(lines), result


def _tiny_model(state: dict[str, Any]) -> Path:
    if "model_path" not in state:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        folder = Path(state["tmp"]) / "tiny"
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
        state["model_path"] = folder
    path: Path = state["model_path"]
    return path


def _generate(model: Any) -> int:
    import torch

    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(1)).to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return int(out.shape[1] - ids.shape[1])


def check_flash(state: dict[str, Any]) -> tuple[str, Any]:
    from transformers import AutoModelForCausalLM

    installed = {impl: flash_attention_package(impl) for impl in FLASH}
    if not any(installed.values()):
        raise SkippedError(f"no FlashAttention package is installed ({', '.join(p for _, p, _ in FLASH.values())})")
    lines: list[str] = []
    data: dict[str, Any] = {}
    for impl, version in installed.items():
        if version is None:
            continue
        try:
            res = wd.resolve_device(model=_tiny_model(state), attn_implementation=impl)
        except DeviceError as exc:
            lines.append(f"{impl} ({version}): not for this hardware: {exc}")
            data[impl] = {"version": version, "refused": str(exc)}
            continue
        model = AutoModelForCausalLM.from_pretrained(state["model_path"], **res.model_kwargs())
        used = model.config._attn_implementation
        if used != impl:
            raise RuntimeError(f"{impl}: model_kwargs() loaded the model with {used!r}")
        tokens = _generate(model)
        lines.append(f"{impl} ({version}): {res.device}, {res.dtype_name}, generated {tokens} tokens")
        data[impl] = {"version": version, "device": res.device, "dtype": res.dtype_name, "new_tokens": tokens}
    return "\n".join(lines), data


def check_bnb4(state: dict[str, Any]) -> tuple[str, Any]:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    version = package_version("bitsandbytes")
    if version is None:
        raise SkippedError("bitsandbytes is not installed (pip install bitsandbytes)")
    res = state.get("inference") or wd.resolve_device()
    if not res.backend.bitsandbytes:
        raise SkippedError(f"bitsandbytes has no build for {res.backend.name}")
    settings = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": res.dtype}
    config = BitsAndBytesConfig(**settings)  # type: ignore[no-untyped-call]
    kwargs = {**res.model_kwargs(), "quantization_config": config}
    model = AutoModelForCausalLM.from_pretrained(_tiny_model(state), **kwargs)
    quantized = [type(m).__name__ for m in model.modules() if type(m).__name__ == "Linear4bit"]
    if not quantized:
        raise RuntimeError("the model loaded without any Linear4bit layer")
    tokens = _generate(model)
    line = f"bitsandbytes {version}: {len(quantized)} Linear4bit layers on {model.device}, generated {tokens} tokens"
    return line, {"version": version, "linear4bit": len(quantized), "device": str(model.device), "new_tokens": tokens}


def spec_for(result: wd.ProbeResult) -> str | None:
    """The simulate() spec that should describe what a real probe found (None: nothing available)."""
    if not result.available or not result.devices:
        return None
    kind = family(result.backend)
    first = result.devices[0]
    parts = [result.backend if kind == "mps" else f"{result.backend}:{result.device_count}"]
    if first.name and "," not in first.name and ";" not in first.name:
        parts.append(f"name={first.name}")
    if first.total_memory:
        parts.append(f"mem={first.total_memory}")
    if kind == "cuda" and first.capability:
        parts.append(f"cc={first.capability[0]}.{first.capability[1]}")
    if kind == "cuda" and result.variant == "rocm":
        parts.append("variant=rocm")
    if kind == "mps" and result.os_version:
        parts.append(f"macos={result.os_version}")
    if kind in ("xpu", "module") and first.bf16 is not None:
        parts.append(f"bf16={'yes' if first.bf16 else 'no'}")
    if kind == "cpu":
        parts.append(f"flags={'+'.join(sorted(result.features))}")
        # The real probe honours the shell's oneDNN cap; a simulated CPU takes it from its spec.
        from whichdevice.hardware.probes.cpu import ONEDNN_ISA_VARIABLE

        if not result.simulated and os.environ.get(ONEDNN_ISA_VARIABLE, "").strip():
            parts.append(f"isa={os.environ[ONEDNN_ISA_VARIABLE].strip().upper()}")
        parts += _calibration_keys()
    if kind == "cuda" and result.variant != "rocm":
        parts += _build_keys(result)
    frees = [d.free_memory for d in result.devices]
    if all(f is not None for f in frees):
        parts.append("free=" + "/".join(str(f) for f in frees))
    if kind == "cuda" and result.variant != "rocm":
        parts += _nvml_keys(result)
    return ",".join(parts)


def _nvml_keys(result: wd.ProbeResult) -> list[str]:
    """compute= and held= as NVML read them: each GPU's mode, and a holder where other processes are
    (a simulated holder is one process, holding what is not free)."""
    keys = []
    modes = [d.compute_mode for d in result.devices]
    if all(modes):
        keys.append("compute=" + "/".join(str(m) for m in modes))
    others = [d.other_processes for d in result.devices]
    if all(o is not None for o in others):
        held = [
            (d.total_memory or 0) - (d.free_memory or 0) if d.free_memory is not None and o else 0
            for d, o in zip(result.devices, others, strict=True)
        ]
        keys.append("held=" + "/".join(str(h) for h in held))
    return keys


def _calibration_keys() -> list[str]:
    """calib= with the figures this machine's resolutions use (none when calibration is off or pending)."""
    from whichdevice.measure.calibration import calibration

    calib, _ = calibration(measure=False)
    return [f"calib={calib.spec()}"] if calib is not None else []


def _build_keys(result: wd.ProbeResult) -> list[str]:
    """driver=, cuda= and arch= for the compatibility checks, as far as the probe read them."""
    keys = []
    for key, version in (("driver", "nvidia-driver"), ("cuda", "cuda")):
        value = result.versions.get(version) or ""
        if value[:1].isdigit():  # a simulation without the key says "simulated"
            keys.append(f"{key}={value}")
    arch = sorted(f for f in result.features if f.startswith(("sm_", "compute_")))
    if arch:
        keys.append("arch=" + "+".join(arch))
    return keys


@contextlib.contextmanager
def _calibration_carried(answer: tuple[Any, str]) -> Iterator[None]:
    """This machine, with its CPU's calibration answered as the simulated copy carries it.

    A spec keeps a calibration's figures to 4 significant digits (``Calibration.spec``), names their source
    "simulated figures (calib= in the spec)" and carries no thread count or load; on a busy CPU, whose
    calibration was unsteady, it carries none. The real report is gathered with that same answer, so the
    comparison is of what a reproduction can carry: the probes and every decision made from them. The
    memoised resolutions of this machine are set aside meanwhile, and both are restored after.
    """
    from whichdevice.hardware.store import current_store
    from whichdevice.measure.calibration import pin, unpin

    store = current_store()
    kept = dict(store.resolutions)
    store.resolutions.clear()
    pin(store, *answer)
    try:
        yield
    finally:
        unpin(store)
        store.resolutions.clear()
        store.resolutions.update(kept)


def check_simulation(state: dict[str, Any]) -> tuple[str, Any]:
    from whichdevice.measure.calibration import calibration

    specs = state["spec"] or [s for s in map(spec_for, state["results"]) if s]
    with simulate(*specs, others="real", packages=known_versions()):
        simulated = gather()
        carried = calibration(measure=False)  # the simulated CPU's answer: the figures its spec carries, or none
    with _calibration_carried(carried):
        real = json.loads(json.dumps(gather()))
    found = list(differences(comparable(real), comparable(simulated)))
    # The report replayed (--simulate-report) must give the same answers as the machine itself.
    replay_found = list(differences(comparable(real), comparable(gather(simulate_report=real))))
    data = {"specs": specs, "differences": found, "replay_differences": replay_found, "report": real}
    state["simulation_data"] = data
    named = f"simulate({', '.join(map(repr, specs))})"
    lines = [f"{named} " + ("differs from this machine in:" if found else "matches this machine field by field")]
    lines.append(f"  (this CPU's calibration compared as the spec carries it: {carried[1]})")
    lines += [f"  {line}" for line in found]
    lines.append(
        "the real report replayed: " + ("differs in:" if replay_found else "the same resolution, trace and warnings")
    )
    lines += [f"  {line}" for line in replay_found]
    if found or replay_found:
        raise DiffersError("\n".join(lines))
    return "\n".join(lines), data


SECTIONS: tuple[tuple[str, Callable[[dict[str, Any]], tuple[str, Any]]], ...] = (
    ("probe", check_probe),
    ("resolution", check_resolution),
    ("smoke", check_smoke),
    ("flash", check_flash),
    ("bnb4", check_bnb4),
    ("simulation", check_simulation),
)


# ----------------------------------------------------------------------------------------- run


@contextlib.contextmanager
def offline() -> Iterator[None]:
    before = {name: os.environ.get(name) for name in OFFLINE}
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, old in before.items():
            if old is None:
                os.environ.pop(name, None)


def run_section(
    name: str, function: Callable[[dict[str, Any]], tuple[str, Any]], state: dict[str, Any]
) -> dict[str, Any]:
    print(f"[hardware check] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": name}
    try:
        summary, data = function(state)
        entry.update(status="ok", summary=summary, data=data)
    except SkippedError as exc:
        entry.update(status="skipped", summary=str(exc), data=None)
    except DiffersError as exc:
        entry.update(status="differs", summary=str(exc), data=state.pop("simulation_data", None))
    except Exception as exc:
        entry.update(
            status="failed", summary=f"{type(exc).__name__}: {exc}", data=None, traceback=traceback.format_exc()
        )
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def machine() -> dict[str, Any]:
    described = harness.machine()
    described["versions"]["bitsandbytes"] = package_version("bitsandbytes")
    return described


def render(result: dict[str, Any]) -> str:
    lines = [
        f"whichdevice hardware check: {result['verdict']} in {result['seconds']:.1f} s",
        harness.machine_line(result["machine"]) + f"; bitsandbytes {result['machine']['versions']['bitsandbytes']}",
    ]
    for entry in result["sections"]:
        lines.append(f"\n== {entry['name']}: {entry['status'].upper()} ({entry['seconds']:.1f} s)")
        lines += ["   " + line for line in str(entry["summary"]).splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", action="append", default=[], help="the simulate() spec of this machine (repeatable)")
    parser.add_argument("--out", default=".", help="folder for hardware_check.json and hardware_check.txt")
    parser.add_argument("--only", action="append", choices=[n for n, _ in SECTIONS], help="run only these sections")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sections = []
    with offline(), tempfile.TemporaryDirectory(prefix="whichdevice-hwcheck-") as tmp:
        state: dict[str, Any] = {"tmp": tmp, "spec": args.spec}
        for name, function in SECTIONS:
            if args.only and name not in args.only and name != "probe":
                continue
            sections.append(run_section(name, function, state))
    bad = [s["name"] for s in sections if s["status"] in ("failed", "differs")]
    result = {
        "kind": "hardware_check",
        "verdict": f"{len(bad)} section(s) not ok: {', '.join(bad)}" if bad else "all sections ok or skipped",
        "seconds": round(time.perf_counter() - start, 1),
        "machine": machine(),
        "sections": sections,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hardware_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    text = render(result)
    (out / "hardware_check.txt").write_text(text, encoding="utf-8")
    print(text, end="")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
