"""mkdocs hook: drop the docs test's ``test="..."`` from a code fence before the page is rendered.

Python-Markdown's fenced_code reads only a bare language after the fence; ``python test="tiny-model"``
would otherwise turn the block into a paragraph. GitHub already ignores the rest of the info string.
"""

from __future__ import annotations

import re
from typing import Any

_TEST = re.compile(r'^(```[\w+-]*)[ \t]+test="[^"]*"[ \t]*$', re.M)


def on_page_markdown(markdown: str, **_kwargs: Any) -> str:
    return _TEST.sub(r"\1", markdown)
