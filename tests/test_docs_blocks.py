"""Every fenced python, bash and console block of README.md and docs/ runs, or says why it cannot.

The blocks run together in one child process (``tests/scripts/run_doc_blocks.py``: the imports once,
a fork per block), then each block is reported as its own test: passed, failed with its output, or
skipped with the reason its ``test="skip: ..."`` gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from doc_blocks import ROOT, Block, all_blocks, disallowed, is_output, printed_where, python_source, shell_commands

BLOCKS = [block for block in all_blocks() if block.lang in ("python", "bash", "console")]
RUNNER = ROOT / "tests" / "scripts" / "run_doc_blocks.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("doc-blocks")
    todo = [
        {
            "id": block.id,
            "lang": block.lang,
            "python": python_source(block) if block.lang == "python" else "",
            "commands": shell_commands(block) if block.lang != "python" else [],
            "exits": list(block.exits),
        }
        for block in BLOCKS
        if block.runs
    ]
    (work / "blocks.json").write_text(json.dumps(todo), encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(work / "cache"),  # the blocks' calibration, not this user's
        "HF_HUB_OFFLINE": "1",
    }
    for name in ("WHICHDEVICE_DEVICE", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    command = [sys.executable, str(RUNNER), str(work / "blocks.json"), str(work / "results.json"), str(work)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"the block runner failed:\n{proc.stdout}\n{proc.stderr}"
    loaded: dict[str, Any] = json.loads((work / "results.json").read_text(encoding="utf-8"))
    return loaded


def test_every_block_is_runnable_or_says_why() -> None:
    assert BLOCKS, "no code blocks found in README.md and docs/"
    quiet = [b.id for b in BLOCKS if b.skip is not None and b.skip in ("", "no reason given")]
    assert not quiet, f"blocks skipped without a reason: {quiet}"
    unsafe = {
        b.id: sorted({w for line in shell_commands(b) for w in disallowed(line)})
        for b in BLOCKS
        if b.runs and b.lang != "python" and any(disallowed(line) for line in shell_commands(b))
    }
    assert not unsafe, (
        f'shell blocks that would run commands the docs test never runs; mark them test="skip: ...": {unsafe}'
    )


def test_every_output_block_is_generated_or_says_where_it_was_printed() -> None:
    """Issue 58: blocks of output said neither the machine that printed them nor that they were
    simulated, so a reader took another machine's answer for theirs."""
    from whichdevice.testing.spec import parse_spec

    output = [block for block in all_blocks() if is_output(block)]
    unlabelled = [block.id for block in output if printed_where(block) is None]
    assert not unlabelled, (
        f"output blocks that say neither where they were printed nor that they were simulated: {unlabelled}; "
        "put them in a part docs/generate.py writes, or begin them with '# printed on: MACHINE' or "
        "'# simulated: \"SPEC\"' (see tests/doc_blocks.py)"
    )
    for block in output:
        kind, specs = printed_where(block) or ("", [])
        for spec in specs if kind == "simulated" else []:
            parse_spec(spec)  # a label names a spec simulate() takes, or this raises with the reason
    quiet = [b.id for b in all_blocks() if b.not_output == "no reason given"]
    assert not quiet, f"blocks marked not output without saying what they are: {quiet}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_doc_block(block: Block, results: dict[str, Any]) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    if block.signature:
        pytest.skip("a signature, compared with the code by test_docs_api.py")
    result = results[block.id]
    assert result["ok"], (
        f"{block.id} ({block.lang}) failed, exit statuses {result['codes']} (allowed {list(block.exits)}):\n"
        f"{result['output']}"
    )
