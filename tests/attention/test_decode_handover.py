"""Keywords that need no whichdevice on the other side (issue 54): what model_kwargs(), pipeline_kwargs()
and the command's --json hand over names an attention transformers knows ("sdpa"), and res.prepare(model)
installs whichdevice's decode path on the loaded model; the prepared model keeps it through pickling,
torch.save and spawn into a fresh process (its pickle registers the name there), and unprepare() takes
it back. What each step announces is read back from the model: the config's name and the function
transformers runs for it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import whichdevice as wd
from handover_worker import generate_and_read_back
from tiny_models import save_tiny_llama
from whichdevice.report import load_schema
from whichdevice.testing import simulate

pytestmark = pytest.mark.slow

# A CPU with native bf16, no calibration: the decode attention is chosen from its flags for a
# grouped-query model (the tiny Llama: 4 heads over 2 key/value heads), the same on every machine.
BF16_CPU = "cpu,flags=avx512_bf16"
TESTS = Path(__file__).resolve().parents[1]
DECODE = "whichdevice.attention.decode_forward.decode_attention_forward"
SDPA = "transformers.integrations.sdpa_attention.sdpa_attention_forward"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("handover") / "tiny", dtype=torch.float32, tokenizer=False)


def _resolved(path: Path) -> wd.Resolution:
    with simulate(BF16_CPU):
        return wd.resolve_device(model=str(path), dtype="bfloat16")


def _fresh_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a fresh interpreter that never imports whichdevice itself."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300, cwd=TESTS
    )


LOADER = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, pipeline

kwargs = json.loads(sys.argv[2])
dtype = kwargs.pop("dtype", None)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, dtype) if dtype else None, **kwargs)
ids = torch.tensor([[5, 6, 7, 8]])
out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
assert "whichdevice" not in sys.modules
print(json.dumps({"attention": model.config._attn_implementation, "new": out.shape[1] - 4}))
"""


def _loaded_elsewhere(path: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    proc = _fresh_python(LOADER, str(path), json.dumps(kwargs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_the_commands_json_keywords_load_and_generate_where_whichdevice_never_was(path: Path):
    """Issue 54: a scheduler reading `whichdevice --json` got attn_implementation="whichdevice_sdpa", which
    from_pretrained refuses ("is not supported") in a process that never imported whichdevice."""
    report = subprocess.run(
        [sys.executable, "-m", "whichdevice", "--json", "--task", "inference", "--model", str(path),
         "--simulate", BF16_CPU],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    data = json.loads(report.stdout)
    jsonschema.Draft202012Validator(load_schema()).validate(data)  # schema 1.9: tuning.decode_attention
    (res,) = [r["resolution"] for r in data["resolutions"] if r["task"] == "inference"]
    kwargs = {"device_map": res["device_map"], "dtype": res["dtype"]}
    if res["attn_implementation_passed"]:
        kwargs["attn_implementation"] = res["attn_implementation"]
    assert _loaded_elsewhere(path, kwargs) == {"attention": "sdpa", "new": 3}
    # A name transformers knows is handed over, and prepare() would install the decode path over it.
    assert kwargs.get("attn_implementation") == "sdpa" and res["tuning"]["decode_attention"] is True


def test_model_kwargs_and_pipeline_kwargs_load_where_whichdevice_never_was(path: Path):
    res = _resolved(path)
    kwargs = {k: (str(v).removeprefix("torch.") if k == "dtype" else v) for k, v in res.model_kwargs().items()}
    assert _loaded_elsewhere(path, kwargs) == {"attention": "sdpa", "new": 3}
    inner = res.pipeline_kwargs()["model_kwargs"]
    assert inner.get("attn_implementation") == "sdpa"


def test_what_is_announced_is_what_runs_before_and_after_prepare(path: Path):
    from transformers import AutoModelForCausalLM

    res = _resolved(path)
    assert res.attn_implementation == "sdpa" and res.attn_passed and res.tuning and res.tuning.decode_attention
    line = next(s.message for s in res.trace if s.topic == "attention")
    assert line.startswith("sdpa handed over") and "res.prepare(model) runs whichdevice_sdpa" in line, line
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval()
    loaded = generate_and_read_back(model)
    assert loaded["attention"] == res.attn_implementation and loaded["function"] == SDPA
    res.prepare(model)
    prepared = generate_and_read_back(model)
    assert (prepared["attention"], prepared["function"]) == ("whichdevice_sdpa", DECODE)
    assert prepared["one_token_calls"] == 2 * model.config.num_hidden_layers  # every decode step of every layer
    res.unprepare(model)
    back = generate_and_read_back(model)
    assert (back["attention"], back["function"]) == ("sdpa", SDPA) and back["tokens"] == loaded["tokens"]
    assert type(model.config._attn_implementation) is str


def _prepared(path: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    res = _resolved(path)
    model = res.prepare(AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval())
    return model, generate_and_read_back(model)


def test_a_prepared_model_sent_to_a_spawned_worker_runs_its_decode_path_there(path: Path):
    """Issue 54: the spawned worker's first forward raised KeyError: 'whichdevice_sdpa' is not a valid
    attention implementation registered in the AttentionInterface."""
    import torch.multiprocessing as mp

    from handover_worker import spawned

    model, here = _prepared(path)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    worker = context.Process(target=spawned, args=(model, queue))
    worker.start()
    there = queue.get()
    worker.join(timeout=120)
    assert "error" not in there, there["error"]
    assert there == here and there["function"] == DECODE


def test_a_prepared_model_torch_saved_runs_its_decode_path_after_torch_load_in_a_fresh_process(
    path: Path, tmp_path: Path
):
    model, here = _prepared(path)
    torch.save(model, tmp_path / "model.pt")
    proc = _fresh_python("import sys, handover_worker; handover_worker.loaded(sys.argv[1])", str(tmp_path / "model.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in there, there["error"]
    assert there.pop("whichdevice_before") is False
    assert there == here and there["function"] == DECODE


def test_save_pretrained_of_a_prepared_model_writes_no_attention(path: Path, tmp_path: Path):
    model, _ = _prepared(path)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "whichdevice" not in json.dumps(config)
