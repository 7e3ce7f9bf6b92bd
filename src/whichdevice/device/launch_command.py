"""The command that starts one process per device of a target, and the device Trainer takes in one process.

In one process ``TrainingArguments`` always takes device index 0 (``cuda:0``, ``xpu:0``, ...;
``torch.cuda.set_device(0)``), wrapping the model in ``nn.DataParallel`` over every visible CUDA
device; only the visible-devices variable, set before the program starts, chooses another device.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from whichdevice.core.errors import ConfigConflictError, DeviceError
from whichdevice.core.records import TraceStep
from whichdevice.launch.accelerate_settings import LAUNCHERS

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.device.target import Target

__all__ = ["launch_command", "trainer_device_steps"]


def _visible_variable(target: Target) -> str | None:
    vis = target.probe.visible
    if vis is not None and vis.variable:
        return vis.variable
    return target.backend.visible_devices_env[0] if target.backend.visible_devices_env else None


def _only(target: Target, index: int) -> str:
    """``CUDA_VISIBLE_DEVICES=3``: the setting that shows this process's device ``index`` alone."""
    variable = _visible_variable(target)
    physical = target.probe.visible.physical_id(index) if target.probe.visible is not None else str(index)
    if not variable:
        return f"a {target.name} setting that shows only device {index}"
    return shlex.quote(f"{variable}={physical}")


def trainer_device_steps(target: Target, index: int | None) -> list[TraceStep]:
    """Check that Trainer trains where whichdevice resolved (``index``: the device index the caller
    asked for, None where it was detected), and warn where one process leaves devices idle.

    Raises :class:`ConfigConflictError` for a device index that Trainer would not use.
    """
    backend, dist = target.backend, target.distributed
    if backend.shared_device or not _launchable(backend):
        return []
    count = target.probe.device_count
    if dist is not None:
        if index is not None and index != dist.local_rank % max(count, 1):
            raise ConfigConflictError(
                f"device '{backend.name}:{index}' for training in a {dist.launcher} run, but accelerate gives "
                f"each process the device of its local rank ({dist.local_rank_variable}={dist.local_rank} -> "
                f"{backend.name}:{dist.local_rank % max(count, 1)}); leave device out, or choose the "
                f"processes' devices with {_visible_variable(target) or 'its visible-devices variable'} "
                "before launching"
            )
        return []
    if index is not None and index > 0:
        raise ConfigConflictError(
            f"device '{backend.name}:{index}' for training: in one process TrainingArguments always trains on "
            f"{backend.name}:0 (it calls set_device({backend.name}:0)), and the visible-devices variable "
            f"cannot change once torch has initialised {backend.name}. Start the program with that device alone "
            f"visible: {_only(target, index)} python train.py (it is {backend.name}:0 there), or "
            f"run one process per device with `{shlex.join(launch_command(target, ['train.py']))}`"
        )
    if count < 2:
        return []
    # Quoted for a shell: the visible-devices value is copied from the environment as it is.
    launch = shlex.join(launch_command(target, ["train.py"]))
    if backend.name == "cuda":
        what = (
            f"Trainer in one process wraps the model in nn.DataParallel over all {count} visible GPUs "
            "(TrainingArguments.n_gpu = torch.cuda.device_count()), which is slower than one process per GPU"
        )
    else:
        others = "the other device" if count == 2 else f"the other {count - 1}"
        what = f"Trainer in one process trains on {backend.name}:0 only and leaves {others} idle"
    return [TraceStep("warning", f"{what}; launch one process per device: `{launch}` (res.launch_command)")]


def _launchable(backend: Backend) -> bool:
    # A backend with no process group runs one process (mps); torch_xla starts its own processes.
    return backend.distributed_backend not in (None, "xla")


def launch_command(
    target: Target,
    script: Sequence[str],
    *,
    launcher: str = "torchrun",
    nproc: int | None = None,
) -> list[str]:
    """The argument list that starts ``script`` (``["train.py", "--lr", "1e-4"]``) once per device.

    A visible-devices variable set in this environment is written into the command, so that it
    selects the same devices from any shell: ``["env", "CUDA_VISIBLE_DEVICES=2,3", "torchrun", ...]``.
    """
    backend, result = target.backend, target.probe
    if not _launchable(backend):
        raise DeviceError(
            f"no launch command for {backend.name}: "
            + (
                f"{backend.hardware} runs one process"
                if backend.distributed_backend is None
                else "torch_xla starts the processes of a TPU run itself (see torch_xla's documentation)"
            )
        )
    if launcher not in LAUNCHERS:
        raise DeviceError(f"launcher={launcher!r}: use {' or '.join(repr(x) for x in LAUNCHERS)}")
    if not isinstance(script, str) and not (
        isinstance(script, Sequence) and all(isinstance(a, (str, os.PathLike)) for a in script)
    ):
        raise DeviceError(
            f"script={script!r}: give the command as a list of strings, e.g. ['train.py', '--lr', '1e-4']"
        )
    args = [script] if isinstance(script, str) else [str(a) for a in script]
    if not args:
        raise DeviceError("launch_command() needs the script and its arguments, e.g. ['train.py', '--lr', '1e-4']")
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise DeviceError(f"nproc={nproc!r}: pass a whole number of processes, 1 or more")
    count = nproc if nproc is not None else (1 if backend.shared_device else max(result.device_count, 1))
    if launcher == "torchrun":
        command = ["torchrun", f"--nproc-per-node={count}", *args]
    else:
        command = ["accelerate", "launch", "--num_processes", str(count), *args]
    vis = result.visible
    if vis is not None and vis.variable and vis.raw is not None:
        return ["env", f"{vis.variable}={vis.raw}", *command]
    return command
