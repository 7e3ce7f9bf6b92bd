"""The benchmarks' shared pieces: the machine named once, alternated rounds, medians and ratios, tiny models, JSON.

- ``machine()`` / ``machine_line()``: the CPU (model, cores, the flags that decide its dtype: avx512_bf16,
  AMX), memory, load average, Python, torch / transformers / accelerate / whichdevice, torch's threads,
  the git commit. Every script prints the line first and stores the record in its JSON.
- ``run_once`` / ``alternate_commands``: whole processes (``Popen`` reaped by ``os.wait4``: wall time, CPU
  time and that one child's peak RSS) in a clean environment; ``alternate``: in-process callables. Both
  run forward in even rounds and reversed in odd ones, so a baseline and what is measured against it
  are neighbours in time in every round and other work on the machine moves both sides alike.
- ``summary`` / ``pairwise``: medians with the 25th..75th percentiles as the noise; the median of the
  per-round ratios (not the ratio of the medians).
- ``build_model`` / ``save_model``: a model from a config (random weights, fixed seed), saved with
  ``save_pretrained``: a user's checkpoint's reading path. ``generate``: one greedy job, timed.
- ``table``, ``add_json_argument`` (``--json PATH``) and ``write_json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"  # git-ignored: a run's own output; committed results live in results-NN/

# The CPU flags that decide a CPU's dtype and kernels (native bf16, AMX, fp16 arithmetic).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "bf16", "fphp")


def log(msg: str) -> None:
    """Progress, on stderr: stdout holds only what the script reports."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- the machine


def cpu_info() -> dict[str, Any]:
    model, flags, memory = platform.processor() or None, set(), None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
        for key, _, value in (line.partition(":") for line in fh):
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": os.cpu_count(), "usable_cores": usable, "flags": {f: f in flags for f in FLAGS},
            "memory_gib": round(memory / 2**30, 1) if memory else None}  # fmt: skip


def git(*args: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True).stdout
    return None


def version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist)
    return None


def machine(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything that moves a figure from one machine or checkout to another."""
    # torch's threads as a fresh process of this environment gets them: the measured children's
    threads = run_once(python("import torch; print(torch.get_num_threads())"), env or clean_env()[0], str(ROOT), True)
    status = git("status", "--porcelain", "--", "src")
    return {
        "cpu": cpu_info(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": {d: version(d) for d in ("torch", "transformers", "accelerate", "whichdevice")},
        "torch_threads": int(threads.stdout) if threads.returncode == 0 else None,
        "torch_thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "git": {
            "commit": (git("rev-parse", "--short", "HEAD") or "?").strip(),
            "src_dirty": status is None or bool(status),
        },
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(m: dict[str, Any]) -> str:
    cpu, v, git = m["cpu"], m["versions"], m["git"]
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in cpu["flags"].items() if f not in ("bf16", "fphp"))
    load = "/".join(f"{x:.2f}" for x in m["load_average"])
    return (
        f"machine: {cpu['model']}, {cpu['usable_cores']} of {cpu['cores']} cores, {cpu['memory_gib']} GiB; {flags}\n"
        f"         {m['platform']}; Python {m['python']}, torch {v['torch']} ({m['torch_threads']} threads), "
        f"transformers {v['transformers']}, accelerate {v['accelerate']}, whichdevice {v['whichdevice']} "
        f"(git {git['commit']}{', src modified' if git['src_dirty'] else ''}); load average {load} (1/5/15 min)"
    )


def load_average() -> float:
    return os.getloadavg()[0]


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


@contextlib.contextmanager
def spinning(processes: int) -> Iterator[None]:
    """``processes`` busy loops (pure Python, a core each) while the block runs: a machine others share."""
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(processes)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in spinners:
            p.join(5)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


# ------------------------------------------------------------------------------------- processes

# Variables that change what the measured programs do, or how Python imports: dropped from the
# children's environment so every command runs the same, default way.
DROP_PREFIXES = ("WHICHDEVICE_", "ACCELERATE_", "PYTORCH_NVML", "TORCHELASTIC_", "OMPI_", "PMI_", "SLURM_")
DROP_NAMES = {
    "PYTHONDONTWRITEBYTECODE",  # users have bytecode caches: let the warm-up run write them
    "PYTHONPROFILEIMPORTTIME", "PYTHONTRACEMALLOC", "PYTHONDEVMODE", "PYTHONSTARTUP", "PYTHONINSPECT",
    "PYTHONVERBOSE", "PYTHONWARNINGS", "PYTHONBREAKPOINT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
}  # fmt: skip
# Nothing here may reach the network: without these, transformers and huggingface_hub try it
# (version hints, Hub kernels) and wait for a timeout.
OFFLINE = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TOKENIZERS_PARALLELISM": "false",
}  # fmt: skip


def clean_env(base: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The children's environment, and the names that were dropped from ``base``."""
    base = dict(os.environ if base is None else base)
    dropped = sorted(k for k in base if k in DROP_NAMES or k.startswith(DROP_PREFIXES))
    env = {k: v for k, v in base.items() if k not in dropped}
    env.update(OFFLINE)
    return env, dropped


def python(code: str) -> list[str]:
    """argv running ``code`` in a fresh interpreter of this environment."""
    return [sys.executable, "-c", code]


@dataclass
class Sample:
    seconds: float
    maxrss_kib: int
    returncode: int
    cpu_seconds: float  # user + system time of the child (less moved by other load than wall time)
    stdout: str
    stderr: str


def run_once(argv: Sequence[str], env: Mapping[str, str], cwd: str, keep_output: bool = False) -> Sample:
    """Run ``argv`` once: wall seconds, CPU seconds and the child's own peak RSS (KiB), from wait4."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=dict(env), cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        texts = ["", ""]
        if keep_output or proc.returncode != 0:
            for i, f in enumerate((out, err)):
                f.seek(0)
                texts[i] = f.read().decode("utf-8", "replace")
    cpu = usage.ru_utime + usage.ru_stime
    return Sample(seconds, int(usage.ru_maxrss), proc.returncode, cpu, *texts)


def last_error(sample: Sample) -> str:
    lines = [ln.strip() for ln in (sample.stderr or sample.stdout).strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit status {sample.returncode}"


def alternate_commands(
    commands: Mapping[str, Sequence[str]], rounds: int, env: Mapping[str, str], cwd: str, *, baseline: str,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:  # fmt: skip
    """Every command once per round in alternated order, each against ``baseline`` round by round.

    Each command first runs once untimed (the page cache warm, bytecode caches written); one that
    fails there is reported with its error and left out of the rounds.
    """
    errors: dict[str, str] = {}
    for name, argv in commands.items():
        warm = run_once(argv, env, cwd)
        if warm.returncode != 0:
            errors[name] = last_error(warm)
            progress(f"  {name}: FAILED in warm-up: {errors[name]}")
    live = [n for n in commands if n not in errors]
    samples: dict[str, list[Sample]] = {n: [] for n in live}
    for r in range(rounds):
        for name in round_order(live, r):
            s = run_once(commands[name], env, cwd)
            if s.returncode != 0 and name not in errors:
                errors[name] = f"round {r}: {last_error(s)}"
            samples[name].append(s)
        progress(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {samples[n][-1].seconds:.3f}s" for n in live))
    out: dict[str, Any] = {"rounds": rounds, "order": "alternating forward/reversed", "commands": {}, "errors": errors}
    for name, argv in commands.items():
        entry: dict[str, Any] = {"argv": list(argv)}
        if name in samples:
            got = samples[name]
            secs, rss, cpu = [s.seconds for s in got], [s.maxrss_kib for s in got], [s.cpu_seconds for s in got]
            entry.update(seconds=secs, maxrss_kib=rss, cpu_seconds=cpu)
            entry.update(time=summary(secs), rss=summary(rss), cpu=summary(cpu))
            if baseline in samples and name != baseline:  # round by round against the baseline
                pairs = list(zip(got, samples[baseline], strict=True))
                for key, of in (("time", "seconds"), ("rss", "maxrss_kib"), ("cpu", "cpu_seconds")):
                    ratios = [getattr(s, of) / max(getattr(b, of), 1e-6) for s, b in pairs]
                    entry[f"{key}_ratios"], entry[f"{key}_ratio"] = ratios, summary(ratios)
                entry["time_delta"] = summary([s.seconds - b.seconds for s, b in pairs])
                entry["cpu_delta"] = summary([s.cpu_seconds - b.cpu_seconds for s, b in pairs])
        out["commands"][name] = entry
    return out


# ------------------------------------------------------------------------------------- in-process rounds


def round_order(names: Sequence[str], r: int) -> list[str]:
    """Forward in even rounds, reversed in odd ones: neighbours in time in every round."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def alternate(
    runs: Mapping[str, Callable[[], float]], rounds: int, progress: Callable[[str], None] | None = None
) -> dict[str, list[float]]:
    """Each callable once per round in alternated order; what each returns (a time, a rate), per round."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in round_order(list(runs), r):
            samples[name].append(runs[name]())
        if progress is not None:
            progress(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {v[-1]:.4g}" for n, v in samples.items()))
    return samples


# ------------------------------------------------------------------------------------- statistics


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (the noise), min and max."""
    v = sorted(values)
    if not v:
        return {"n": 0}
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) >= 2 else (v[0], v[0], v[0])
    return {"n": len(v), "median": statistics.median(v), "p25": q1, "p75": q3, "min": v[0], "max": v[-1]}


def pairwise(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """``a`` over ``b`` round by round: the per-round ratios, and their median and quartiles."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {"ratios": ratios, **summary(ratios)}


def ratio_text(s: Mapping[str, Any]) -> str:
    return f"{s['median']:.3f}x (p25..p75 {s['p25']:.3f}..{s['p75']:.3f})"


# ------------------------------------------------------------------------------------- models


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def short(dtype: str) -> str:
    """fp32 / bf16 / fp16 for a torch dtype name (as whichdevice.core.dtypes spells them)."""
    return SHORT.get(dtype, dtype)


# Llamas of about 0.1B, 0.4B and 1.1B parameters (the 1.1B is TinyLlama's shape), 4 key/value heads:
# the real model sizes of real_sizes.py, generation_cache.py and the GPU runs.
LLAMA_SIZES = {
    "0.1B": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12},
    "0.4B": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 20, "num_attention_heads": 16},
    "1.1B": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32},
}
LLAMA_COMMON = {"num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def llama(size: str, **override: Any) -> dict[str, Any]:
    """The config keywords of the Llama of ``size`` (LLAMA_SIZES), with its special tokens."""
    return {**LLAMA_COMMON, **LLAMA_SIZES[size], **TOKENS, **override}


def build_model(
    config_class: str = "LlamaConfig", seed: int = 0, auto: str = "AutoModelForCausalLM", **config: Any
) -> Any:
    """A model of transformers' ``config_class`` with ``config`` (a causal LM unless ``auto`` names another
    auto class), random weights from ``seed``, in eval mode. Nothing comes from the Hub."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, auto).from_config(getattr(transformers, config_class)(**config)).eval()


def save_model(
    folder: str | os.PathLike[str], dtype: str | None = None, config_class: str = "LlamaConfig", seed: int = 0,
    **config: Any,
) -> Path:  # fmt: skip
    """``build_model`` cast to ``dtype`` (a torch dtype name) and saved with ``save_pretrained`` to ``folder``."""
    import torch

    model = build_model(config_class, seed, **config)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return Path(folder)


def generate(model: Any, ids: Any, new: int, mask: bool = True, **kwargs: Any) -> tuple[float, Any]:
    """One greedy ``generate`` of exactly ``new`` tokens after ``ids``: (seconds, the prompt included; its output)."""
    import torch

    masked = {"attention_mask": torch.ones_like(ids)} if mask else {}
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, **masked, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        if ids.device.type == "cuda":  # the last step's kernels may still be queued
            torch.cuda.synchronize()
        return time.perf_counter() - start, out


def time_generate(model: Any, ids: Any, new: int, mask: bool = True, **kwargs: Any) -> float:
    return generate(model, ids, new, mask, **kwargs)[0]


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# ------------------------------------------------------------------------------------- output


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    """Rows under a header: a Markdown table, or columns padded to their widest cell."""
    cells = [[str(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]

    def line(row: Sequence[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(row) for row in cells)])


def add_json_argument(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument("--json", type=Path, default=default, metavar="PATH", help="write the figures here as JSON")


def write_json(path: str | os.PathLike[str] | None, doc: Mapping[str, Any]) -> None:
    """``doc`` as JSON at ``path`` (folders made); nothing where ``path`` is None."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        log(f"wrote {path}")
