"""nox sessions: tests, the transformers 4.57 end-to-end run, Ray Train, lint, bench and docs (`nox -l` lists them)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# A bare torch requirement pulls a multi-GB CUDA build; the pinned CPU build comes first.
TORCH = "torch==2.13.0"


def install(session: nox.Session, *extras: str, pins: tuple[str, ...] = ()) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install(target, *pins)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite against the newest transformers here."""
    install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session(python="3.11", name="tests-transformers-4.57")
def tests_transformers_457(session: nox.Session) -> None:
    """End-to-end, training and attention tests against transformers 4.57.6 (the oldest supported)."""
    # Only the test runner besides the pin: the test extra's peft/bitsandbytes/kernels track the
    # newest transformers and are not what this session is about.
    install(session, pins=("transformers==4.57.6", "pytest>=8", "hypothesis>=6"))
    session.run(
        "pytest",
        "tests/test_end_to_end.py",
        "tests/test_training.py",
        "tests/test_distributed.py",
        "tests/test_resolver.py",
        "tests/test_decode_attention.py",
        *session.posargs,
    )


@nox.session(python="3.11", name="tests-ray")
def tests_ray(session: nox.Session) -> None:
    """The Ray Train row of the launch matrix: ray[train] is large, so the default run skips it."""
    install(session, "test", pins=("ray[train]>=2.60",))
    session.run("pytest", "tests/test_distributed.py", "-k", "ray", *session.posargs, env={"WHICHDEVICE_TEST_RAY": "1"})


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy --strict on src/."""
    install(session, "dev", "quantization")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("mypy")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmark: prints a table of medians and ratios and writes benchmarks/results/latest.json."""
    install(session, "quantization")
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the user docs with mkdocs in strict mode (broken links fail)."""
    session.install("mkdocs>=1.6")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
