"""training_arguments() under simulate(): the designed SimulatedTrainingError with the keywords, on each accelerator."""

from __future__ import annotations

import pytest

import whichdevice as wd
from whichdevice.testing import simulate
from whichdevice.training.simulated import SimulatedTrainingError

pytestmark = pytest.mark.usefixtures("restore_accelerate_variables")


@pytest.mark.parametrize(
    ("spec", "mixed"),
    # mps and tpu have no launch command of one launcher (mps runs one process, torch_xla starts its own): the
    # error that explains the simulation must not fail on its own "launch command" line (issue 58).
    [("mps", {"bf16": False, "fp16": False}), ("tpu:4", {"bf16": True, "fp16": False}), ("neuron:2", {"bf16": True})],
)
def test_a_simulated_accelerator_without_a_launcher_still_gets_the_designed_error(spec: str, mixed: dict) -> None:
    with simulate(spec), pytest.raises(SimulatedTrainingError) as err:
        wd.training_arguments(output_dir="out", report_to=[])
    assert isinstance(err.value, wd.DeviceError) and err.value.kwargs["output_dir"] == "out"
    assert mixed.items() <= err.value.kwargs.items()
    message = str(err.value)
    assert "assert on the decision instead: this error's .kwargs" in message
    assert "docs/api.md#training-scripts-under-simulate" in message
