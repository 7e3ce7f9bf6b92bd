"""Run the documentation's code blocks: one process imports torch and transformers once, each block runs in a fork.

Usage: run_doc_blocks.py BLOCKS.json RESULTS.json WORKDIR. BLOCKS.json is a list of
{"id", "lang", "python", "commands", "exits"}; RESULTS.json maps each id to {"ok", "output", "seconds"}.
A fork per block keeps the blocks apart (their variables, environment and whichdevice's memo) while
the imports are paid once, which keeps the whole docs test near a minute on two busy cores. A bash
line that is a plain ``whichdevice ...`` command runs the command's own ``main()`` in a fork; any
other line runs under bash.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMEOUT = 240
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHELL = set("|&;<>()$`*?")


def _in_fork(work: Callable[[], int], log: Path, cwd: Path) -> int:
    """Run ``work`` in a child with stdout and stderr sent to ``log``; its exit status, or 124 on timeout."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = work()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 124


def _python(source: str, namespace: dict[str, Any]) -> Callable[[], int]:
    def work() -> int:
        exec(compile(source, "<doc block>", "exec"), dict(namespace))
        return 0

    return work


def _whichdevice(words: list[str]) -> Callable[[], int] | None:
    """A fork-run of the command's main() for ``[VAR=value ...] whichdevice args``, else None."""
    env: dict[str, str] = {}
    while words and _ASSIGN.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words or words[0] != "whichdevice":
        return None

    def work() -> int:
        os.environ.update(env)
        from whichdevice.cli import main

        return main(words[1:])

    return work


def _command(line: str, bin_dir: str) -> Callable[[], int]:
    if not (set(line) & _SHELL):
        work = _whichdevice(shlex.split(line))
        if work is not None:
            return work

    def shell() -> int:
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        return subprocess.run(["bash", "-c", line], env=env, check=False).returncode

    return shell


def main(argv: list[str]) -> int:
    blocks = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    work_root = Path(argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch  # noqa: F401  (paid once, before the forks)
    import transformers  # noqa: F401

    import whichdevice as wd
    from doc_blocks import disallowed
    from tiny_models import RandomTokens, save_tiny_llama

    model = save_tiny_llama(work_root / "tiny-model")
    namespace = {"__name__": "__main__", "wd": wd, "path": str(model), "train_dataset": RandomTokens(n=4)}
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"  # blocks that call whichdevice
    results: dict[str, Any] = {}
    for block in blocks:
        cwd = Path(tempfile.mkdtemp(prefix="block-", dir=work_root))
        log = cwd.parent / f"{cwd.name}.log"
        start = time.perf_counter()
        if block["lang"] == "python":
            codes = [_in_fork(_python(block["python"], namespace), log, cwd)]
            ok = codes[0] == 0
        else:
            codes = []
            for line in block["commands"]:
                with log.open("a", encoding="utf-8") as f:
                    f.write(f"$ {line}\n")
                if disallowed(line):  # never pip, never a launcher: the test marks such blocks skip
                    codes.append(126)
                    continue
                codes.append(_in_fork(_command(line, bin_dir), log, cwd))
            ok = all(code in block["exits"] for code in codes)
        output = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        ok = ok and "Traceback (most recent call last)" not in output
        results[block["id"]] = {
            "ok": ok,
            "codes": codes,
            "output": output[-6000:],
            "seconds": time.perf_counter() - start,
        }
    Path(argv[1]).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
