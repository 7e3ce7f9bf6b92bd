"""training_arguments() under simulate(): a DeviceError that shows what to assert on, never transformers' error.

A TrainingArguments reads the real machine when it is built (TrainingArguments' ``__post_init__``
checks bf16 against the real GPU, its ``device`` starts the real runtime), so one built for a
simulated accelerator either fails with transformers' "Your setup doesn't support bf16/gpu" or,
worse, describes this machine's CPU with the simulated GPU's ``fp16=True``. Tests of a training
script under ``simulate()`` assert on the decision instead: the error's ``kwargs`` (every keyword
training_arguments() would have built with, after all its checks), ``res.training_kwargs()`` and
``res.launch_command(...)``. A simulated CPU runs on the real one, so it is built as usual.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DeviceError

if TYPE_CHECKING:
    from whichdevice.resolve.resolution import Resolution

__all__ = ["SimulatedTrainingError", "refuse_simulated_accelerator"]


class SimulatedTrainingError(DeviceError):
    """training_arguments() asked to build a real TrainingArguments for simulated accelerator hardware.

    ``kwargs``: the keywords it would have passed to the class, every check done.
    """

    def __init__(self, message: str, kwargs: dict[str, Any]) -> None:
        super().__init__(message)
        self.kwargs = kwargs


def refuse_simulated_accelerator(res: Resolution, final: dict[str, Any]) -> None:
    """Raise SimulatedTrainingError when ``res`` is a simulated device other than the CPU."""
    if not res.probe.simulated or res.backend.name == "cpu":
        return
    try:
        command = " ".join(shlex.quote(part) for part in res.launch_command(["train.py"]))
    except DeviceError as err:  # a device that runs one process (mps) or launches its own way (tpu)
        command = f"not one launcher's: {err}"
    raise SimulatedTrainingError(
        f"training_arguments() builds a real transformers.TrainingArguments, which reads this machine's "
        f"hardware, not the simulated {res.device}: transformers would refuse it or describe the wrong device. "
        f"Under simulate(), assert on the decision instead: this error's .kwargs, the keywords it would "
        f"build with, are {_shown(final)}; resolve_device(task='training').launch_command(['train.py']) is "
        f"{command}. Outside simulate() the same call builds the TrainingArguments "
        "(docs/api.md#training-scripts-under-simulate)",
        dict(final),
    )


def _shown(final: dict[str, Any]) -> str:
    # The keywords whichdevice decides; the user's own (learning rate, ...) they know.
    keys = ("use_cpu", "bf16", "fp16", "ddp_backend", "torch_compile", "torch_compile_backend")
    return repr({k: final[k] for k in keys if k in final})
