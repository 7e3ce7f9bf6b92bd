"""Third-party import noise: the lines a package logs when whichdevice imports it, dropped, and only those.

``training_arguments()`` imports transformers' TrainingArguments, which imports peft and so bitsandbytes;
``lora_training()`` imports peft. Importing them logs lines the user did not cause and cannot act on (each
harmless, each listed below with its source). While whichdevice imports, a filter on the logger that
emits each drops exactly that line; every other record, and the same line logged outside whichdevice's
imports, passes. What was dropped is logged on whichdevice's logger at DEBUG. What a user's own script
prints is docs/troubleshooting.md's "Lines your training script prints".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from whichdevice.core.frozen import NamedTuple

__all__ = ["IMPORT_NOISE", "Noise", "quiet_import_noise"]


class Noise(NamedTuple):
    """One line a package logs on import: its logger, how the line starts, and where it comes from."""

    logger: str
    starts: str
    source: str


IMPORT_NOISE: tuple[Noise, ...] = (
    Noise(
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes 0.50 backends/cpu/ops.py, at import on an AVX512-BF16 CPU whose Hub kernel does not load; "
        "bitsandbytes then runs its own CPU code (report/third_party.py)",
    ),
    Noise(
        "DeepSpeed",
        "Setting accelerator to CPU",
        "deepspeed accelerator/real_accelerator.py get_accelerator(), at import on a machine with no "
        "accelerator DeepSpeed knows",
    ),
)


class _Drop(logging.Filter):
    def __init__(self, noise: Noise, dropped: list[str]) -> None:
        super().__init__()
        self.noise, self.dropped = noise, dropped

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.noise.starts):
            self.dropped.append(self.noise.starts)
            return False
        return True


@contextlib.contextmanager
def quiet_import_noise() -> Iterator[None]:
    """Run the block (which imports third-party packages for whichdevice) with IMPORT_NOISE's lines dropped."""
    dropped: list[str] = []
    # A logger's filters see the records made on it: the one each package logs on (created here when the
    # package has not been imported yet; it then gets the same object).
    added = [(logging.getLogger(n.logger), _Drop(n, dropped)) for n in IMPORT_NOISE]
    for logger, drop in added:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)
        for line in dropped:
            logging.getLogger("whichdevice").debug("silenced a third-party import line: %s ...", line)
