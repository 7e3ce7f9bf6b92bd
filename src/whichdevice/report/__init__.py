"""The data behind the ``whichdevice`` command: gathered as JSON-safe dicts, rendered as text.

:func:`gather` builds the report (registry rows, the environment that steers device choice,
warnings, the resolutions, package versions) in the shape that ``report_schema.json`` documents;
:func:`render_text` turns it into the text a person reads or pastes into an issue; :func:`check`
answers ``whichdevice check``. One module per part:

- ``gather``: the report dict, its schema version, exit codes, ``--simulate``
- ``rows``: the BACKENDS section (one row per registry record, its device summary)
- ``environment``: the ENVIRONMENT section (per-backend rows derived from the registry)
- ``findings``: the WARNINGS section
- ``render``: text, colour and wrapping
- ``check``: the ``check`` subcommand's answer
- ``calibration``: the ``calibrate`` subcommand's table
"""

from __future__ import annotations

from whichdevice.core.errors import exit_code_for
from whichdevice.report.check import check
from whichdevice.report.findings import ACCELERATE_MIN_FOR_GAUDI, other_warnings
from whichdevice.report.gather import (
    SCHEMA_VERSION,
    SIMULATED_NOTICE,
    VERSION_PACKAGES,
    gather,
    load_schema,
    package_versions,
    simulation,
)
from whichdevice.report.render import Style, render_text, terminal_width, use_color
from whichdevice.report.rows import device_summary

# The names these had when the report was one module; tests and callers still use them.
_device_summary = device_summary
_other_warnings = other_warnings

__all__ = [
    "ACCELERATE_MIN_FOR_GAUDI",
    "SCHEMA_VERSION",
    "SIMULATED_NOTICE",
    "VERSION_PACKAGES",
    "Style",
    "check",
    "device_summary",
    "exit_code_for",
    "gather",
    "load_schema",
    "other_warnings",
    "package_versions",
    "render_text",
    "simulation",
    "terminal_width",
    "use_color",
]
