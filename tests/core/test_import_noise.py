"""Third-party lines logged while whichdevice imports a package are dropped, and only those (issue 58)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from whichdevice.core.import_noise import IMPORT_NOISE, quiet_import_noise
from whichdevice.report.third_party import bitsandbytes_hub_kernel


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("noise", IMPORT_NOISE, ids=lambda n: n.logger)
def test_each_listed_line_is_dropped_inside_and_passes_outside(noise) -> None:
    logger, kept = logging.getLogger(noise.logger), _Kept()
    filters, level = list(logger.filters), logger.level
    logger.addHandler(kept)
    logger.setLevel(logging.WARNING)
    try:
        with quiet_import_noise():
            logger.warning("%s: what the package adds", noise.starts)
            logger.warning("something else the package says")
        logger.warning("%s, logged by the user's own import", noise.starts)
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)
    assert kept.messages == ["something else the package says", f"{noise.starts}, logged by the user's own import"]
    assert logger.filters == filters  # nothing left behind


def test_training_arguments_imports_without_bitsandbytes_kernel_line() -> None:
    """On a CPU where importing bitsandbytes logs its Hub-kernel line (AVX512-BF16 with the kernels package),
    training_arguments() - which imports it through TrainingArguments and peft - prints nothing of it."""
    hub = bitsandbytes_hub_kernel()
    if hub is None:
        pytest.skip("the installed bitsandbytes fetches no Hub kernel on import")
    plain = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"], capture_output=True, text=True, timeout=300, check=True
    )
    if hub.logged not in plain.stderr:
        pytest.skip("importing bitsandbytes logs nothing here (no AVX512-BF16, or its Hub kernel loaded)")
    code = "import whichdevice as wd, tempfile\nwd.training_arguments(tempfile.mkdtemp(), report_to=[])\nimport peft\n"
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert hub.logged not in ours.stderr + ours.stdout
