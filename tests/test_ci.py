"""``.ci/run``: both of the README's test commands run, and CI fails when either fails (issue 58).

The script reads its commands from README.md beside it, so each case copies it next to a README whose
commands are small Python one-liners that exit as the case needs and leave a file behind when they ran.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = """\
Install and run the tests:

```bash
python3 -c "import pathlib, sys; pathlib.Path('first-ran').touch(); sys.exit({first})"
```

The tests whose answer depends on the CPU, once more as on a CPU without native bf16:

```bash
ONEDNN_MAX_CPU_ISA=AVX512_CORE python3 -c "import pathlib, sys; pathlib.Path('second-ran').touch(); sys.exit({second})"
```
"""


def _ci(tmp_path: Path, first: int, second: int) -> subprocess.CompletedProcess[str]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(README.format(first=first, second=second), encoding="utf-8")
    # python3 on PATH is this interpreter, so the commands run wherever the tests run.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(("first", "second", "status"), [(0, 0, 0), (3, 0, 1), (0, 4, 1), (3, 4, 1)])
def test_ci_runs_both_commands_and_fails_when_either_fails(
    tmp_path: Path, first: int, second: int, status: int
) -> None:
    proc = _ci(tmp_path, first, second)
    assert (tmp_path / "first-ran").exists() and (tmp_path / "second-ran").exists(), proc.stdout + proc.stderr
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert f"first command {first}, second command {second}" in proc.stdout


def test_ci_finds_both_commands_in_the_real_readme() -> None:
    # The same patterns as .ci/run's awk lines: the README's two commands, each on a line of its own.
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    first = lines.index("Install and run the tests:")
    opening = "The tests whose answer depends on the CPU, once more"
    second = next(i for i, line in enumerate(lines) if line.startswith(opening))
    assert any(line.startswith("python3 ") and "pytest" in line for line in lines[first:second])
    assert any(line.startswith("ONEDNN_MAX_CPU_ISA=") and "pytest" in line for line in lines[second:])


def test_the_readme_says_how_long_the_suite_takes_and_how_to_run_the_fast_part() -> None:
    import tomllib

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    tests = text.split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"whole suite takes about [0-9]+ minutes", tests), (
        "README.md does not say how long the suite takes"
    )
    assert 'python -m pytest -m "not slow"' in tests
    # The marker the fast part leaves out is registered (--strict-markers) and marks tests.
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("slow:") for m in markers["markers"]) and "--strict-markers" in markers["addopts"]
    marked = [p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.slow" in p.read_text(encoding="utf-8")]
    assert marked, "no test is marked slow"
