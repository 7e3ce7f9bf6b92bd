"""The sampled fingerprint a packed layer checks per call: it sees every write to the whole weight, a
write to any sampled element, in any dtype packed and in any layout, with and without NumPy; and its
bits, not its values, so a NaN weight stays unchanged."""

from __future__ import annotations

import pytest
import torch

from whichdevice.tuning.fingerprint import SAMPLES, Fingerprint


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    fp32 = torch.randn(512, 96, generator=gen)
    return [fp32, fp32.to(torch.bfloat16), torch.randn(96, 512, generator=gen).t(), torch.randn(3, 5, generator=gen)]


@pytest.fixture(params=["numpy", "torch"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":  # as where NumPy is not installed: torch's numpy() raises
        monkeypatch.setattr(torch.Tensor, "numpy", lambda self, **kw: (_ for _ in ()).throw(RuntimeError("no NumPy")))
    return str(request.param)


@pytest.mark.parametrize("index", range(4))
def test_a_write_to_the_whole_weight_is_seen(reader: str, index: int):
    weight = _weights()[index]
    fingerprint = Fingerprint(weight)
    assert fingerprint.unchanged()
    weight.mul_(1.5)
    assert not fingerprint.unchanged()


def test_a_write_to_each_sampled_element_is_seen_and_elsewhere_is_not_read(reader: str):
    weight = torch.randn(64, 40)
    fingerprint = Fingerprint(weight)
    flat = weight.view(-1)
    seen = 0
    for position in range(flat.numel()):
        old = flat[position].item()
        flat[position] = old + 1.0
        seen += not fingerprint.unchanged()
        flat[position] = old
        assert fingerprint.unchanged()
    assert seen == min(SAMPLES, flat.numel())  # one write seen per sampled element, no other


def test_bits_not_values_a_nan_stays_unchanged_and_a_sign_of_zero_counts():
    weight = torch.full((32, 32), float("nan"))
    assert Fingerprint(weight).unchanged()  # NaN != NaN as a value: a check by value would never pass
    zeros = torch.zeros(32, 32)
    fingerprint = Fingerprint(zeros)
    zeros.neg_()  # -0.0 equals 0.0 as a value; the copy packed from +0.0 holds other bits
    assert not fingerprint.unchanged()
