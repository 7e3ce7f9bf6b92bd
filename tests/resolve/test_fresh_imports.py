"""What a fresh ``resolve_device()`` imports: the records and machinery of paths it does not take stay out.

Each frozen dataclass costs about a millisecond to create on Python 3.11, and a fresh resolve is held to
1.03x ``import torch`` (issue 56): the modules below hold records (or a child-process machinery) that a
resolve without a model, a launcher, a vendor package or a torch plugin never uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import whichdevice as wd
from whichdevice.core.entry_points import TORCH_GROUP, entry_points
from whichdevice.hardware.probes import trial, verdicts
from whichdevice.hardware.probes.verdicts import vendor_modules
from whichdevice.launch import context, distributed, launch_strategy, strategy_record
from whichdevice.memory import fit, largest, largest_record, record

LAUNCHERS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_", "OMPI_", "PMI_", "MASTER_")


def _fresh_resolve_imports() -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHERS) and not k.startswith("WHICHDEVICE_")}
    code = (
        "import json, sys, whichdevice; whichdevice.resolve_device(); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('whichdevice'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True, env=env)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_a_fresh_resolve_leaves_out_what_it_does_not_use() -> None:
    imported = _fresh_resolve_imports()
    assert "whichdevice.resolve.resolver" in imported  # it did resolve
    # memory/fit.py sizes a model: none was given (memory/record.py holds the Placement every answer has)
    assert "whichdevice.memory.fit" not in imported
    assert "whichdevice.memory.record" in imported
    # launch/context.py's record describes a launched process: this one was not
    assert "whichdevice.launch.context" not in imported
    # inference without Hub kernels: the training launch's steps and the kernels' layer check stay out
    assert "whichdevice.device.launch_command" not in imported
    assert "whichdevice.attention.kernel_layers" not in imported
    # tables read only on paths not taken here: a checkpoint's architecture (fp16_safe), training a model=
    # (full_fp32), a GPU's generation (generations), a training launch (checks); an installed plugin's
    # torch pin (compatibility) where none is installed
    for module in ("precision.fp16_safe", "precision.full_fp32", "precision.generations", "launch.checks"):
        assert f"whichdevice.{module}" not in imported
    if not vendor_modules(wd.backends()) and not entry_points(TORCH_GROUP):
        assert "whichdevice.hardware.compatibility" not in imported
        # nothing to try in a child: the trial's machinery stays out, its verdicts are still asked
        assert "whichdevice.hardware.probes.trial" not in imported
        assert "whichdevice.hardware.probes.verdicts" in imported


def test_the_records_left_out_are_built_where_they_are_needed() -> None:
    launched = {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    launched |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    found = distributed.detect_distributed(launched)
    assert isinstance(found, context.DistributedContext)
    assert (found.rank, found.world_size, found.local_rank) == (1, 2, 1)
    assert distributed.detect_distributed({}) is None
    strategy = launch_strategy.read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true"})
    assert isinstance(strategy, strategy_record.LaunchStrategy) and strategy.name == "DeepSpeed ZeRO-2"
    assert launch_strategy.read_launch_strategy({}) is None


def test_the_records_moved_are_still_named_where_they_were() -> None:
    assert distributed.DistributedContext is context.DistributedContext
    assert launch_strategy.LaunchStrategy is strategy_record.LaunchStrategy
    assert fit.Placement is record.Placement
    assert fit.LargestFit is largest.LargestFit is largest_record.LargestFit
    assert trial.bad_imports is verdicts.bad_imports and trial.HUNG == verdicts.HUNG


def test_the_argument_aliases_are_made_when_read() -> None:
    """resolve_device's argument aliases are typing's objects, built on first read, not at import."""
    from typing import ForwardRef, Literal, Union

    from whichdevice.resolve import resolver
    from whichdevice.resolve.resolver import DeviceLike, DtypeLike, ModelLike, Quantize

    assert Quantize == Literal["auto", "4bit", "8bit"]
    assert DeviceLike == Union[str, ForwardRef("torch.device")]  # noqa: UP007
    assert DtypeLike == Union[str, ForwardRef("torch.dtype")]  # noqa: UP007
    assert ModelLike == Union[str, ForwardRef("os.PathLike[str]"), ForwardRef("PretrainedConfig")]  # noqa: UP007
    assert resolver.DeviceLike is DeviceLike  # made once
    code = (
        "import whichdevice; from whichdevice.resolve import resolver; whichdevice.resolve_device(); "
        "print(sorted(vars(resolver)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "DeviceLike" not in out.stdout and "resolve_device" in out.stdout
