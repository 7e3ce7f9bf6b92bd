"""Faults (issue 16, classes 1, 2, 7, 8): every one answered with a reason naming the fix, a bounded
wait, clean streams, and nothing left changed.

- Class 1, the limit bounds the whole call: vendor packages, ``torch.backends`` plugins that
  ``import torch`` autoloads and ``whichdevice.backends`` plugins that hang, abort, segfault or exit
  on import, run through the real ``whichdevice`` command with fake packages on PYTHONPATH.
- Class 2, ``WHICHDEVICE_PROBE_TIMEOUT``: every value either means something documented or is
  refused with a DeviceError naming the valid form.
- Class 7, the command's streams: closed stdout/stderr, a reader that goes away, an ASCII-only
  encoding, a vendor banner: ``--json`` stays valid, stderr holds the one promised line.
- Class 8, the environment: whichdevice's own temporary variables are restored after a hung probe;
  a vendor's edits are reported.

The commands run at once in a thread pool (each imports torch); each fault uses a 2 s limit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from whichdevice.core.errors import DeviceError
from whichdevice.hardware import probing
from whichdevice.hardware.envhooks import release_scopes, scoped_env
from whichdevice.hardware.probes import outcomes, plugins, trial

LIMIT = "2"
# Python start, torch imported twice (here and in the trial child) on a busy 2-core machine, then
# the limit: generous, but a hang would run into the subprocess timeout instead.
BOUND_S = 90.0

# One fake site per fault: top-level module -> its __init__.py.
FAKE_NPU = """
import types, torch
torch.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
"""
SITES: dict[str, dict[str, str]] = {
    "npu-hangs": {"torch_npu": "import time\ntime.sleep(1000)\n"},
    "npu-aborts": {"torch_npu": "import os\nos.abort()\n"},
    "npu-segfaults": {"torch_npu": "import ctypes\nctypes.string_at(0)\n"},
    "npu-exits": {"torch_npu": "import os\nos._exit(3)\n"},
    "npu-raises": {"torch_npu": "raise ImportError('libascend_hal.so: cannot open shared object file')\n"},
    "npu-banner": {
        "torch_npu": "import os, sys\nprint('Welcome to Ascend!')\nos.write(1, b'C banner\\n')\n"
        "print('banner on stderr', file=sys.stderr)\nos.write(2, b'C stderr banner\\n')\n"
        "os.environ['ASCEND_FAKE_HOME'] = '/opt/ascend'\n" + FAKE_NPU
    },
    "hpu-hangs": {"habana_frameworks": "", "habana_frameworks/torch": "import time\ntime.sleep(1000)\n"},
    "mlu-runtime-hangs": {
        "torch_mlu": "import os, time, types, torch\nos.environ['NEUWARE_FAKE_HOME'] = '/usr/local/neuware'\n"
        "torch.mlu = types.SimpleNamespace(is_available=lambda: time.sleep(1000), device_count=lambda: 0)\n"
    },
    "torch-plugin-hangs": {"hangplug": "import time\ntime.sleep(1000)\ndef init():\n    pass\n"},
    "torch-plugin-aborts": {"abortplug": "import os\nos.abort()\ndef init():\n    pass\n"},
    "torch-plugin-ok": {"okplug": "import os\nos.environ['OKPLUG_LOADED'] = '1'\ndef init():\n    pass\n"},
    "wd-plugin-hangs": {"wdhang": "import time\ntime.sleep(1000)\nRECORD = None\n"},
}
ENTRY_POINTS = {
    "torch-plugin-hangs": ("hangplug", "torch.backends", "hang = hangplug:init"),
    "torch-plugin-aborts": ("abortplug", "torch.backends", "abort = abortplug:init"),
    "torch-plugin-ok": ("okplug", "torch.backends", "ok = okplug:init"),
    "wd-plugin-hangs": ("wdhang", "whichdevice.backends", "wdhang = wdhang:RECORD"),
}


def _write_sites(root: Path) -> None:
    for site, modules in SITES.items():
        for module, body in modules.items():
            package = root / site / module
            package.mkdir(parents=True, exist_ok=True)
            (package / "__init__.py").write_text(body)
        if site in ENTRY_POINTS:
            dist, group, line = ENTRY_POINTS[site]
            info = root / site / f"{dist}-1.0.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
            (info / "entry_points.txt").write_text(f"[{group}]\n{line}\n")


class Run(NamedTuple):
    argv: tuple[str, ...]
    site: str | None = None
    env: dict[str, str] = {}  # noqa: RUF012 - a NamedTuple field, never mutated
    close: tuple[int, ...] = ()  # descriptors closed in the child (>&-, 2>&-)
    script: str | None = None  # python -c instead of the command


class Expect(NamedTuple):
    code: int
    stderr: tuple[str, ...] = ()  # fragments of the one stderr line ("" for: stderr stays empty)
    stdout: tuple[str, ...] = ()
    json: bool = False  # stdout is one JSON document
    absent: tuple[str, ...] = ()  # must not appear on stdout or stderr


TRAINING_AFTER = """
import json, os, time
import whichdevice as wd
start = time.monotonic()
res = wd.resolve_device()
out = {"device": res.device, "env": {k: os.environ.get(k) for k in ("PYTORCH_CNDEV_BASED_MLU_CHECK",)}}
out["warnings"] = [w for p in wd.probe_all() for w in p.warnings]
try:
    wd.training_arguments(output_dir=os.environ["OUT_DIR"])
    out["training"] = "built"
except wd.DeviceError as exc:
    out["training"] = str(exc)
out["seconds"] = time.monotonic() - start
print(json.dumps(out))
"""

CASES: dict[str, tuple[Run, Expect]] = {
    # ---- class 1: the limit bounds the whole call
    "check-detect-npu-hangs": (
        Run(("check",), "npu-hangs"),
        Expect(1, ("npu", "importing torch_npu did not finish within 2 s", "WHICHDEVICE_PROBE_TIMEOUT")),
    ),
    "check-cpu-npu-hangs": (Run(("check", "cpu"), "npu-hangs"), Expect(0, ("",), ("ok: cpu is usable",))),
    "check-npu-npu-hangs": (Run(("check", "npu"), "npu-hangs"), Expect(1, ("did not finish within 2 s", "torch-npu"))),
    "check-npu-aborts": (
        Run(("check", "npu"), "npu-aborts"),
        Expect(1, ("killed the process with SIGABRT",)),
    ),
    "check-detect-npu-aborts": (
        Run(("check",), "npu-aborts"),
        Expect(1, ("npu", "SIGABRT", "detection would pick cpu")),
    ),
    "check-npu-segfaults": (Run(("check", "npu"), "npu-segfaults"), Expect(1, ("SIGSEGV",))),
    "check-npu-exits": (Run(("check", "npu"), "npu-exits"), Expect(1, ("ended the process (exit code 3)",))),
    "check-npu-raises": (Run(("check", "npu"), "npu-raises"), Expect(1, ("libascend_hal.so", "reinstall"))),
    "json-check-npu-aborts": (
        Run(("--json", "check", "npu"), "npu-aborts"),
        Expect(1, ("SIGABRT",), ('"exit_code": 1',), json=True),
    ),
    "check-hpu-hangs": (Run(("check", "hpu"), "hpu-hangs"), Expect(1, ("habana_frameworks.torch did not finish",))),
    "check-detect-torch-plugin-hangs": (
        Run(("check",), "torch-plugin-hangs"),
        Expect(1, ("torch.backends plugin 'hang'", "did not finish within 2 s")),
    ),
    "check-cpu-torch-plugin-hangs": (Run(("check", "cpu"), "torch-plugin-hangs"), Expect(0, ("",), ("ok: cpu",))),
    "check-detect-torch-plugin-aborts": (
        Run(("check",), "torch-plugin-aborts"),
        Expect(1, ("torch.backends plugin 'abort'", "SIGABRT")),
    ),
    "check-detect-torch-plugin-ok": (Run(("check",), "torch-plugin-ok"), Expect(0, ("",), ("ok: cpu",))),
    "check-cpu-wd-plugin-hangs": (Run(("check", "cpu"), "wd-plugin-hangs"), Expect(0, ("",), ("ok: cpu",))),
    "check-detect-wd-plugin-hangs": (
        Run(("check",), "wd-plugin-hangs"),
        Expect(1, ("whichdevice plugin 'wdhang'", "did not finish within 2 s")),
    ),
    "report-npu-hangs": (Run(("--json",), "npu-hangs"), Expect(0, ("",), ("did not finish within 2 s",), json=True)),
    # ---- class 2: the limit's own values, on the command line
    "timeout-garbage": (
        Run(("check",), env={"WHICHDEVICE_PROBE_TIMEOUT": "abc"}),
        Expect(2, ("WHICHDEVICE_PROBE_TIMEOUT='abc' is not a time limit", "=inf for no limit")),
    ),
    "timeout-garbage-report": (
        Run(("--json",), env={"WHICHDEVICE_PROBE_TIMEOUT": "-5"}),
        Expect(2, ("WHICHDEVICE_PROBE_TIMEOUT='-5'",), json=True),
    ),
    "timeout-inf": (Run(("check",), env={"WHICHDEVICE_PROBE_TIMEOUT": "inf"}), Expect(0, ("",), ("ok: cpu",))),
    "timeout-huge": (Run(("check",), env={"WHICHDEVICE_PROBE_TIMEOUT": "1e10"}), Expect(0, ("",), ("ok: cpu",))),
    # ---- class 7: the command's own streams
    "closed-stdout": (Run(("check",), close=(1,)), Expect(0, ("",))),
    "closed-stdout-bad-device": (Run(("check", "gpu"), close=(1,)), Expect(2, ("Did you mean 'cuda'?",))),
    "closed-stderr-json": (
        Run(("--json", "check", "gpu"), close=(2,)),
        Expect(2, stdout=('"exit_code": 2',), json=True),
    ),
    "closed-stdin": (Run(("check",), close=(0,)), Expect(0, ("",), ("ok: cpu",))),
    "ascii-device-name": (
        Run(("check",), env={"PYTHONIOENCODING": "ascii", "WHICHDEVICE_DEVICE": "cud\u00e4"}),
        Expect(2, ("'cud\\xe4'", "Did you mean 'cuda'?")),
    ),
    "ascii-json": (
        Run(("--json", "check"), env={"PYTHONIOENCODING": "ascii", "WHICHDEVICE_DEVICE": "cud\u00e4"}),
        Expect(2, ("cud\\xe4",), json=True),
    ),
    "ascii-report": (
        Run((), env={"PYTHONIOENCODING": "ascii", "CUDA_VISIBLE_DEVICES": "gp\u00fc"}),
        Expect(0, ("",), absent=("Traceback",)),
    ),
    "banner-json-report": (
        Run(("--json",), "npu-banner"),
        Expect(0, ("",), ("changed the environment: set ASCEND_FAKE_HOME",), json=True, absent=("Welcome", "banner")),
    ),
    "banner-check-npu": (
        Run(("check", "npu"), "npu-banner"),
        Expect(1, ("finds no Huawei Ascend device",), absent=("Welcome", "banner")),
    ),
    "banner-text-report": (Run((), "npu-banner"), Expect(0, ("",), ("npu",), absent=("Welcome", "banner"))),
    "banner-debug-shows-it": (
        Run(("--debug", "--json"), "npu-banner"),
        Expect(0, stdout=('"kind": "report"',), json=True),
    ),
    # ---- class 8 (and class 1's later calls): in a Python program
    "training-after-npu-hangs": (
        Run((), "npu-hangs", script=TRAINING_AFTER),
        Expect(0, stdout=('"device": "cpu"', "training_arguments() cannot run", "would wait forever")),
    ),
    "training-after-npu-aborts": (
        Run((), "npu-aborts", script=TRAINING_AFTER),
        Expect(0, stdout=("training_arguments() cannot run", "SIGABRT", "fail the same way")),
    ),
    "mlu-runtime-hangs": (
        Run((), "mlu-runtime-hangs", script=TRAINING_AFTER),
        Expect(
            0,
            stdout=(
                '"PYTORCH_CNDEV_BASED_MLU_CHECK": null',
                "probing mlu changed the environment: set NEUWARE_FAKE_HOME",
                "training_arguments() cannot run",
                "ask the mlu runtime themselves",
            ),
        ),
    ),
    "mlu-runtime-hangs-user-value-kept": (
        Run((), "mlu-runtime-hangs", env={"PYTORCH_CNDEV_BASED_MLU_CHECK": "0"}, script=TRAINING_AFTER),
        Expect(0, stdout=('"PYTORCH_CNDEV_BASED_MLU_CHECK": "0"',)),
    ),
}


def _closer(fds: tuple[int, ...]) -> Any:
    if not fds:
        return None
    return lambda: [os.close(fd) for fd in fds]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], float]]:
    root = tmp_path_factory.mktemp("faults")
    _write_sites(root)
    src = str(Path(probing.__file__).resolve().parents[2])  # src/, above whichdevice/hardware/
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WHICHDEVICE_", "CUDA_", "PYTORCH_")) and k not in ("PYTHONPATH", "PYTHONIOENCODING")
    }

    def run(item: tuple[str, tuple[Run, Expect]]) -> tuple[subprocess.CompletedProcess[str], float]:
        name, (case, _) = item
        path = [src, *([str(root / case.site)] if case.site else [])]
        env = {**base, "PYTHONPATH": os.pathsep.join(path), "WHICHDEVICE_PROBE_TIMEOUT": LIMIT, **case.env}
        env["OUT_DIR"] = str(root / f"out-{name}")
        argv = ["-c", case.script] if case.script else ["-m", "whichdevice", *case.argv]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, *argv],
            env=env,
            stdin=None if 0 in case.close else subprocess.DEVNULL,
            stdout=None if 1 in case.close else subprocess.PIPE,
            stderr=None if 2 in case.close else subprocess.PIPE,
            preexec_fn=_closer(case.close),
            timeout=240,
            check=False,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        return proc, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CASES, pool.map(run, CASES.items()), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_fault(name: str, results: dict[str, tuple[subprocess.CompletedProcess[str], float]]) -> None:
    (case, expect), (proc, seconds) = CASES[name], results[name]
    out, err = proc.stdout or "", proc.stderr or ""
    assert proc.returncode == expect.code, (out[-2000:], err)
    assert seconds < BOUND_S, f"took {seconds:.1f} s"
    assert "Traceback" not in err
    if 2 not in case.close and case.script is None:
        # Nothing but the one promised line: an error (or none at all when the command succeeds).
        lines = err.strip().splitlines()
        assert len(lines) <= (1 if expect.code else 0) or "--debug" in case.argv, err
        if lines and "--debug" not in case.argv:
            assert lines[0].startswith("whichdevice"), err
    for fragment in expect.stderr:
        assert fragment in err, err
    for fragment in expect.stdout:
        assert fragment in out, out[-3000:]
    for fragment in expect.absent:
        assert fragment not in out and fragment not in err
    if expect.json:
        data = json.loads(out)
        assert data["exit_code"] == expect.code


def test_debug_shows_what_other_code_printed(results: dict[str, Any]) -> None:
    proc, _ = results["banner-debug-shows-it"]
    assert "output of other code while the command ran" in proc.stderr
    assert "Welcome to Ascend!" in proc.stderr and "C banner" in proc.stderr


def test_a_broken_pipe_keeps_the_exit_code(tmp_path: Path) -> None:
    # whichdevice --json | head -1
    src = str(Path(probing.__file__).resolve().parents[2])  # src/, above whichdevice/hardware/
    env = {**os.environ, "PYTHONPATH": src}
    shell = f"{sys.executable} -m whichdevice --json | head -1; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "{\n"
    assert proc.stderr == ""


# --------------------------------------------------------------- class 2: the limit's own values

TIMEOUT_VALUES = [
    ("2.5", 2.5),
    (" 30 ", 30.0),
    ("1e3", 1000.0),
    ("1e10", 1e10),
    ("inf", math.inf),
    ("INF", math.inf),
    ("Infinity", math.inf),
    ("none", math.inf),
    ("off", math.inf),
    ("0", math.inf),
    ("", probing.DEFAULT_TIMEOUT_S),
    ("   ", probing.DEFAULT_TIMEOUT_S),
]
TIMEOUT_REFUSED = ["abc", "-1", "-inf", "nan", "10s", "1,5", "0x10", "ten", "-0.5"]


@pytest.mark.parametrize(("raw", "seconds"), TIMEOUT_VALUES)
def test_timeout_values_with_a_meaning(raw: str, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", raw)
    assert probing.probe_timeout() == seconds


@pytest.mark.parametrize("raw", TIMEOUT_REFUSED)
def test_timeout_garbage_is_refused_naming_the_form(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import whichdevice as wd

    monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", raw)
    with pytest.raises(DeviceError) as err:
        wd.resolve_device()
    assert f"WHICHDEVICE_PROBE_TIMEOUT={raw!r} is not a time limit" in str(err.value)
    assert "WHICHDEVICE_PROBE_TIMEOUT=inf for no limit" in str(err.value)


@pytest.mark.parametrize("raw", ["inf", "1e10", "1e300", "0"])
def test_no_limit_and_huge_limits_probe(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import whichdevice as wd

    monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", raw)
    assert wd.probe("cpu", refresh=True).available  # no OverflowError from Thread.join


@pytest.mark.parametrize("bad", [0, -1, math.nan, -math.inf, "10", True])
def test_set_probe_timeout_refuses_what_is_not_a_limit(bad: Any) -> None:
    with pytest.raises(DeviceError, match=r"set_probe_timeout\(seconds\) takes a number of seconds greater than 0"):
        probing.set_probe_timeout(bad)


@pytest.mark.parametrize("bad", [0, -1, math.nan, "2"])
def test_probe_timeout_argument_is_checked(bad: Any) -> None:
    import whichdevice as wd

    with pytest.raises(DeviceError, match=r"probe\(timeout=\) takes a number of seconds"):
        wd.probe("cpu", refresh=True, timeout=bad)


def test_set_probe_timeout_accepts_no_limit() -> None:
    probing.set_probe_timeout(math.inf)
    assert probing.probe_timeout() == math.inf


# ------------------------------------------------------------ class 8: whichdevice's own variables


def _register(name: str, probe: Any) -> None:
    import whichdevice as wd

    fields = {"name": name, "hardware": f"{name} device", "package": f"{name}-pkg", "module": f"{name}_absent"}
    wd.register_backend(wd.Backend(**fields, probe_ref=probe))  # type: ignore[arg-type]


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_scoped_variables_of_a_given_up_thread_are_restored(
    before: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    entered, release = threading.Event(), threading.Event()

    def hangs() -> None:
        with scoped_env(**{name: "1"}):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=hangs, daemon=True)
    thread.start()
    assert entered.wait(10)
    assert os.environ.get(name) == "1"
    assert release_scopes(thread) == [name]
    assert os.environ.get(name) == before  # restored now, not when the thread ends
    release.set()
    thread.join(10)
    assert os.environ.get(name) == before  # and the thread's own exit does not undo it again


def test_a_hung_probe_restores_its_scoped_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import whichdevice as wd
    from whichdevice.core.records import Backend

    monkeypatch.delenv("WD_TEST_SWITCH", raising=False)
    release = threading.Event()

    def probe(backend: Backend) -> Any:
        with scoped_env(WD_TEST_SWITCH="1"):
            release.wait(30)

    _register("switchy", probe)
    try:
        result = wd.probe("switchy", timeout=0.3)
        assert "did not finish within 0.3 s" in (result.reason or "")
        assert "WD_TEST_SWITCH" not in os.environ
        assert "switchy" in probing.gave_up()
    finally:
        release.set()


def test_a_probe_that_edits_the_environment_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import whichdevice as wd
    from whichdevice.core.records import Backend
    from whichdevice.hardware.probes.common import not_installed

    monkeypatch.delenv("WD_TEST_VENDOR_HOME", raising=False)
    monkeypatch.setenv("WD_TEST_VENDOR_PATH", "a")

    def probe(backend: Backend) -> Any:
        os.environ["WD_TEST_VENDOR_HOME"] = "/opt/vendor"
        os.environ["WD_TEST_VENDOR_PATH"] = "b"
        return not_installed(backend)

    _register("editor", probe)
    try:
        result = wd.probe("editor")
    finally:
        os.environ.pop("WD_TEST_VENDOR_HOME", None)
    note = "probing editor changed the environment: set WD_TEST_VENDOR_HOME, changed WD_TEST_VENDOR_PATH"
    assert note in result.warnings
    assert "/opt/vendor" not in " ".join(result.warnings)  # names only: values can be secrets


def test_environment_changes_name_each_kind() -> None:
    before = {"A": "1", "B": "2", "C": "3"}
    after = {"A": "1", "B": "x", "D": "4"}
    assert outcomes.environment_changes(before, after) == ["changed B", "unset C", "set D"]
    assert outcomes.environment_changes(before, after, ignore=("B",)) == ["unset C", "set D"]


def test_a_forgotten_verdict_is_tried_again() -> None:
    trial.remember_bad_import(["wd_never_imported_pkg.sub"], "importing wd_never_imported_pkg did not finish")
    assert "wd_never_imported_pkg" in trial.bad_imports()
    with pytest.raises(DeviceError, match="pip uninstall wd-never-imported-pkg"):
        outcomes.raise_if_import_hung("training_arguments()")
    probing.clear_cache()
    assert "wd_never_imported_pkg" not in trial.bad_imports()
    outcomes.raise_if_import_hung("training_arguments()")


def test_no_trial_without_vendor_packages() -> None:
    # The fresh-resolve cost on a plain machine: only installed vendor packages are tried.
    from importlib.util import find_spec

    from whichdevice.hardware.registry import backends

    assert all(find_spec(step.module) is not None for step in trial.risky_modules(backends()))
    assert plugins.torch_plugins() == []


def test_the_child_names_the_step_that_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, body in (("wd_fast_a", ""), ("wd_slow_b", "import time\ntime.sleep(60)\n"), ("wd_fast_c", "")):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = [trial.Step(n, n) for n in ("wd_fast_a", "wd_slow_b", "wd_fast_c")]
    try:
        bad = trial.trial_imports(steps, 1.0)
        assert list(bad) == ["wd_slow_b"]
        assert "importing wd_slow_b did not finish within 1 s" in bad["wd_slow_b"]
    finally:
        trial.forget_bad_imports()
