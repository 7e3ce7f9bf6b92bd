"""docs/generate.py itself: its command line, and a regeneration that changes a page only when the
code's output changed (issue 58)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import generate  # noqa: E402  (docs/generate.py)

PAGE = """\
# A page

<!-- generated:smoke-output -->
```text
$ whichdevice smoke    # printed on: a CPU, 2 cores, torch 2.13.0
[1/2] inference on cpu ... ok (0.41 s)
```
<!-- /generated -->
"""


def _pages() -> dict[str, str]:
    return {page.as_posix(): hashlib.sha256(page.read_bytes()).hexdigest() for page in generate.pages()}


def test_help_prints_the_options_and_writes_nothing() -> None:
    before = _pages()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "generate.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python docs/generate.py"), proc.stdout
    assert "--check" in proc.stdout and "--refresh-samples" in proc.stdout
    assert _pages() == before, "python docs/generate.py --help rewrote a page"


def test_a_sample_whose_figures_changed_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another run of smoke: the same lines, other timings. The page must not churn.
    same_form = "```text\n$ whichdevice smoke    # printed on: a CPU, 2 cores, torch 2.13.0\n"
    same_form += "[1/2] inference on cpu ... ok (0.97 s)\n```\n"
    monkeypatch.setitem(generate.GENERATORS, "smoke-output", lambda: same_form)
    assert generate.regenerate(PAGE) == PAGE
    assert generate.drifted_parts(PAGE) == []
    # Asked to, it takes the new figures.
    assert "0.97 s" in generate.regenerate(PAGE, refresh_samples=True)


def test_a_sample_whose_form_changed_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    other_form = "```text\n$ whichdevice smoke    # printed on: a CPU, 2 cores, torch 2.13.0\n"
    other_form += "[1/3] inference on cpu ... ok (0.41 s)\n[2/3] training on cpu ... ok (1.20 s)\n```\n"
    monkeypatch.setitem(generate.GENERATORS, "smoke-output", lambda: other_form)
    fresh = generate.regenerate(PAGE)
    assert "training on cpu" in fresh and "[1/2]" not in fresh
    assert generate.drifted_parts(PAGE) == ["smoke-output"]


def test_the_detection_order_on_the_page_is_the_registrys() -> None:
    import whichdevice as wd

    text = (ROOT / "docs" / "detection-order.md").read_text(encoding="utf-8")
    assert "<!-- generated:detection-order -->" in text
    assert f"```text\n{', '.join(b.name for b in wd.backends())}\n```" in text
