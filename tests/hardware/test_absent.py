"""Backends simply not installed: one line in the trace and the report, each install command kept (issue 58)."""

from __future__ import annotations

import json
import subprocess
import sys

import whichdevice as wd
from whichdevice import report
from whichdevice.core.records import TraceStep
from whichdevice.hardware.absent import collapse_absent
from whichdevice.hardware.probes.common import absent_reason
from whichdevice.testing import simulate


def _absent_here() -> list[str]:
    """The backends whose package is simply not installed on this machine, in detection order."""
    return [b.name for b in wd.backends() if wd.probe(b.name).reason == absent_reason(b)]


def test_the_trace_says_the_backends_not_installed_in_one_line_and_verbose_in_each() -> None:
    res, absent = wd.resolve_device(), _absent_here()
    short, full = res.explain(), res.explain(verbose=True)
    assert absent, "this test needs a machine without some backend package (every CI machine lacks most)"
    assert f"not installed: {', '.join(absent)} (each one's install command: explain(verbose=True)" in short
    for name in absent:
        install = wd.get_backend(name).install_command
        assert install not in short and install in full
        # The record keeps each step, with its install command.
        assert any(s["topic"] == name and install in s["message"] for s in res.to_dict()["trace"])
    assert len(short.splitlines()) == len(full.splitlines()) - (len(absent) - 1)


def test_a_simulated_machine_folds_the_backends_it_lacks() -> None:
    with simulate("hpu:8"):
        res = wd.resolve_device()
    short = res.explain()
    line = next(line for line in short.splitlines() if "not present on the simulated machine" in line)
    assert "neuron, tpu, npu, mlu, musa" in line and "hpu" not in line.split(":", 1)[1].split("(")[0]
    assert sum("not present on the simulated machine" in line for line in res.explain(verbose=True).splitlines()) > 1


def test_a_backend_installed_but_unusable_keeps_its_own_line() -> None:
    steps = [
        TraceStep("neuron", f"not chosen: {absent_reason(wd.get_backend('neuron'))}", False),
        TraceStep("npu", "not chosen: torch-npu 2.1 is installed but failed to import: libascend.so missing", False),
        TraceStep("tpu", f"not chosen: {absent_reason(wd.get_backend('tpu'))}", False),
        TraceStep("cpu", "chosen: CPU", True),
    ]
    folded = collapse_absent(steps)
    assert [s.topic for s in folded] == ["others", "npu", "cpu"]
    assert folded[0].message.startswith("not installed: neuron, tpu (")
    # A topic no registry row has, or a step that is not detection's, is left as it is.
    assert (
        collapse_absent([TraceStep("acme", "not chosen: acme is not installed: pip install acme", False)])[0].topic
        == "acme"
    )


def test_the_report_text_folds_them_and_the_json_keeps_each_install_command() -> None:
    data, absent = report.gather(), _absent_here()
    text, verbose = report.render_text(data), report.render_text(data, verbose=True)
    assert f"- others  not installed  {', '.join(absent)} (whichdevice --verbose or --json" in text
    for name in absent:
        install = wd.get_backend(name).install_command
        assert install not in text and install in verbose and install in json.dumps(data)
    command = [sys.executable, "-m", "whichdevice", "--verbose", "--task", "inference"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and all(wd.get_backend(n).install_command in done.stdout for n in absent)
