"""Whole-process measurements for the benchmark: wall time and peak RSS of one child, alternated runs.

Each child is started with :func:`subprocess.Popen` and reaped with :func:`os.wait4`, which returns
the resource usage of that one child (``ru_maxrss`` is its own peak resident set, in KiB on Linux),
so nothing else that runs on the machine, and no earlier child, leaks into the figure. Wall time is
``time.perf_counter`` around start and reap.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Variables that change what the measured programs do, or how Python imports: dropped from the
# children's environment so every command runs the same, default way.
DROP_PREFIXES = ("WHICHDEVICE_", "ACCELERATE_", "PYTORCH_NVML", "TORCHELASTIC_", "OMPI_", "PMI_", "SLURM_")
DROP_NAMES = {
    "PYTHONDONTWRITEBYTECODE",  # users have bytecode caches: let the warm-up run write them
    "PYTHONPROFILEIMPORTTIME",
    "PYTHONTRACEMALLOC",
    "PYTHONDEVMODE",
    "PYTHONSTARTUP",
    "PYTHONINSPECT",
    "PYTHONVERBOSE",
    "PYTHONWARNINGS",
    "PYTHONBREAKPOINT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
}
# Nothing here may reach the network (and the sandbox has none): without these, transformers and
# huggingface_hub try it (version hints, Hub kernels) and wait for a timeout.
SET = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def clean_env(base: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The children's environment, and the names that were dropped from ``base``."""
    base = dict(os.environ if base is None else base)
    dropped = sorted(k for k in base if k in DROP_NAMES or k.startswith(DROP_PREFIXES))
    env = {k: v for k, v in base.items() if k not in dropped}
    env.update(SET)
    return env, dropped


@dataclass
class Sample:
    seconds: float
    maxrss_kib: int
    returncode: int
    cpu_seconds: float = 0.0  # user + system time of the child (less sensitive to other load than wall time)
    stdout: str = ""
    stderr: str = ""


def run_once(argv: Sequence[str], env: Mapping[str, str], cwd: str, *, keep_output: bool = False) -> Sample:
    """Run ``argv`` once; wall seconds and the child's own peak RSS (KiB) from wait4."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=dict(env), cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        text_out = text_err = ""
        if keep_output or proc.returncode != 0:
            out.seek(0)
            err.seek(0)
            text_out = out.read().decode("utf-8", "replace")
            text_err = err.read().decode("utf-8", "replace")
    cpu = usage.ru_utime + usage.ru_stime
    return Sample(seconds, int(usage.ru_maxrss), proc.returncode, cpu, text_out, text_err)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max (the quartiles show the noise)."""
    v = sorted(values)
    if not v:
        return {"n": 0}
    if len(v) >= 2:
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    else:
        q1 = q3 = v[0]
    return {"n": len(v), "median": statistics.median(v), "p25": q1, "p75": q3, "min": v[0], "max": v[-1]}


def last_error(sample: Sample) -> str:
    lines = [ln.strip() for ln in (sample.stderr or sample.stdout).strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit status {sample.returncode}"


def measure_group(
    commands: Mapping[str, Sequence[str]],
    rounds: int,
    env: Mapping[str, str],
    cwd: str,
    *,
    baseline: str,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Run every command once per round, alternating the order (forward, then reversed) each round.

    With the baseline first in the list it is next to the second command in every round (A B ... then
    ... B A), so the pairwise ratio of those two compares neighbours in time. Each command runs once
    first, untimed, to warm the page cache and write bytecode caches. A command that fails (non-zero
    exit) in the warm-up is reported with its error and left out of the rounds.
    """
    names = list(commands)
    errors: dict[str, str] = {}
    for name in names:
        warm = run_once(commands[name], env, cwd)
        if warm.returncode != 0:
            errors[name] = last_error(warm)
            log(f"  {name}: FAILED in warm-up: {errors[name]}")
    live = [n for n in names if n not in errors]
    samples: dict[str, list[Sample]] = {n: [] for n in live}
    for r in range(rounds):
        order = live if r % 2 == 0 else live[::-1]
        for name in order:
            s = run_once(commands[name], env, cwd)
            if s.returncode != 0 and name not in errors:
                errors[name] = f"round {r}: {last_error(s)}"
            samples[name].append(s)
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {samples[n][-1].seconds:.3f}s" for n in live))
    out: dict[str, Any] = {"rounds": rounds, "order": "alternating forward/reversed", "commands": {}, "errors": errors}
    for name in names:
        entry: dict[str, Any] = {"argv": list(commands[name])}
        if name in samples:
            secs = [s.seconds for s in samples[name]]
            rss = [s.maxrss_kib for s in samples[name]]
            cpu = [s.cpu_seconds for s in samples[name]]
            entry.update(
                seconds=secs, maxrss_kib=rss, cpu_seconds=cpu, time=summary(secs), rss=summary(rss), cpu=summary(cpu)
            )
            if baseline in samples and name != baseline:
                base = samples[baseline]
                tr = [s.seconds / b.seconds for s, b in zip(samples[name], base, strict=True)]
                mr = [s.maxrss_kib / b.maxrss_kib for s, b in zip(samples[name], base, strict=True)]
                td = [s.seconds - b.seconds for s, b in zip(samples[name], base, strict=True)]
                cr = [s.cpu_seconds / max(b.cpu_seconds, 1e-6) for s, b in zip(samples[name], base, strict=True)]
                cd = [s.cpu_seconds - b.cpu_seconds for s, b in zip(samples[name], base, strict=True)]
                entry.update(
                    cpu_ratios=cr,
                    cpu_ratio=summary(cr),
                    cpu_delta=summary(cd),
                    time_ratios=tr,
                    rss_ratios=mr,
                    time_ratio=summary(tr),
                    rss_ratio=summary(mr),
                    time_delta=summary(td),
                )
        out["commands"][name] = entry
    return out


def python(code: str) -> list[str]:
    """argv running ``code`` in a fresh interpreter of this environment."""
    return [sys.executable, "-c", code]
