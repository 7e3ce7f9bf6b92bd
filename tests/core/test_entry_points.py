"""whichdevice.core.entry_points: the same entry points importlib.metadata finds, for the two groups read."""

from __future__ import annotations

import importlib.metadata
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from whichdevice.core import entry_points as scan

WD, TORCH = scan.WHICHDEVICE_GROUP, scan.TORCH_GROUP


def _dist(folder: Path, name: str, version: str, entry_points: str | None, suffix: str = "dist-info") -> None:
    info = folder / f"{name}-{version}.{suffix}"
    info.mkdir(parents=True)
    (info / ("METADATA" if suffix == "dist-info" else "PKG-INFO")).write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n"
    )
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def _seen(
    eps: tuple[importlib.metadata.EntryPoint, ...] | list[importlib.metadata.EntryPoint],
) -> list[tuple[str, str, str | None]]:
    return sorted((ep.name, ep.value, ep.dist.name if ep.dist is not None else None) for ep in eps)


def _both_agree() -> None:
    for group in scan.GROUPS:
        assert _seen(scan.entry_points(group)) == _seen(list(importlib.metadata.entry_points(group=group))), group


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(first, "wd_plug_a", "1.0", f"[{WD}]\nadev = wd_plug_a:RECORD\n\n[console_scripts]\na = wd_plug_a:main\n")
    _dist(first, "wd-plug.both", "2.0", f"[{TORCH}]\nbothdev = wd_plug_both:autoload\n[{WD}]\nbdev = wd_plug_both:B\n")
    _dist(first, "wd_plug_none", "1.0", None)  # no entry_points.txt at all
    _dist(first, "wd_plug_egg", "0.1", f"[{WD}]\negg = wd_plug_egg:R\n", suffix="egg-info")
    # A later folder's package of a name already found is not the one imported: importlib skips it.
    _dist(second, "wd_plug_a", "9.9", f"[{WD}]\nshadowed = wd_plug_a_old:RECORD\n")
    _dist(second, "WD_Plug_None", "9.9", f"[{WD}]\nalso_shadowed = x:y\n")
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    return first, second


def test_the_entry_points_are_importlib_metadatas(plugins: tuple[Path, Path]) -> None:
    _both_agree()
    assert _seen(scan.entry_points(WD)) == [
        ("adev", "wd_plug_a:RECORD", "wd_plug_a"),
        ("bdev", "wd_plug_both:B", "wd-plug.both"),
        ("egg", "wd_plug_egg:R", "wd_plug_egg"),
    ]
    assert [ep.name for ep in scan.entry_points(TORCH)] == ["bothdev"]
    assert all(ep.group == TORCH for ep in scan.entry_points(TORCH))


def test_a_package_installed_since_is_found(plugins: tuple[Path, Path]) -> None:
    first, _ = plugins
    assert "later" not in [ep.name for ep in scan.entry_points(WD)]
    stamp = os.stat(first).st_mtime_ns
    _dist(first, "wd_plug_later", "1.0", f"[{WD}]\nlater = wd_plug_later:R\n")
    # A coarse filesystem clock could leave the folder's time unchanged within one tick: move it on.
    os.utime(first, ns=(time.time_ns(), max(stamp + 1, os.stat(first).st_mtime_ns)))
    assert "later" in [ep.name for ep in scan.entry_points(WD)]
    _both_agree()


def test_other_groups_and_other_searches_are_importlib_metadatas(
    plugins: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _seen(scan.entry_points("console_scripts")) == _seen(
        list(importlib.metadata.entry_points(group="console_scripts"))
    )
    # A zip on sys.path is read by importlib.metadata alone: its packages are found all the same.
    archive = tmp_path / "plugins.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("wd_plug_zip-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: wd_plug_zip\nVersion: 1.0\n\n")
        z.writestr("wd_plug_zip-1.0.dist-info/entry_points.txt", f"[{WD}]\nzipdev = wd_plug_zip:R\n")
    monkeypatch.syspath_prepend(str(archive))
    assert "zipdev" in [ep.name for ep in scan.entry_points(WD)]
    _both_agree()


def test_a_fifo_or_an_oversized_file_is_not_read(plugins: tuple[Path, Path]) -> None:
    """A package folder is untrusted: an entry_points.txt that is a FIFO would block a plain read
    forever, and one of gigabytes would be read whole. Neither is read; the other packages still are."""
    first, _ = plugins
    fifo = first / "wd_plug_fifo-1.0.dist-info"
    fifo.mkdir()
    os.mkfifo(fifo / "entry_points.txt")
    huge = first / "wd_plug_huge-1.0.dist-info"
    huge.mkdir()
    with open(huge / "entry_points.txt", "w") as fh:
        fh.write(f"[{WD}]\nhuge = wd_plug_huge:R\n")
        fh.truncate(scan._MAX_BYTES + 1)
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.extend(ep.name for ep in scan.entry_points(WD)), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "the scan blocked on a FIFO"
    assert "adev" in found and "huge" not in found
