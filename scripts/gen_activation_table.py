"""Write src/whichdevice/memory/activation_table.json: training activations measured on real transformers classes.

    python scripts/gen_activation_table.py                 # every family (about an hour on 2 cores)
    python scripts/gen_activation_table.py --family llama  # one family, merged into the existing table

For each family (scripts/activation_probe.py's FAMILIES) and each way of training it (what is trained, the
weights' and the autocast dtype, the attention, checkpointing), one real training step is counted at eight
sizes (twelve for routed experts), one and two layers, and three lengths (scripts/activation_probe.py says
how). Per size, each quantity (what a layer keeps, what the rest keeps, the head's and the layers' backward
above what was kept) is fitted as ``a + b*T + c*T^2`` through the three lengths; across the sizes ``a``,
``b`` and ``c`` are fitted onto the widths of whichdevice.memory.activations.token_widths by least squares.
The largest relative residual of each fit is written beside it: the table says how well its own basis
explains what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dataclasses import dataclass  # noqa: E402

from activation_probe import FAMILIES, Family, Mode, Step, fit, measure_step, modes  # noqa: E402

from whichdevice.memory.activations import QUANTITIES, TABLE, kind_of, token_widths  # noqa: E402
from whichdevice.model.shape import shape_of_config  # noqa: E402

OUT = HERE.parent / "src" / "whichdevice" / "memory" / TABLE
TOKENS = (24, 40, 64)

_LAYER = ("hidden", "intermediate", "query", "key_value", "heads", "one", "routed", "routed_hidden", "experts", "state")
BASES: dict[str, dict[str, tuple[str, ...]]] = {
    "layer": {"per_token": _LAYER, "per_token_squared": ("heads",), "constant": ("layer_params", "one")},
    "rest": {
        "per_token": ("hidden", "vocab", "head_dim", "one"),
        "per_token_squared": ("one", "heads"),
        "constant": ("head_params", "one"),
    },
    # A peak's moment can hold anything of a layer or of the head: the union of both bases. The head's
    # widths first: a family with more per-token widths than measured sizes (routed experts) has some
    # columns left out by fit(), and the loss's peak must keep its vocabulary.
    "head": {
        "per_token": ("vocab", "head_dim", *_LAYER),
        "per_token_squared": ("heads", "one"),
        "constant": ("layer_params", "head_params", "largest_weight", "one"),
    },
    "layers": {
        "per_token": (*_LAYER, "vocab", "head_dim"),
        "per_token_squared": ("heads", "one"),
        "constant": ("layer_params", "head_params", "largest_weight", "one"),
    },
}
BASES["head_moments"] = BASES["head"]
BASES["layers_moments"] = BASES["layers"]


def size_widths(family: Family, size: dict[str, Any]) -> dict[str, float]:
    """token_widths of one size, with one layer's parameters and its largest weight from meta-device builds."""
    import torch
    import transformers

    built = []
    for layers in (1, 2):
        with torch.device("meta"):
            built.append(getattr(transformers, family.model_class)(family.config(size, layers, "eager")))
    one, two = ({n: p.numel() for n, p in m.named_parameters()} for m in built)
    layer_params = sum(two.values()) - sum(one.values())
    largest = max((n for name, n in two.items() if name not in one and len(name) and n), default=0)
    matrices = [p.numel() for name, p in built[1].named_parameters() if name not in one and p.dim() == 2]
    largest = max(matrices, default=largest)
    shape = shape_of_config(family.config(size, 1, "eager").to_dict())
    assert shape is not None, family.model_type
    return token_widths(shape, layer_params, largest)


def attentions_of(family: Family) -> tuple[str, ...]:
    import transformers

    cls = getattr(transformers, family.model_class)
    return ("sdpa", "eager") if getattr(cls, "_supports_sdpa", False) else ("eager",)


PARTS = ("constant", "per_token", "per_token_squared")


@dataclass(frozen=True)
class Point:
    """One size at one length: its widths, the length, and the steps at one and at two layers."""

    widths: dict[str, float]
    tokens: int
    one: Step
    two: Step

    @property
    def layer(self) -> float:
        return float(self.two.kept - self.one.kept)


def _row(widths: dict[str, float], tokens: int, basis: dict[str, tuple[str, ...]]) -> list[float]:
    scale = {"constant": 1, "per_token": tokens, "per_token_squared": tokens * tokens}
    return [widths[name] * scale[part] for part in PARTS for name in basis[part]]


def fit_points(rows: list[tuple[dict[str, float], int, float]], basis: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """``value ~ constant + per_token * T + per_token_squared * T^2``, each part a combination of widths,
    by least squares over (widths, T, value) rows; columns that repeat earlier ones are left out."""
    names = [(part, name) for part in PARTS for name in basis[part]]
    widened = [({f"{p}:{n}": w * _scale(p, t) for p, n in names for w in (widths[n],)}, v) for widths, t, v in rows]
    coefficients, _ = fit(widened, tuple(f"{p}:{n}" for p, n in names))
    fitted: dict[str, Any] = {part: {} for part in PARTS}
    for key, value in coefficients.items():
        part, name = key.split(":")
        if abs(value) > 1e-6:
            fitted[part][name] = round(value, 6)
    return fitted


def _scale(part: str, tokens: int) -> int:
    return {"constant": 1, "per_token": tokens, "per_token_squared": tokens * tokens}[part]


def predict(fitted: dict[str, Any], widths: dict[str, float], tokens: int) -> float:
    """A fitted quantity at ``widths`` and ``tokens``: a peak is the highest of its moments."""
    if "moments" in fitted:
        return max(predict(m, widths, tokens) for m in fitted["moments"])
    return sum(c * widths[name] * _scale(part, tokens) for part in PARTS for name, c in fitted.get(part, {}).items())


# Where an allocation is made a number of times that changes with the length (a loop per token: the CPU
# slow path of Mamba's scan), its first and last few are the same moment at every length (the loop's first
# steps, its last); the ones between are not, and are left out.
_LOOP_ENDS = 3


def _same_moments(found: list[Mapping[str, int]]) -> list[dict[str, int]]:
    """Each point's moments under keys that name the same moment of the step at every point: a moment is
    keyed ``operator@where#count`` (scripts/activation_probe.py); where a key's allocations are counted
    differently at different points, only the first and last ``_LOOP_ENDS`` stay, the last keyed from the end."""
    counts = [Counter(key.rpartition("#")[0] for key in moments) for moments in found]
    varying = {name for name in set().union(*counts) if len({c.get(name, 0) for c in counts}) > 1}
    named = []
    for moments, count in zip(found, counts, strict=True):
        kept: dict[str, int] = {}
        for key, value in moments.items():
            name, _, n = key.rpartition("#")
            if name not in varying:
                kept[key] = value
            elif int(n) < _LOOP_ENDS:
                kept[f"{name}#{n}"] = value
            elif count[name] - int(n) <= _LOOP_ENDS:
                kept[f"{name}#-{count[name] - int(n)}"] = value
        named.append(kept)
    return named


def _peak(
    points: list[Point], grid: list[tuple[dict[str, float], int]], phase: str, kept: Any, measured: Any
) -> dict[str, Any]:
    """A phase's peak above what is kept: each moment of the step (an allocation that happens at every size)
    fitted on its own, and the moments that are the highest somewhere (a measured point, or a real model's
    shape in ``grid``) kept. Where a measured peak was at a moment not every size has, the moments are
    raised by the bytes per token that reach it."""
    moments: dict[str, list[tuple[dict[str, float], int, float]]] = {}
    named = _same_moments([getattr(p.two, phase) for p in points])
    common = set.intersection(*(set(found) for found in named))
    for key in common:
        moments[key] = [(p.widths, p.tokens, found[key] - kept(p)) for p, found in zip(points, named, strict=True)]
    fitted = {key: fit_points(rows, BASES[phase]) for key, rows in moments.items()}
    chosen: set[str] = set()
    for widths, tokens in [(p.widths, p.tokens) for p in points] + grid:
        chosen.add(max(fitted, key=lambda k: predict(fitted[k], widths, tokens)))
    result: dict[str, Any] = {"moments": [fitted[k] for k in sorted(chosen)], "at": sorted(chosen)}
    gaps = [(measured(p) - predict(result, p.widths, p.tokens)) / p.tokens for p in points]
    if max(gaps) > 0:
        for moment in result["moments"]:
            moment["per_token"]["one"] = round(moment["per_token"].get("one", 0.0) + max(gaps), 6)
    result["error"] = round(
        max(abs(predict(result, p.widths, p.tokens) - measured(p)) / max(measured(p), 1.0) for p in points), 4
    )
    return result


def measure_mode(
    family: Family, mode: Mode, folders: dict[Any, str], grid: list[tuple[dict[str, float], int]]
) -> dict[str, Any]:
    """The four quantities of ``mode``, fitted across the family's sizes, each with ``error``: the largest
    relative difference between the fit and a measured point."""
    points = []
    for index, size in enumerate(family.sizes):
        widths = size_widths(family, size)
        for tokens in TOKENS:
            one = measure_step(family, size, 1, tokens, mode, folders.setdefault((index, 1), tempfile.mkdtemp()))
            two = measure_step(family, size, 2, tokens, mode, folders.setdefault((index, 2), tempfile.mkdtemp()))
            points.append(Point(widths, tokens, one, two))
    result: dict[str, Any] = {}
    for q, value in (("layer", lambda p: p.layer), ("rest", lambda p: p.one.kept - p.layer)):
        fitted = fit_points([(p.widths, p.tokens, value(p)) for p in points], BASES[q])
        fitted["error"] = round(
            max(abs(predict(fitted, p.widths, p.tokens) - value(p)) / max(abs(value(p)), 1.0) for p in points), 4
        )
        result[q] = fitted
    result["head"] = _peak(points, grid, "head_moments", lambda p: p.two.kept, lambda p: p.two.head_peak - p.two.kept)
    result["layers"] = _peak(
        points, grid, "layers_moments", lambda p: 2 * p.layer, lambda p: p.two.layers_peak - 2 * p.layer
    )
    result["head"]["phase"] = "head"
    return result


def real_shapes(family: Family) -> list[tuple[dict[str, float], int]]:
    """The family's config-class defaults (a real checkpoint's shape) at the lengths jobs train at."""
    widths = size_widths(family, {})
    return [(widths, tokens) for tokens in (128, 512, 2048, 8192)]


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"


def check_half(family: Family, folders: dict[Any, str], unmeasured: Mapping[str, str]) -> float:
    """The largest relative difference between fp16 and bf16 in what one size keeps (the table measures bf16
    for both): LoRA on a 16-bit base and QLoRA (where the family trains so), sdpa or eager, checkpointing off."""
    attention = attentions_of(family)[0]
    worst = 0.0
    for train, weights in (("lora", "float16"), ("qlora", "4bit")):
        if any(key.startswith(f"{train}/") for key in unmeasured):
            continue
        half = Mode(train, weights, "float16", attention, False)
        brain = Mode(train, "bfloat16" if weights == "float16" else weights, "bfloat16", attention, False)
        size = family.sizes[0]
        a = measure_step(family, size, 2, TOKENS[-1], half, folders.setdefault((0, 2), tempfile.mkdtemp()))
        b = measure_step(family, size, 2, TOKENS[-1], brain, folders.setdefault((0, 2), tempfile.mkdtemp()))
        for x, y in ((a.kept, b.kept), (a.head_peak, b.head_peak), (a.layers_peak, b.layers_peak)):
            worst = max(worst, abs(x - y) / max(y, 1))
    return worst


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "peft", "bitsandbytes")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="measure only these")
    parser.add_argument(
        "--kinds", action="store_true", help="only write each measured family's kind and what its measured path keeps"
    )
    parser.add_argument(
        "--one-attention",
        action="store_true",
        help="measure only the attention the class uses by default (sdpa where it has it): half the steps; "
        "the table then prices eager from the sdpa rows (memory/activations.py's closest measured mode)",
    )
    parser.add_argument(
        "--missing",
        action="store_true",
        help="keep the modes the table holds for the family and measure only those it lacks, in priority order",
    )
    args = parser.parse_args()
    if args.kinds:
        with _locked():  # a run measuring another family may write the file meanwhile
            table = json.loads(OUT.read_text())
            for name, entry in table["families"].items():
                family = FAMILIES[name]
                entry["sizes"] = len(family.sizes)
                entry["kind"] = kind_of(shape_of_config(family.config(family.sizes[0], 1, "eager").to_dict()))
                entry.pop("measured", None)
                if family.measured:
                    entry["measured"] = family.measured
            OUT.write_text(json.dumps(table, indent=1) + "\n")
        return
    table: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() and args.family else {"families": {}}
    for name in args.family or list(FAMILIES):
        family = FAMILIES[name]
        started = time.monotonic()
        folders: dict[Any, str] = {}
        entry = table["families"][name] = _entry(table, name, keep=args.missing)
        grid = real_shapes(family)
        measured = modes(attentions_of(family)[:1] if args.one_attention else attentions_of(family))
        done = {*entry["modes"], *entry.get("unmeasured", {})}
        for mode in sorted((m for m in measured if m.key not in done), key=_priority):
            try:
                entry["modes"][mode.key] = measure_mode(family, mode, folders, grid)
            except RuntimeError as error:  # the class does not train this way here: the table says why
                entry.setdefault("unmeasured", {})[mode.key] = _first_line(error)
                print(f"{name:12s} {mode.key:42s} not measured: {_first_line(error)}", flush=True)
                _write(table, name)
                continue
            errors = " ".join(f"{q} {entry['modes'][mode.key][q]['error']:.3f}" for q in QUANTITIES)
            print(f"{name:12s} {mode.key:42s} {errors}", flush=True)
            _write(table, name)  # each mode as it is done: a run stopped early keeps what it measured
        entry["float16_vs_bfloat16"] = round(check_half(family, folders, entry.get("unmeasured", {})), 4)
        print(f"{name}: {time.monotonic() - started:.0f} s, fp16 vs bf16 {entry['float16_vs_bfloat16']:.4f}")
        _write(table, name)


def _entry(table: dict[str, Any], name: str, *, keep: bool) -> dict[str, Any]:
    """The family's entry to measure into: a new one, or with ``keep`` (``--missing``) the one the table
    holds, whose modes are then not measured again (its sizes must be the probe's: one fit per family)."""
    family, held = FAMILIES[name], table["families"].get(name)
    if keep and held is not None:
        if held.get("sizes") != len(family.sizes):
            raise SystemExit(f"{name}: the table measured {held.get('sizes')} sizes and the probe has "
                             f"{len(family.sizes)}: measure it anew, without --missing")  # fmt: skip
        return dict(held)
    kind = kind_of(shape_of_config(family.config(family.sizes[0], 1, "eager").to_dict()))
    entry: dict[str, Any] = {"kind": kind, "sizes": len(family.sizes), "modes": {}}
    if family.measured:
        entry["measured"] = family.measured
    return entry


# The modes jobs are priced in most, first (a run stopped early has them): mixed precision on a GPU, LoRA
# on a 16-bit base, fp32 on a CPU, QLoRA; each without then with checkpointing.
_ORDER = ("full/float32/bfloat16", "lora/bfloat16/bfloat16", "full/float32/none", "qlora/4bit/bfloat16",
          "lora/float32/none", "full/bfloat16/none", "qlora/4bit/none")  # fmt: skip


def _priority(mode: Mode) -> tuple[int, bool]:
    training = "/".join(mode.key.split("/")[:3])
    return (_ORDER.index(training) if training in _ORDER else len(_ORDER), mode.checkpointing)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The table's file to this process alone: runs for different families (``--family``) measure side by
    side, and each writes under this lock."""
    import fcntl

    with open(Path(tempfile.gettempdir()) / "whichdevice-activation-table.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write(table: dict[str, Any], measured: str) -> None:
    """Write the family measured here over what the file holds now: runs for different families
    (``--family``) can measure side by side without one writing over the other."""
    with _locked():
        if OUT.exists():
            table["families"] = {**json.loads(OUT.read_text())["families"], measured: table["families"][measured]}
        _write_locked(table)


def _write_locked(table: dict[str, Any]) -> None:
    table["generated"] = {
        "script": "scripts/gen_activation_table.py",
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "tokens": list(TOKENS),
    }
    table["families"] = dict(sorted(table["families"].items()))
    OUT.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
