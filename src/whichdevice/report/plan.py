"""Which hardware a job needs: the real resolver run under each machine of a list, turned into a table.

``plan_hardware(model, task=..., batch_size=..., max_length=...)`` reads the model once (a local
folder, a config, or a Hub id from its metadata: whichdevice.model.hub) and, for each machine (a
``simulate()`` spec; "this machine" unsimulated), resolves the job on 1 device, then on 2, 4 and 8
until it runs unquantized (inference) or with full fine-tuning (training). Each row is resolve_device
on that machine with the caller's job and its defaults (quantize="auto" included), so a row fits and
quantizes exactly where resolve_device does (tests/report/test_plan.py compares them). Each row says whether
it fits, the dtype and quantization, the strategy and the keywords it hands over, the longest
``max_length`` at the batch and the largest batch at the length (memory/largest.py), and the decode
speed limit at batch 1: the devices' memory bandwidth over the bytes a token reads
(memory/bandwidth.py). Where a model needs several devices for inference, the device_map split the
resolver hands over is compared with tensor parallelism (memory/tensor_parallel.py) and the faster
one that fits is chosen. No rule is written here: every figure is the resolver's or memory/'s.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import asdict, field
from typing import Any

from whichdevice.core.errors import DeviceError, DoesNotFitError, printable
from whichdevice.core.frozen import NamedTuple, frozen_record
from whichdevice.device.request import as_task

__all__ = ["DEFAULT_MACHINES", "HardwarePlan", "PlanRow", "plan_hardware"]

# name -> simulate() spec of one device; "" is this machine, as probed.
DEFAULT_MACHINES: tuple[tuple[str, str], ...] = (
    ("T4", "cuda:1,name=Tesla T4"),
    ("L4", "cuda:1,name=NVIDIA L4"),
    ("A10G", "cuda:1,name=NVIDIA A10G"),
    ("RTX 4090", "cuda:1,name=NVIDIA GeForce RTX 4090"),
    ("A100 40GB", "cuda:1,name=NVIDIA A100-SXM4-40GB"),
    ("A100 80GB", "cuda:1,name=NVIDIA A100-SXM4-80GB"),
    ("H100", "cuda:1,name=NVIDIA H100 80GB HBM3"),
    ("H200", "cuda:1,name=NVIDIA H200"),
    ("MI300X", "cuda:1,variant=rocm,name=AMD Instinct MI300X"),
    ("Gaudi 2", "hpu:1,gen=gaudi2,mem=96GiB"),
    ("Gaudi 3", "hpu:1,gen=gaudi3,name=GAUDI3,mem=128GiB"),
    ("TPU v5e", "tpu:1,name=TPU v5e,mem=16GiB"),
    ("Trainium 1", "neuron:1,name=Trainium1,mem=32GiB"),
    ("Trainium 2", "neuron:1,name=Trainium2,mem=96GiB"),
    ("Apple M3 Max 64GB", "mps,name=Apple M3 Max,mem=64GiB"),
    ("this machine", ""),
)
COUNTS = (1, 2, 4, 8)


@frozen_record
class PlanRow:
    """One machine with ``devices`` devices: what the resolver answered, or why nothing fits."""

    machine: str
    spec: str
    devices: int
    fits: bool
    device_name: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    strategy: str | None = None
    keywords: dict[str, str] = field(default_factory=dict)
    launch: str | None = None
    longest: int | None = None
    largest_batch: int | None = None
    tokens_per_s: float | None = None
    bandwidth_source: str | None = None
    note: str | None = None


@frozen_record
class HardwarePlan:
    """The rows for every machine, and how the model was read (``fetched``: the Hub metadata's story)."""

    model: str
    task: str
    batch_size: int
    max_length: int
    rows: tuple[PlanRow, ...]
    fetched: str | None = None
    # What holds on every machine: a max_length beyond the model's context (model/context.py).
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "plan",
            "model": self.model,
            "task": self.task,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "fetched": self.fetched,
            "warnings": list(self.warnings),
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        """The rows as a Markdown table (what ``whichdevice plan`` prints)."""
        head = (
            f"| machine | devices | fits | dtype | strategy | longest at batch {self.batch_size} | "
            f"batch at {self.max_length} | decode tok/s limit |"
        )
        lines = [head, "|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            dtype = (r.dtype or "-") + (f" + {r.quantization}" if r.quantization else "")
            fits = "yes" if r.fits else "no"
            strategy = r.strategy if r.fits else (r.note or "-")
            speed = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
            cells = [r.machine, str(r.devices), fits, dtype if r.fits else "-", strategy]
            cells += [_count(r.longest), _count(r.largest_batch), speed]
            lines.append("| " + " | ".join(printable(c or "-").replace("|", "/") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def plan_hardware(
    model: Any,
    *,
    task: str = "inference",
    batch_size: int = 1,
    max_length: int = 4096,
    machines: Sequence[str | tuple[str, str]] | None = None,
    revision: str | None = None,
    gradient_checkpointing: bool | None = None,
) -> HardwarePlan:
    """Which of ``machines`` (simulate() specs, or (name, spec) pairs; default DEFAULT_MACHINES) run
    ``task`` on ``model`` at ``batch_size`` x ``max_length``, and how: see the module docstring.
    ``gradient_checkpointing`` (training): None decides per machine, as resolve_device does."""
    from whichdevice.model.facts import read_model_facts
    from whichdevice.resolve.arguments import check_checkpointing, check_count

    for value, name in ((batch_size, "batch_size"), (max_length, "max_length")):
        check_count(value, name)
    check_checkpointing(gradient_checkpointing)
    if task not in ("inference", "training"):
        raise DeviceError(f"task={task!r}: use 'inference' or 'training'")
    facts = read_model_facts(model, revision=revision)
    listed = [_named(m) for m in (machines if machines is not None else DEFAULT_MACHINES)]
    rows: list[PlanRow] = []
    job = _Job(task, batch_size, max_length, gradient_checkpointing)
    for name, spec in listed:
        rows += _machine_rows(facts, name, spec, job)
    fetched = facts.hub.describe() if facts.hub is not None else None
    from whichdevice.model.context import context_steps

    context = facts.shape.context if facts.shape is not None else None
    warnings = tuple(s.message for s in context_steps(context, max_length))
    return HardwarePlan(str(model), task, batch_size, max_length, tuple(rows), fetched, warnings)


def _named(machine: str | tuple[str, str]) -> tuple[str, str]:
    if isinstance(machine, tuple):
        return machine
    if not isinstance(machine, str):
        raise DeviceError(f"machines: give simulate() specs such as 'cuda:1,name=NVIDIA L4', not {machine!r}")
    found = re.search(r"name=([^,]+)", machine)
    return (found.group(1).strip() if found else machine.split(",")[0]), machine


def _with_count(spec: str, count: int) -> str:
    head, comma, rest = spec.partition(",")
    return f"{head.split(':')[0]}:{count}{comma}{rest}"


def _counts(spec: str) -> tuple[int, ...]:
    """Given counts ("cuda:4") stand; a one-device spec is tried at 1, 2, 4 and 8 (not a Mac or the CPU)."""
    head = spec.partition(",")[0]
    # One process drives one TPU or Trainium device (torch_xla's and neuronx's own sharding is not
    # from_pretrained's), and a Mac or the CPU is one device: those are planned on one.
    if not spec or head.startswith(("mps", "cpu", "tpu", "neuron")):
        return (1,)
    count = head.partition(":")[2]
    return (int(count),) if count.isdigit() and int(count) != 1 else COUNTS


@contextlib.contextmanager
def _machine(spec: str) -> Iterator[None]:
    if not spec:
        yield
        return
    from whichdevice.testing import simulate

    with simulate(spec):
        yield


class _Job(NamedTuple):
    task: str
    batch: int
    length: int
    checkpointing: bool | None


def _machine_rows(facts: Any, name: str, spec: str, job: _Job) -> list[PlanRow]:
    rows = []
    for count in _counts(spec):
        one = _with_count(spec, count) if spec else spec
        # Each row is resolve_device's own answer on that machine (its default quantize="auto" included,
        # so a row quantizes where resolve_device would); more devices are tried until one runs unquantized.
        row = _row(facts, name, one, count, job)
        rows.append(row)
        if row.fits and row.quantization is None and (job.task == "inference" or "LoRA" not in (row.strategy or "")):
            break
    return rows


def _row(facts: Any, name: str, spec: str, count: int, job: _Job) -> PlanRow:
    import whichdevice as wd

    task, batch, length = job.task, job.batch, job.length
    with _machine(spec):
        try:
            res = wd.resolve_device(
                model=facts, task=as_task(task), batch_size=batch, max_length=length,
                gradient_checkpointing=job.checkpointing if task == "training" else None,
            )  # fmt: skip
        except DoesNotFitError as error:
            return PlanRow(name, spec, count, False, note=_short(str(error)))
        except DeviceError as error:
            return PlanRow(name, spec, count, False, note=f"cannot run: {_short(str(error))}")
        device = res.probe.devices[0].name if res.probe.devices else None
        devices = max(1, res.device_count if spec else 1)
        return _answer(facts, res, PlanRow(name, spec, devices, True, device_name=device), task, batch, length)


def _answer(facts: Any, res: Any, row: PlanRow, task: str, batch: int, length: int) -> PlanRow:
    from whichdevice.memory.bandwidth import bandwidth_of, bytes_per_token
    from whichdevice.memory.job import kv_cache_bytes, state_cache_bytes

    quant = res.quantization.method if res.quantization is not None else None
    if quant is None and facts.quantization is not None:
        quant = f"{facts.quantization.method} (the checkpoint's)"
    dtype = res.dtype_name or "float32"
    size = facts.size
    weights = size.bytes_quantized(res.quantization.bits, dtype) if res.quantization else size.bytes_in(dtype)
    strategy, keywords, launch, parallel = _strategy(facts, res, row.devices, task, batch, length, weights)
    # The limits are searched for the way placement chose (memory/largest.py), none for an inference
    # job's quantized load.
    limits = res.fit_limits if res.quantization is None or task == "training" else None
    speed = source = None
    row_bandwidth = bandwidth_of(row.device_name) if row.spec else _cpu_bandwidth()
    if task == "inference" and row_bandwidth is not None:
        read, _ = bytes_per_token([t for _, t in facts.headers], facts.config, weights)
        shape = facts.shape
        # Each decode step reads the KV cache, or a state-space model's states (the same at any length).
        kv = kv_cache_bytes(shape, length, 1, dtype) + state_cache_bytes(shape, 1, dtype) if shape is not None else 0
        speed = parallel * row_bandwidth.gb_per_s * 1e9 / max(1, read + kv)
        source = row_bandwidth.source
    return PlanRow(
        row.machine, row.spec, row.devices, True, row.device_name, dtype, quant, strategy, keywords, launch,
        limits.longest if limits else None, limits.largest_batch if limits else None, speed, source,
    )  # fmt: skip


def _strategy(
    facts: Any, res: Any, devices: int, task: str, batch: int, length: int, weights: int
) -> tuple[str, dict[str, str], str | None, int]:
    """(strategy in words, keywords, launch command, devices reading at once) for this answer."""
    kwargs = {k: _shown(v) for k, v in res.model_kwargs().items() if k != "revision"}
    plan = res.training_plan
    if task == "training":
        chosen = plan.chosen if plan is not None else None
        setup = res.training_setup
        name = chosen.name if chosen is not None else setup.describe() if setup is not None else "one device"
        if chosen is not None and setup is not None and setup.checkpointing:
            name += ", gradient checkpointing"
        launch = _launch(res, devices) if chosen is not None and devices > 1 else None
        return name, {**kwargs, **{k: _shown(v) for k, v in res.training_kwargs().items()}}, launch, 1
    split = isinstance(res.device_map, dict) or res.device_map in ("auto", "balanced", "balanced_low_0", "sequential")
    if not split or devices < 2:
        return "one device", kwargs, None, 1
    if res.quantization is not None:
        # The keywords are resolve_device's (quantization_config with its device_map); tensor parallelism is
        # priced for unquantized weights only (memory/tensor_parallel.py), so a 4-bit split is not compared.
        return f"device_map split over {devices}, one device at a time, in {res.quantization.bits}-bit", kwargs, None, 1
    option = _tensor_parallel(facts, res, devices, batch, length, weights)
    if option is not None and option.fits:
        from whichdevice.memory.tensor_parallel import tp_keywords_text

        tp = tp_keywords_text()
        dtype = {k: v for k, v in kwargs.items() if k in ("dtype", "torch_dtype", "attn_implementation")}
        return f"tensor parallel over {devices}", {**dtype, **tp}, _launch(res, devices), devices
    why = f" (tensor parallel: {option.unavailable or 'does not fit'})" if option is not None else ""
    return f"device_map split over {devices}, one device at a time{why}", kwargs, None, 1


def _tensor_parallel(facts: Any, res: Any, devices: int, batch: int, length: int, weights: int) -> Any:
    from whichdevice.memory.fit import FIT_FRACTION
    from whichdevice.memory.job import job_memory
    from whichdevice.memory.tensor_parallel import tensor_parallel

    memory = job_memory(facts.shape, res.dtype_name or "float32", batch, length)
    kv = sum(t.bytes for t in memory.terms if t.name == "KV cache")
    caps = [d.free_memory or d.total_memory for d in res.probe.devices if (d.free_memory or d.total_memory)]
    if not caps:
        return None
    budget = int(min(caps) * FIT_FRACTION)
    return tensor_parallel(facts.config, devices, weights, kv, memory.bytes - kv, budget)


def _launch(res: Any, devices: int) -> str:
    return " ".join(shlex.quote(a) for a in res.launch_command(["your_script.py"], nproc=devices))


def _cpu_bandwidth() -> Any:
    """This CPU's measured read bandwidth, as a table row, where the calibration measured it."""
    from whichdevice.measure.calibration import calibration
    from whichdevice.memory.bandwidth import Bandwidth

    calib, _ = calibration(measure=False)
    gbps = calib.memory.get("read") if calib is not None else None
    return Bandwidth("", float(gbps), "this CPU's read bandwidth, measured by the calibration") if gbps else None


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _short(message: str) -> str:
    """The first reason a DoesNotFitError gives (the trace of that machine's resolution has the rest)."""
    first = message.split(": ", 1)[-1] if message.startswith("The model does not fit") else message
    return first.split(";")[0][:160]
