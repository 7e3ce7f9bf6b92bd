"""The fenced code blocks of README.md and docs/**/*.md, with what each needs to run (its ``test="..."``).

A block's info string may carry ``test="..."`` after the language; the value is a list of items
separated by ``;``:

- ``skip: REASON``: not run; REASON becomes the pytest skip reason ("needs a GPU", "needs the network").
- ``tiny-model``: ``"path/to/model"`` and the Hub id ``"gpt2"`` become one tiny local Llama, and
  the name ``path`` holds it; ``train_dataset=...`` becomes a few random token sequences.
- ``simulate:SPEC``: a python block runs inside ``whichdevice.testing.simulate(SPEC)``.
- ``hub``: a python block runs with HF_ENDPOINT pointed at a local Hub (tests/hub_server.py) that
  serves the header-only checkpoints of tests/hub_fixtures.py under their Hub ids
  ("meta-llama/Llama-3.1-8B", ...): the Hub ids of a page resolve for real, from metadata.
- ``exit:N,M``: the exit statuses a bash line may end with (default 0; ``whichdevice check cuda``
  on a machine without a GPU ends with 1).
- ``continues``: a python block that goes on from the page's previous python block (runs both).
- ``signature``: a python block that states a signature, not code; not run.
- ``not output: REASON``: a text, json or console block that is not what a program printed (a
  synopsis, a list): it needs no label (see below).

A text, json or console block with output in it is *output*, and says where it was printed (issue 58):
it sits in a part ``docs/generate.py`` writes, or its first line carries a label, as a comment the
reader sees: ``# printed on: MACHINE`` (a real machine, named), ``# simulated: "SPEC"`` (each spec one
that ``simulate()`` takes, checked), or a ``whichdevice ... --simulate SPEC`` command.

Every python block starts with ``import whichdevice as wd`` done, as the API page's first block says.
``mkdocs_hooks.py`` strips ``test="..."`` before mkdocs renders a page, so GitHub and mkdocs both
see a plain language.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ("python", "bash", "console")
# A shell line runs only when every command in it is one of these: a doc that says "pip install" or
# "torchrun" must be marked skip, so the docs test never changes an environment or needs hardware.
ALLOWED_COMMANDS = ("whichdevice", "python", "python3", "echo", "exit")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
# A part docs/generate.py writes (the same markers as its _PART).
_GENERATED = re.compile(r"<!-- generated:(?P<name>[\w-]+) -->\n.*?<!-- /generated -->", re.S)
OUTPUT_LANGS = ("text", "json", "console")
_PRINTED_ON = re.compile(r"#\s*printed on:\s*\S")
_SIMULATED = re.compile(r'#\s*simulated:\s*(?P<specs>"[^"]+"(?:\s*,\s*"[^"]+")*)')
_SIMULATE_OPTION = re.compile(r"^\$ (?:\w+=\S+ )*whichdevice .*--simulate(?:=|\s+)(?P<spec>\"[^\"]+\"|'[^']+'|\S+)")
_FENCE = re.compile(
    r'^```(?P<lang>[\w+-]*)(?:[ \t]+test="(?P<test>[^"]*)")?[ \t]*\n(?P<body>.*?)^```[ \t]*$', re.M | re.S
)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code and its test items."""

    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    tiny_model: bool = False
    simulate: str | None = None
    hub: bool = False
    exits: tuple[int, ...] = (0,)
    signature: bool = False
    prefix: str = ""
    not_output: str | None = None
    generated: str | None = None
    items: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and self.skip is None and not self.signature


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _block(page: str, line: int, lang: str, code: str, test: str, previous: str, generated: str | None) -> Block:
    items = tuple(item.strip() for item in test.split(";") if item.strip())
    kwargs: dict[str, object] = {}
    for item in items:
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "skip":
            kwargs["skip"] = value or "no reason given"
        elif key == "tiny-model":
            kwargs["tiny_model"] = True
        elif key == "simulate":
            kwargs["simulate"] = value
        elif key == "hub":
            kwargs["hub"] = True
        elif key == "exit":
            kwargs["exits"] = tuple(int(v) for v in value.split(","))
        elif key == "continues":
            kwargs["prefix"] = previous
        elif key == "signature":
            kwargs["signature"] = True
        elif key == "not output":
            kwargs["not_output"] = value or "no reason given"
        else:
            raise ValueError(f'{page}:{line}: unknown test item {item!r} in test="{test}"')
    return Block(page, line, lang, code, items=items, generated=generated, **kwargs)  # type: ignore[arg-type]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page."""
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(ROOT).as_posix()
    found: list[Block] = []
    previous = ""
    parts = [(m.start(), m.end(), m.group("name")) for m in _GENERATED.finditer(text)]
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        lang, code = match.group("lang"), match.group("body")
        generated = next((name for start, end, name in parts if start <= match.start() < end), None)
        block = _block(page, line, lang, code, match.group("test") or "", previous, generated)
        if lang == "python":
            previous = block.prefix + code
        found.append(block)
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def python_source(block: Block) -> str:
    """The code a python block runs: its prefix, the model substitution, the simulation around it."""
    code = block.prefix + block.code
    if block.tiny_model:
        code = code.replace('"path/to/model"', "path").replace('"gpt2"', "path")
        code = code.replace("train_dataset=...", "train_dataset=train_dataset")
    if block.simulate:
        body = "".join(f"    {line}\n" if line.strip() else "\n" for line in code.splitlines())
        code = f"from whichdevice.testing import simulate as _simulate\nwith _simulate({block.simulate!r}):\n{body}"
    if block.hub:
        body = "".join(f"    {line}\n" if line.strip() else "\n" for line in code.splitlines())
        code = f"from hub_server import docs_hub as _docs_hub\nwith _docs_hub():\n{body}"
    return code


def shell_commands(block: Block) -> list[str]:
    """The commands of a bash or console block, one per logical line, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    commands = []
    for raw in text.splitlines():
        line = raw.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            commands.append(line)
    return commands


def disallowed(command: str) -> list[str]:
    """The command words of a shell line that the docs test will not run (empty when it may run it)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    bad, first = [], True
    for token in lexer:
        if token in ("&&", "||", "|", ";", "&"):
            first = True
        elif first and not _ASSIGN.match(token):
            first = False
            if token not in ALLOWED_COMMANDS:
                bad.append(token)
    if "pytest" in command.split():  # the test suite inside the test suite
        bad.append("pytest")
    return bad


def is_output(block: Block) -> bool:
    """Whether a block shows what a program printed: a text or json block not marked otherwise, or a
    console block with a line that is not a ``$`` command."""
    if block.lang not in OUTPUT_LANGS or block.not_output is not None:
        return False
    if block.lang == "console":
        return any(line.strip() and not line.startswith("$ ") for line in block.code.splitlines())
    return True


def printed_where(block: Block) -> tuple[str, list[str]] | None:
    """Where an output block says it was printed: ("generated", [part]), ("printed on", []) or
    ("simulated", [its specs]); None when it does not say."""
    if block.generated is not None:
        return "generated", [block.generated]
    first = next((line for line in block.code.splitlines() if line.strip()), "")
    if _PRINTED_ON.search(first):
        return "printed on", []
    if simulated := _SIMULATED.search(first):
        return "simulated", re.findall(r'"([^"]+)"', simulated.group("specs"))
    if option := _SIMULATE_OPTION.match(first):
        return "simulated", [option.group("spec").strip("\"'")]
    return None
