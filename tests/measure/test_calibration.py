"""The CPU's calibration: figures pinned by simulate("cpu,calib=...") decide the dtype and the decode
attention for the job; the cache on disk is keyed, atomic and survives damage; the command prints it.

No test here depends on how fast this machine is: the decisions are checked against pinned
figures, and the cache tests replace only the timing (``cpu_timing.measure``) with fixed figures.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice import cli
from whichdevice.core.errors import DeviceError
from whichdevice.hardware import owned_files, probing, store
from whichdevice.measure import calibration, cpu_timing
from whichdevice.measure.cpu_memory import packable_dtypes
from whichdevice.report import gather
from whichdevice.report.calibration import render_calibration
from whichdevice.resolve.memo import memo_variables
from whichdevice.testing import simulate

# The AMD EPYC without native bf16: bf16 wins a batch-1 decode step, loses at batch 4 and
# badly on prompts (its emulated arithmetic).
EPYC = (
    "cpu,flags=,calib=bf16.b1:1.17/bf16.b2:1.0/bf16.b4:0.72/bf16.b8:0.6/bf16.prompt:0.6"
    "/fp16.b1:0.98/fp16.b4:0.66/fp16.prompt:0.2"
)
# A CPU with fast bf16 everywhere (AMX), where the one-token attention by matmuls loses to fused sdpa.
AMX = (
    "cpu,flags=amx_bf16+avx512_bf16,calib=bf16.b1:1.9/bf16.b2:1.9/bf16.b4:1.9/bf16.b8:1.9/bf16.prompt:2.0"
    "/bf16.attention:0.9"
)


def _line(res: wd.Resolution, topic: str) -> str:
    return " | ".join(s.message for s in res.trace if s.topic == topic)


def _config(tmp_path: Path, dtype: str, model_type: str = "llama") -> str:
    folder = tmp_path / f"{model_type}-{dtype}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": dtype}))
    return str(folder)


def test_batch_one_decodes_in_bf16_where_measured_faster_and_the_trace_quotes_it():
    with simulate(EPYC):
        res = wd.resolve_device(batch_size=1, max_length=160, max_new_tokens=128)
    assert res.dtype_name == "bfloat16"
    assert "bf16 decode 1.17x fp32 here at batch 1" in _line(res, "dtype")
    assert "bf16 decode 1.17x" in _line(res, "calibration")


def test_batch_four_stays_in_fp32_where_emulated_bf16_arithmetic_loses():
    with simulate(EPYC):
        res = wd.resolve_device(batch_size=4, max_length=160)
    assert res.dtype_name == "float32"
    line = _line(res, "dtype")
    assert "bf16 decode 0.72x fp32 here at batch 4" in line and "fp32 is exact" in line


def test_a_slow_prompt_outweighs_a_faster_decode_step():
    # The same decode figures; with prompt-sized bf16 at 0.1x fp32 the prompt's share decides.
    with simulate(EPYC.replace("bf16.prompt:0.6", "bf16.prompt:0.1")):
        res = wd.resolve_device(batch_size=1, max_length=160)
    assert res.dtype_name == "float32" and "prompt 0.10x" in _line(res, "dtype")


def test_the_job_that_was_assumed_is_said():
    with simulate(EPYC):
        res = wd.resolve_device()
    assert "batch 1 assumed (pass batch_size=)" in _line(res, "dtype")
    assert "256 tokens assumed (pass max_length=)" in _line(res, "dtype")


def test_native_bf16_flags_do_not_win_against_measured_figures():
    slow = "cpu,flags=avx512_bf16,calib=bf16.b1:0.8/bf16.b2:0.8/bf16.b4:0.8/bf16.b8:0.8/bf16.prompt:0.5"
    with simulate(slow):
        inference = wd.resolve_device(batch_size=2)
        training = wd.resolve_device(task="training")
    assert inference.dtype_name == "float32"
    assert training.mixed_precision is None and training.training_kwargs()["bf16"] is False
    assert "prompt-sized bf16 matmul runs 0.50x fp32" in _line(training, "dtype")


def test_training_uses_bf16_autocast_where_prompt_sized_bf16_is_measured_faster():
    with simulate(AMX):
        res = wd.resolve_device(task="training")
    assert res.mixed_precision == "bf16" and res.dtype_name == "float32"
    assert "2.00x fp32" in _line(res, "dtype")


def test_fp16_is_only_kept_for_an_fp16_checkpoint_never_cast_to(tmp_path):
    fast_fp16 = "cpu,flags=,calib=fp16.b1:1.5/fp16.b2:1.5/fp16.prompt:1.5/bf16.b1:1.1/bf16.b2:1.1/bf16.prompt:1.1"
    with simulate(fast_fp16):
        fp16 = wd.resolve_device(model=_config(tmp_path, "float16"), device_map="cpu", batch_size=1)
        fp32 = wd.resolve_device(model=_config(tmp_path, "float32"), device_map="cpu", batch_size=1)
        bf16 = wd.resolve_device(model=_config(tmp_path, "bfloat16"), device_map="cpu", batch_size=1)
    assert fp16.dtype_name == "float16"
    assert fp32.dtype_name == "bfloat16" and "(the checkpoint is float32)" in _line(fp32, "dtype")
    assert bf16.dtype_name == "bfloat16"


@pytest.mark.parametrize("model_type", ["gemma2", "t5"])
def test_measured_speed_never_puts_an_fp16_unsafe_model_in_fp16(tmp_path, model_type):
    fast_fp16 = "cpu,flags=,calib=fp16.b1:3/fp16.b2:3/fp16.prompt:3/bf16.b1:0.5/bf16.b2:0.5/bf16.prompt:0.5"
    with simulate(fast_fp16):
        res = wd.resolve_device(model=_config(tmp_path, "float16", model_type), device_map="cpu", batch_size=1)
    assert res.dtype_name == "float32"


def test_the_decode_attention_follows_its_measured_speed(tmp_path):
    path = save_tiny_llama(tmp_path / "tiny", tokenizer=False)  # 4 heads over 2 key/value heads
    # The grouped-query figure decides; the multi-head one (plain matmuls), however good, does not.
    loses = AMX.replace("bf16.attention:0.9", "bf16.gqa:0.9/bf16.attention:5")
    wins = AMX.replace("bf16.attention:0.9", "bf16.gqa:1.6")
    with simulate(loses):
        lost = wd.resolve_device(model=path, batch_size=1)
    with simulate(wins):
        chosen = wd.resolve_device(model=path, batch_size=1)
    assert lost.dtype_name == chosen.dtype_name == "bfloat16"
    assert lost.attn_implementation == "sdpa" and not lost.attn_passed
    assert "grouped by key/value head measured 0.90x torch's fused kernel" in _line(lost, "attention")
    assert chosen.attn_implementation == "sdpa" and chosen.attn_passed and chosen.tuning.decode_attention
    assert lost.tuning is None or not lost.tuning.decode_attention
    assert "measured 1.60x" in _line(chosen, "attention")


def test_a_simulated_cpu_without_figures_keeps_to_its_flags(monkeypatch, tmp_path):
    monkeypatch.setenv(calibration.ENV_CALIBRATION, str(tmp_path))
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    with simulate("cpu,flags=avx512_bf16"):
        res = wd.resolve_device()
    assert res.dtype_name == "bfloat16"
    assert "the simulated CPU has no calib= figures; the CPU's flags decide" in _line(res, "calibration")


def test_turned_off_the_flag_rule_applies_and_the_trace_says_so(cpu_kind):
    res = wd.resolve_device(refresh=True)
    assert res.dtype_name == cpu_kind.dtype
    # every kind says it the same way, the simulated native-bf16 CPU (without calib= figures) included
    assert "WHICHDEVICE_CALIBRATION=off turns calibration off; the CPU's flags decide" in _line(res, "calibration")


def test_a_bad_calib_spec_names_the_form():
    with pytest.raises(DeviceError, match=r"calib=.*dtype\.shape:number.*bf16\.b1:1\.15"):
        simulate("cpu,calib=bf16.b3:1.1")
    with pytest.raises(DeviceError, match="calib= applies to cpu"):
        simulate("cuda:1,calib=bf16.b1:1.1")


# ---------------------------------------------------------------------------------- the cache

FIGURES = cpu_timing.Measured(
    {"bf16.b1": 1.2, "bf16.b2": 1.1, "bf16.b4": 0.9, "bf16.b8": 0.7, "bf16.prompt": 0.4, "bf16.attention": 1.3},
    {"b1": 1e-3, "b2": 1.2e-3, "b4": 1.4e-3, "b8": 1.8e-3, "prompt": 6e-5},
    {},
    2,
    [],
)


def _must_not_measure(*args: object) -> None:
    raise AssertionError("measured although it must not")


MEASURED: list[float] = []


@pytest.fixture
def cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Calibration on, with its cache in tmp_path and the timing replaced by fixed figures."""
    monkeypatch.setenv(calibration.ENV_CALIBRATION, str(tmp_path / "cache"))
    MEASURED.clear()
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: MEASURED.append(budget_s) or FIGURES)
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    # A quiet machine, whatever else runs beside the tests (a busy one's figures are not kept).
    monkeypatch.setattr(calibration, "_load", lambda: 0.0)
    probing.clear_cache()
    return tmp_path / "cache"


def test_measured_once_then_read_from_the_cache(cache_dir, monkeypatch):
    res = wd.resolve_device(batch_size=1, max_length=256, max_new_tokens=128)
    assert res.dtype_name == "bfloat16" and "measured now" in _line(res, "calibration")
    files = list(cache_dir.glob("cpu-calibration-*.json"))
    assert len(files) == 1 and len(MEASURED) == 1
    assert json.loads(files[0].read_text())["key"]["threads"] == torch.get_num_threads()
    # A fresh process: nothing remembered in memory, the file answers, nothing is measured.
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    again = wd.resolve_device(batch_size=1, max_length=256, max_new_tokens=128, refresh=True)
    assert again.dtype_name == "bfloat16" and f"cached in {files[0]}" in _line(again, "calibration")


def test_a_damaged_cache_file_is_measured_over_and_rewritten(cache_dir, monkeypatch):
    path = calibration.cache_path()
    cache_dir.mkdir(parents=True)
    for damage in ("{not json", json.dumps({"key": "x"}), json.dumps([1, 2])):
        path.write_text(damage)
        monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
        calib, why = calibration.calibration()
        assert calib is not None and "measured now" in why
        assert json.loads(path.read_text())["speeds"]["bf16.b1"] == 1.2
    assert not list(cache_dir.glob(".calibration-*"))  # no temporary file left behind


def test_another_onednn_cap_is_another_machine(cache_dir, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the suite may run capped
    plain = calibration.cache_path()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert calibration.cache_path() != plain


def test_unsteady_figures_are_not_used_nor_measured_again_by_the_next_process(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: FIGURES._replace(unsteady=["b4", "prompt"]))
    calib, why = calibration.calibration()
    assert calib is not None and calib.unsteady == ("b4", "prompt") and "timed steadily: b4, prompt" in why
    assert "those are not used, and jobs that need them follow the flags" in why
    assert "bf16.b4" not in calib.speeds and "prompt" not in calib.fp32 and calib.speed("bfloat16", "b1") == 1.2
    assert "whichdevice calibrate" not in why  # nothing the user of a busy node could do
    res = wd.resolve_device(refresh=True)  # every job's estimate reads the prompt figure, which moved
    assert "prompt could not be timed steadily" in _line(res, "calibration")
    assert "the CPU's flags decide its dtype" in _line(res, "calibration")
    # The next process reads the busy verdict instead of paying for the timing again...
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    assert calibration.calibration()[0].unsteady == ("b4", "prompt")  # type: ignore[union-attr]
    # ...nor once it is old enough, while the machine is as busy as it was...
    measured_at_load = json.loads(calibration.cache_path().read_text())["load"]
    monkeypatch.setattr(calibration, "RETRY_S", -1)
    busy = (measured_at_load or 0) + 2 * (os.cpu_count() or 1)
    monkeypatch.setattr(calibration, "_load", lambda: busy)
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    assert calibration.calibration()[0].unsteady == ("b4", "prompt")  # type: ignore[union-attr]
    # ...until a call finds it quieter: then it is measured again.
    monkeypatch.setattr(calibration, "_load", lambda: 0.0)
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: FIGURES)
    calib, why = calibration.calibration()
    assert calib is not None and "measured now" in why


def test_an_unsteady_verdict_on_a_node_that_stays_busy_is_measured_again_after_hours(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: FIGURES._replace(unsteady=["s1"]))
    monkeypatch.setattr(calibration, "_load", lambda: 50.0)
    assert calibration.calibration()[0] is None
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: FIGURES)
    assert calibration.calibration()[0] is None  # as busy as then, and only just measured
    monkeypatch.setattr(calibration, "RETRY_MAX_S", -1)
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    MEASURED.clear()
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: MEASURED.append(budget_s) or FIGURES)
    calibration.calibration()
    assert MEASURED  # measured again; while every core is still busy its figures are not kept either


def test_without_a_cache_only_an_auto_dtype_measures(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    res = wd.resolve_device(dtype="float32")
    assert res.dtype_name == "float32" and _line(res, "calibration") == ""


def test_the_real_timing_gives_every_figure_or_says_it_ran_out_of_time():
    # How far it gets depends on how busy this machine is; what it reports must not.
    speeds, fp32, memory, threads, unsteady = cpu_timing.measure(budget_s=0.5)
    shapes = {"b1", "b2", "b4", "b8", "prompt", "s1", "s4"}
    assert set(fp32) <= shapes | {"p4", "sn1", "pp"}  # p4 and pp only where this torch packs weights
    # The packed prompt is timed in the plain prompt's rounds: never without it.
    assert "prompt" in fp32 or "pp" not in fp32
    assert {f"{shape} (out of time)" for shape in shapes - set(fp32)} <= set(unsteady)
    # The narrow set is timed in the batch-1 step's rounds: both figures or neither.
    assert ("sn1" in fp32) == ("s1" in fp32)
    if "sn1" in fp32:
        assert memory["narrow"] > memory["calls"] >= 2 and memory["narrow_stream"] <= memory["stream"]
    # A dtype found hopeless at batch 1 (emulated fp16) is not timed further: its figure stands for the rest.
    live = [d for d in ("bf16", "fp16") if speeds.get(f"{d}.b1", 0) >= cpu_timing.HOPELESS]
    # fp16 is not packed (no fp16.p4 or fp16.pp); bf16 only where this CPU's oneDNN packs it (a real try).
    bf16_packs = "bfloat16" in packable_dtypes()
    expected = {f"{d}.{s}" for d in live for s in fp32 if s not in ("p4", "pp") or (d == "bf16" and bf16_packs)}
    assert expected <= set(speeds)
    assert bf16_packs or not any(name in speeds for name in ("bf16.p4", "bf16.pp"))
    assert all(v > 0 for v in [*speeds.values(), *fp32.values(), *memory.values()])
    assert threads == torch.get_num_threads()
    # Every figure passes the check a cache file's figures pass when read back.
    for name, value in [*speeds.items(), *((f"fp32.{k}", v) for k, v in fp32.items())]:
        calibration.check_figure(name, value)
    for name, value in memory.items():
        calibration.check_figure(f"mem.{name}", value)
    assert memory["llc"] > 0 and memory["stream"] * 2 >= 2 * memory["llc"]  # the bf16 set outgrows the cache


# ---------------------------------------------------------------------- command and report


def test_the_command_measures_and_prints_the_figures(cache_dir, capsys):
    assert cli.main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "decode b1" in out and "1.20x" in out and "cached in" in out
    assert cli.main(["calibrate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "calibration" and data["used"] is True and data["speeds"]["bf16.prompt"] == 0.4


def test_the_command_refuses_a_simulation(capsys):
    assert cli.main(["calibrate", "--simulate", "cpu"]) == 2
    assert "cpu,calib=" in capsys.readouterr().err


def test_the_report_carries_figures_that_replay():
    report = gather(tasks=("inference",), simulate=[EPYC])
    entry = report["calibration"]
    assert entry["figures"]["speeds"]["bf16.b1"] == 1.17 and entry["why"].startswith("simulated")
    with simulate(f"cpu,flags=,calib={entry['spec']}"):
        replayed = wd.resolve_device(batch_size=1, max_length=160)
    with simulate(EPYC):
        original = wd.resolve_device(batch_size=1, max_length=160)
    assert _line(replayed, "dtype") == _line(original, "dtype")


# ------------------------------------------------------------- figures and files read back


BAD_FIGURES = ["bf16.b1:inf", "bf16.b1:nan", "bf16.b1:-5", "bf16.b1:0", "bf16.b1:1e300", "fp32.b1:1e300"]


@pytest.mark.parametrize("figure", BAD_FIGURES)
def test_a_spec_or_a_report_with_an_impossible_figure_is_refused(figure):
    with pytest.raises(DeviceError, match=rf"calib=.*{re.escape(figure.split(':')[0])}.*from .* to "):
        simulate(f"cpu,calib=bf16.b2:1.0/{figure}")
    with simulate("cpu,flags="):
        machine = json.loads(json.dumps(gather(tasks=("inference",))))
    machine["calibration"] = {"why": "measured", "spec": f"bf16.b2:1.0/{figure}"}
    with pytest.raises(DeviceError, match="'calibration' section is damaged"), simulate(report=machine):
        pass


@pytest.mark.parametrize(("field", "value"), [("bf16.b1", -5), ("bf16.b1", math.nan), ("bf16.b4", 1e300), ("b1", 0)])
def test_an_impossible_figure_in_the_cache_is_measured_again_and_the_file_named(cache_dir, field, value):
    wd.resolve_device(batch_size=1)  # measures and writes the cache
    path = calibration.cache_path()
    data = json.loads(path.read_text())
    data["speeds" if "." in field else "fp32_seconds"][field] = value
    path.write_text(json.dumps(data))
    calibration._answers.clear()
    res = wd.resolve_device(batch_size=1, refresh=True)  # no ZeroDivisionError, no "-5.00x"
    line = _line(res, "calibration")
    assert f"the cache file {path} is damaged" in line and "measured now" in line
    assert "1.20x" in line and len(MEASURED) == 2
    assert json.loads(path.read_text())["speeds"]["bf16.b1"] == 1.2  # rewritten with good figures


def _valid_cache_elsewhere(cache_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    calibration.calibration()  # measures and writes this machine's file
    path = calibration.cache_path()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(path.read_text().replace("1.2", "9.9"))
    path.unlink()
    calibration._answers.clear()
    return path, elsewhere


def test_a_symbolic_link_in_the_cache_is_neither_trusted_nor_written_through(cache_dir, tmp_path):
    path, elsewhere = _valid_cache_elsewhere(cache_dir, tmp_path)
    path.symlink_to(elsewhere)
    before = elsewhere.read_text()
    calib, why = calibration.calibration()
    assert calib is not None and calib.speeds["bf16.b1"] == 1.2  # measured, not the link's 9.9
    assert f"the cache file {path} is a symbolic link: not trusted, not read" in why
    assert "nothing is written through it" in why
    assert elsewhere.read_text() == before and path.is_symlink()


def test_a_cache_folder_that_is_a_link_is_not_written_through(monkeypatch, cache_dir, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "linked"
    link.symlink_to(real)
    monkeypatch.setenv(calibration.ENV_CALIBRATION, str(link))
    calib, why = calibration.calibration()
    assert calib is not None and f"the cache folder {link} is a symbolic link" in why
    assert list(real.iterdir()) == []


def test_a_cache_file_of_another_user_is_not_trusted(monkeypatch, cache_dir, tmp_path):
    path, elsewhere = _valid_cache_elsewhere(cache_dir, tmp_path)
    path.write_text(elsewhere.read_text())
    other = os.getuid() + 4242
    if os.getuid() == 0:
        os.chown(path, other, -1)
    else:  # only root can give a file away: the file stays ours and we claim another id
        monkeypatch.setattr(owned_files.os, "getuid", lambda: other)
    calib, why = calibration.calibration()
    assert calib is not None and calib.speeds["bf16.b1"] == 1.2
    assert f"the cache file {path} belongs to user id" in why and "not to you" in why


def test_threads_that_change_the_cache_setting_leave_no_stale_answer(cache_dir, monkeypatch):
    # Each resolution must file its answer under the one reading of the environment its memo key
    # holds: one resolved while another thread switched calibration off (or on) would be served to
    # every later call with the other value.
    wd.resolve_device()
    at = memo_variables().index(calibration.ENV_CALIBRATION)
    stop, stale = threading.Event(), []

    def toggle() -> None:
        while not stop.is_set():
            os.environ[calibration.ENV_CALIBRATION] = "off"
            os.environ[calibration.ENV_CALIBRATION] = str(cache_dir)

    def resolve() -> None:
        for _ in range(30):
            wd.resolve_device(refresh=True)  # refresh: every call resolves, none is served
            for key, res in list(store.current_store().resolutions.items()):
                off = "turns calibration off" in _line(res, "calibration")
                if off != (key[1][at] in ("off", b"off")):
                    stale.append(key[1][at])

    threads = [threading.Thread(target=toggle), *(threading.Thread(target=resolve) for _ in range(4))]
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
    finally:
        stop.set()
        threads[0].join()
        monkeypatch.setenv(calibration.ENV_CALIBRATION, str(cache_dir))
    assert stale == []


def test_the_memory_figures_and_the_load_survive_the_cache(cache_dir, monkeypatch):
    streamed = FIGURES._replace(
        speeds={**FIGURES.speeds, "bf16.s1": 1.9, "bf16.s4": 4.5, "bf16.g1": 3.5},
        fp32={**FIGURES.fp32, "s1": 8e-3, "s4": 2.5e-2},
        memory={"llc": 33554432.0, "cache": 4194304.0, "stream": 33554432.0, "read": 30.5},
    )
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: streamed)
    monkeypatch.setattr(calibration, "_load", lambda: 0.42)
    calibration.calibration()
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    calib, why = calibration.calibration()
    assert calib is not None and "cached in" in why
    assert calib.memory == streamed.memory and calib.load == 0.42 and calib.speed("bfloat16", "g1") == 3.5
    # The spec a report carries replays every figure, memory included.
    replayed = calibration.parse_figures(calib.spec())
    assert replayed.memory == calib.memory and replayed.speeds == calib.speeds


@pytest.mark.parametrize("entry", ["mem.llc:12", "mem.read:1e9", "mem.bogus:3", "bf16.g9:1.2"])
def test_an_impossible_memory_figure_is_refused_with_its_range(entry):
    with pytest.raises(ValueError, match=re.escape(entry.split(":")[0])):
        calibration.parse_figures(entry)


def test_a_hiccup_is_measured_again_at_once_but_a_machine_out_of_time_is_not(cache_dir, monkeypatch):
    answers = [FIGURES._replace(unsteady=["s1"]), FIGURES]
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: answers.pop(0))
    calib, _ = calibration.calibration()
    assert calib is not None and not answers  # measured twice, the steady second one used
    busy = [FIGURES._replace(unsteady=["b8 (out of time)"]), FIGURES]
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: busy.pop(0))
    assert calibration.run_calibration().unsteady == ("b8 (out of time)",) and len(busy) == 1
    twice = [FIGURES._replace(unsteady=["b4"]), FIGURES._replace(unsteady=["s4"]), FIGURES, FIGURES]
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: twice.pop(0))
    assert calibration.run_calibration().unsteady == () and len(twice) == 1  # two hiccups, then steady
    stuck = [FIGURES._replace(unsteady=["b4"]) for _ in range(calibration.HICCUP_RETRIES + 2)]
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: stuck.pop(0))
    assert calibration.run_calibration().unsteady == ("b4",) and len(stuck) == 1  # at most HICCUP_RETRIES more


def test_figures_measured_while_every_core_was_busy_are_not_kept_as_the_machines(cache_dir, monkeypatch):
    monkeypatch.setattr(calibration, "_load", lambda: float(os.cpu_count() or 1) + 1)
    monkeypatch.setattr(cpu_timing, "measure", _sleeping_measure)  # others had the cores
    calib, why = calibration.calibration()
    assert calib is None and why.startswith(calibration.UNSTEADY) and "measured again once" in why
    assert "whichdevice calibrate" not in why  # a shared node stays busy: nothing to ask of its user
    # The report names it once; each resolution's trace has one short line, and the flags decide.
    from whichdevice.report.gather import gather as gather_report

    report = gather_report(tasks=("inference", "training"))
    named = [w for w in report["warnings"] if w["source"] == "calibration"]
    assert len(named) == 1 and calibration.UNSTEADY in named[0]["message"]
    for entry in report["resolutions"]:
        (line,) = [s["message"] for s in entry["resolution"]["trace"] if s["topic"] == "calibration"]
        assert line.startswith("not used: ") and line.endswith("the CPU's flags decide") and len(line) < 160
    monkeypatch.setattr(calibration, "_load", lambda: 0.0)  # quieter a minute later: measured again
    monkeypatch.setattr(calibration, "RETRY_S", -1)
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    assert calibration.calibration()[0] is not None


# ------------------------------------------------------------------ a calibration in part steady

STREAMED = FIGURES._replace(
    speeds={**FIGURES.speeds, "bf16.s1": 1.9, "bf16.s4": 1.8, "bf16.g1": 3.5, "bf16.p4": 3.4, "bf16.pp": 0.45},
    fp32={**FIGURES.fp32, "s1": 8e-3, "s4": 2.5e-2, "p4": 9e-3, "pp": 4.5e-5},
    memory={"llc": 33554432.0, "cache": 4194304.0, "stream": 33554432.0, "read": 30.5, "pack": 2.0},
)


def test_the_packed_figures_are_shown_over_their_plain_twins(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: STREAMED)
    text = render_calibration(calibration.run_calibration())
    assert "packed b4***" in text and "packed pr***" in text and "0.45x" in text  # bf16's packed prompt over fp32's
    assert "fp32 packed b4: 2.78x fp32's own streamed b4" in text
    assert "fp32 packed prompt: 1.33x fp32's own prompt" in text  # 6e-5 over 4.5e-5 a row
    assert "fp32 prompt with packed weights 1.33x" in calibration.calibration()[0].summary()  # type: ignore[union-attr]


def _flags_say(monkeypatch: pytest.MonkeyPatch, **job: int) -> str | None:
    """The dtype this CPU's flags give the job (calibration off), whatever this CPU has."""
    with monkeypatch.context() as off:
        off.setenv(calibration.ENV_CALIBRATION, "off")
        return wd.resolve_device(refresh=True, **job).dtype_name


def test_a_shape_that_moved_costs_only_the_jobs_that_read_it(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: STREAMED._replace(unsteady=["s4"]))
    calib, why = calibration.calibration()
    assert calib is not None and "timed steadily: s4; those are not used" in why
    # "s4" covers the packed step timed in its rounds; "s1" and torch's GEMV beside it stay.
    assert calib.speed("bfloat16", "p4") is None and "p4" not in calib.fp32 and calib.speed("bfloat16", "g1") == 3.5
    assert "-" in calib.summary() and "3.50x" in calib.summary()
    one = wd.resolve_device(batch_size=1, max_length=256, refresh=True)  # 1B assumed: streamed, batch 1
    assert one.dtype_name == "bfloat16" and "3.50x through torch's GEMV kernel" in _line(one, "dtype")
    four = wd.resolve_device(batch_size=4, max_length=256, refresh=True)
    assert "s4 could not be timed steadily" in _line(four, "calibration")
    assert four.dtype_name == _flags_say(monkeypatch, batch_size=4, max_length=256) and four.tuning is None


def test_a_streamed_model_whose_step_moved_is_not_read_as_cache_resident(cache_dir, monkeypatch):
    # Without "s1" the estimate would fall back to the cache-resident "b1" figures, the wrong regime.
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: STREAMED._replace(unsteady=["s1"]))
    res = wd.resolve_device(batch_size=1, refresh=True)
    assert "s1 could not be timed steadily" in _line(res, "calibration")
    assert res.dtype_name == _flags_say(monkeypatch, batch_size=1) and res.tuning is None


def test_training_whose_prompt_figure_moved_follows_the_flags(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: STREAMED._replace(unsteady=["prompt"]))
    calib, _ = calibration.calibration()
    # "prompt" covers the packed prompt timed in its rounds, and only that.
    assert calib is not None and "pp" not in calib.fp32 and calib.speed("bfloat16", "pp") is None
    assert calib.fp32["p4"] == 9e-3 and calib.lost("pp") and not calib.lost("p4")
    res = wd.resolve_device(task="training", refresh=True)
    assert "prompt-sized matmul could not be timed steadily, the CPU's flags decide" in _line(res, "dtype")
    with monkeypatch.context() as off:
        off.setenv(calibration.ENV_CALIBRATION, "off")
        flags = wd.resolve_device(task="training", refresh=True)
    assert res.mixed_precision == flags.mixed_precision


@pytest.mark.parametrize("unsteady", [["s4 (out of time)"], ["b1", "all (load 3.0 on 2 cores)"]])
def test_a_busy_machines_calibration_is_not_used_in_part(cache_dir, monkeypatch, unsteady):
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: STREAMED._replace(unsteady=unsteady))
    calib, why = calibration.calibration()
    assert calib is None and why.startswith(calibration.UNSTEADY)


def test_a_report_replays_which_shapes_were_lost(cache_dir, monkeypatch):
    moved = STREAMED._replace(unsteady=["s4", "bf16 attention"])
    monkeypatch.setattr(cpu_timing, "measure", lambda budget_s=1.0: moved)
    calib, _ = calibration.calibration()
    assert calib is not None and calib.spec().endswith("/lost:s4")
    assert "jobs whose estimate needs them" in render_calibration(calibration.run_calibration())
    replayed = calibration.parse_figures(calib.spec())
    assert replayed.lost("s4") and replayed.lost("p4") and not replayed.lost("s1")
    assert replayed.speeds == calib.speeds and "s4" not in replayed.fp32
    with simulate(f"cpu,flags=avx512_bf16,calib={calib.spec()}"):
        four = wd.resolve_device(batch_size=4, max_length=256)
        one = wd.resolve_device(batch_size=1, max_length=256)
    assert "s4 could not be timed steadily" in _line(four, "calibration")
    assert "3.50x through torch's GEMV kernel" in _line(one, "dtype")
    with pytest.raises(ValueError, match="lost:shape"):
        calibration.parse_figures("bf16.b1:1.2/lost:s4+g9")


def _sleeping_measure(budget_s: float = 1.0) -> cpu_timing.Measured:
    # Wall time passes, the threads do not run: what a calibration beside busy processes sees.
    time.sleep(0.3)
    return STREAMED._replace(unsteady=["s4"])


def test_a_run_whose_threads_did_not_get_the_cores_is_not_used_even_in_part(cache_dir, monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(cpu_timing, "measure", _sleeping_measure)
    monkeypatch.setattr(calibration, "_load", lambda: cores / 2)  # the trailing load average: half busy
    calib, why = calibration.calibration()
    assert calib is None and why.startswith(calibration.UNSTEADY)
    unsteady = json.loads(calibration.cache_path().read_text())["unsteady"]
    assert any("its threads ran" in name and f"load {cores / 2:.1f}" in name for name in unsteady)
    # The next process reads that verdict from the cache instead of timing the busy machine again.
    monkeypatch.setattr(calibration, "_answers", type(calibration._answers)())
    monkeypatch.setattr(cpu_timing, "measure", _must_not_measure)
    calib, why = calibration.calibration()
    assert calib is None and why.startswith(calibration.UNSTEADY)


def test_a_load_of_work_that_ended_does_not_throw_away_a_run_that_had_the_cores(cache_dir, monkeypatch):
    # The 1-minute load average still reads every core busy after a job ends; the run's own threads
    # ran all of its wall time, so its figures are the machine's.
    cores = os.cpu_count() or 1
    monkeypatch.setattr(calibration, "_load", lambda: float(cores))
    monkeypatch.setattr(cpu_timing, "measure", _sleeping_measure)
    monkeypatch.setattr(calibration, "_cpu_seconds", lambda: time.perf_counter() * STREAMED.threads)
    calib, why = calibration.calibration()
    assert calib is not None and calib.unsteady == ("s4",) and "all (load" not in why
    # Where they ran less than QUIET_SHARE of it, the load is taken at its word.
    slower = calibration.QUIET_SHARE * 0.9 * STREAMED.threads
    monkeypatch.setattr(calibration, "_cpu_seconds", lambda: time.perf_counter() * slower)
    busy = calibration.run_calibration()
    assert any(name.startswith(f"all (load {cores:.1f} on {cores} cores, its threads ran") for name in busy.unsteady)


def test_a_quiet_machines_hiccup_is_used_in_part_whatever_its_threads_ran(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_timing, "measure", _sleeping_measure)
    calib, why = calibration.calibration()  # the fixture's load: 0.0
    assert calib is not None and calib.unsteady == ("s4",) and "its threads ran" not in why


# ------------------------------------------------------------ a memory limit (issue 57)
_UNDER_LIMIT = """
import resource, sys
cap = 800 * 1024 * 1024  # torch imports under it; the calibration's timing tensors do not fit
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import whichdevice as wd
res = wd.resolve_device()
print(res.device)
print(res.explain())
print(wd.resolve_device(dtype="auto").explain())
"""


def _without_calibration_switch(tmp_path: Path) -> dict[str, str]:
    from steering import STEERING

    env = {k: v for k, v in os.environ.items() if k not in STEERING and k != "WHICHDEVICE_CALIBRATION"}
    return env | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}


def test_a_calibration_that_cannot_allocate_falls_back_to_the_flags_once_and_caches_nothing(tmp_path):
    import subprocess
    import sys

    env = _without_calibration_switch(tmp_path)
    done = subprocess.run([sys.executable, "-c", _UNDER_LIMIT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "cpu"
    lines = [line for line in done.stdout.splitlines() if "the calibration could not run" in line]
    assert len(lines) == 2  # one per resolution's trace, each one line
    assert "ulimit -v, now 819200" in lines[0] and "ulimit -v unlimited" in lines[0]
    assert "the CPU's flags decide" in lines[0]
    assert not (tmp_path / "xdg" / "whichdevice").exists()  # nothing cached


def test_the_command_under_the_memory_limit_says_it_once_and_exits_0(tmp_path):
    import subprocess
    import sys

    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (800 << 20, 800 << 20));"
        "from whichdevice.cli import main; raise SystemExit(main([]))"
    )
    env = _without_calibration_switch(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("the calibration could not run") == 1
    assert "internal error" not in done.stdout + done.stderr
