"""The streamed-weights timing's bookkeeping: the cache size read from sysfs, the set sized from it,
and the packed gain taken as a median over many interleaved pairs while time is left.

The timing itself runs in test_calibration.py (every figure or "out of time"); here the parts that
decide what a figure is are checked on fixed inputs, so no test depends on this machine's speed."""

from __future__ import annotations

from pathlib import Path

import torch

from whichdevice.measure.cpu_memory import (
    _COLS,
    _ROWS,
    DEFAULT_LLC,
    NARROW,
    PACKED_PAIRS,
    _add_one_row,
    _gain,
    _more_pairs,
    last_level_cache,
    stream_matrices,
)


def _cache(folder: Path, index: int, kind: str, level: int, size: str) -> None:
    entry = folder / f"index{index}"
    entry.mkdir(parents=True)
    (entry / "type").write_text(f"{kind}\n")
    (entry / "level").write_text(f"{level}\n")
    (entry / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_largest_data_or_unified_one(tmp_path: Path):
    _cache(tmp_path, 0, "Data", 1, "32K")
    _cache(tmp_path, 1, "Instruction", 1, "32K")
    _cache(tmp_path, 2, "Unified", 2, "1024K")
    _cache(tmp_path, 3, "Unified", 3, "32768K")
    assert last_level_cache(tmp_path) == (32 * 1024**2, f"L3 32768 KiB ({tmp_path})")


def test_a_missing_or_damaged_cache_folder_falls_back_and_says_so(tmp_path: Path):
    size, why = last_level_cache(tmp_path / "absent")
    assert size == DEFAULT_LLC and "assumed" in why
    _cache(tmp_path, 0, "Unified", 3, "lots")
    assert last_level_cache(tmp_path)[0] == DEFAULT_LLC


def test_the_set_is_twice_the_cache_in_bf16_within_bounds():
    per = _ROWS * _COLS * 2
    assert stream_matrices(32 * 1024**2) == 4  # 64 MiB of 16 MiB matrices
    assert stream_matrices(1024) == 2  # never fewer than two
    assert stream_matrices(1024**4) * per * 2 <= 512 * 1024**2  # fp32's set capped


def test_the_gain_is_the_median_of_round_ratios_without_the_warm_up():
    plain = [9.0, 2.0, 2.0, 3.0, 2.0]
    packed = [1.0, 1.0, 2.0, 1.0, 1.0]  # the first pair (a warm-up, 9x) is left out
    assert _gain(plain, packed) == 2.0
    assert _gain([4.0], [2.0]) == 2.0  # one sample: its own ratio


def test_more_pairs_are_timed_interleaved_until_enough_or_out_of_time():
    order: list[str] = []
    samples: dict[str, list[float]] = {"float32": [1.0], "packed float32": [1.0]}

    def run(name: str):
        return lambda: (order.append(name), samples[name].append(1.0))

    runs = {name: run(name) for name in samples} | {"bfloat16 unpacked": run("other")}
    _more_pairs(runs, samples, lambda: False)
    assert [len(times) for times in samples.values()] == [PACKED_PAIRS + 1] * 2
    assert order[:4] == ["float32", "packed float32", "float32", "packed float32"]
    assert "other" not in order  # only the packed runs and their plain twins

    calls = iter([False, True])
    samples = {"float32": [1.0], "packed float32": [1.0]}
    _more_pairs(runs, samples, lambda: next(calls))
    assert [len(times) for times in samples.values()] == [2, 2]


def test_the_narrow_set_cuts_the_same_memory_into_many_more_calls():
    dtypes = ("float32", "bfloat16")
    weights = {name: [torch.zeros(_ROWS, _COLS, dtype=getattr(torch, name)) for _ in range(2)] for name in dtypes}
    runs: dict = {}
    memory: dict[str, float] = {}
    _add_one_row(torch, runs, weights, memory)
    count = 2 * (_ROWS * _COLS // (NARROW[0] * NARROW[1]))  # the same for every dtype
    assert memory == {"calls": 2, "narrow": count, "narrow_stream": count * NARROW[0] * NARROW[1]}
    assert {"narrow float32", "narrow bfloat16"} <= set(runs)
    if torch.backends.mkldnn.is_available():  # oneDNN runs bf16 by default: the GEMV kernel is timed beside it
        assert {"gemv", "narrow gemv"} <= set(runs)
        runs["narrow gemv"]()
        assert torch.backends.mkldnn.enabled  # torch's oneDNN switch put back
    outputs = runs["narrow float32"]()
    assert len(outputs) == count and outputs[0].shape == (1, 1, NARROW[0])
    # Views of the set, not copies: writing the set shows through, so nothing more was allocated.
    weights["float32"][0].fill_(1.0)
    assert float(runs["narrow float32"]()[0].abs().sum()) > 0
    runs = {}
    _add_one_row(torch, runs, {"float32": weights["float32"]}, memory)
    assert set(runs) == {"narrow float32"}  # no bf16 set: no GEMV run
