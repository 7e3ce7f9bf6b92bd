"""The environment a resolution reads: ``os.environ``, or the snapshot its memo key was taken from.

resolve_device() reads the variables of its memo key once, builds the key from them, and pins that
one reading for the thread while it resolves: every reader on the resolve path asks :func:`environ`,
so another thread that changes ``WHICHDEVICE_DEVICE`` halfway through cannot give an answer that
belongs to one environment under the key of another.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

__all__ = ["ENV_VARIABLES", "IMPORT_SIDE_EFFECTS", "environ", "import_side_effects_undone", "pinned"]

# Reads no variable of its own: it hands over the readings of the modules that declare them.
ENV_VARIABLES: tuple[str, ...] = ()

_local = threading.local()


def environ() -> Mapping[str, str]:
    """The pinned snapshot while this thread resolves, else ``os.environ``."""
    env: Mapping[str, str] | None = getattr(_local, "env", None)
    return os.environ if env is None else env


@contextlib.contextmanager
def pinned(env: Mapping[str, str]) -> Iterator[None]:
    """Readers in this thread see ``env`` (and only it) until the block ends."""
    before = getattr(_local, "env", None)
    _local.env = env
    try:
        yield
    finally:
        _local.env = before


# Variables an import of transformers' modules sets as a side effect: a model module imports
# transformers.generation, whose masking_utils imports torch._dynamo, and TrainingArguments imports peft,
# whose bitsandbytes compiles; both make torch._inductor write its cache folder into os.environ
# (torch/_inductor/runtime/cache_dir_utils.py, cache_dir()). The value is a default torch derives
# again whenever it needs one, so whichdevice leaves the variable as it found it.
IMPORT_SIDE_EFFECTS = ("TORCHINDUCTOR_CACHE_DIR",)


@contextlib.contextmanager
def import_side_effects_undone() -> Iterator[None]:
    """Run the block (which may import transformers' modules), then unset what :data:`IMPORT_SIDE_EFFECTS`
    names that was unset before; a value the user set is never touched."""
    unset = [name for name in IMPORT_SIDE_EFFECTS if name not in os.environ]
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)
