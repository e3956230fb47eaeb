"""One nox session per concern. Every session installs from constraints.txt (torch stays the CPU build)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "tests", "examples"]
nox.options.reuse_existing_virtualenvs = True

CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str) -> None:
    # torch first and alone: with it pinned to the local CPU wheel, nothing later can pull a CUDA build.
    session.install(*CONSTRAINTS, "torch")
    session.install(*CONSTRAINTS, "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The full test suite, slow tests included, with the CI hypothesis profile."""
    _install(session, "test,plot,hf")
    # worksteal: an idle worker takes queued tests from the busy one (the slow tests would otherwise end on one)
    session.run(
        "pytest",
        "-n",
        "2",
        "--dist",
        "worksteal",
        "--hypothesis-profile",
        "ci",
        "--durations=30",  # every CI log names the 30 slowest tests: where the suite's time goes
        *session.posargs,
        env={"D9DFN_TEST_PROFILE": "ci"},
    )


@nox.session
def examples(session: nox.Session) -> None:
    """The README's commands that compile longer than a test may take, run compiled as written, shortened (about 4
    minutes on 2 cores): d9d's Qwen3-MoE job on 4 ranks, compiled against eager (``tests/readme_examples.py``)."""
    _install(session, "test,plot,hf")
    session.run("python", "tests/readme_examples.py")


@nox.session
def quick(session: nox.Session) -> None:
    """The edit-test loop: every test not marked slow (nor ranks, compiled or cli, which imply it); CI's ``tests``
    runs them all."""
    _install(session, "test,hf")
    session.run("pytest", "-n", "2", "--dist", "worksteal", "-m", "not slow", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff format --check, ruff check, and the layer contracts of pyproject.toml (``lint-imports``)."""
    session.install(*CONSTRAINTS, "ruff", "import-linter")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("lint-imports")  # reads the import graph from ./d9dfn; the package need not be installed


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy as configured in pyproject.toml: strict on the pure core, bodies checked on the edge."""
    # mypy reads torch's, pydantic's, optree's, hypothesis' and the tokenizers' (tokenizers, transformers) own types
    _install(session, "test,plot,hf")
    session.install(*CONSTRAINTS, "mypy")
    session.run("mypy", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: ratios against baselines run in the same process."""
    _install(session, "test")
    session.run("python", "benchmarks/step_speed.py", *session.posargs)


@nox.session(name="bench-dp")
def bench_dp(session: nox.Session) -> None:
    """Data-parallel scaling on forked gloo ranks: bytes per step against the minimum, 1 vs 2 ranks' step time."""
    _install(session, "test")
    session.run("python", "benchmarks/dp_scaling.py", *session.posargs)


@nox.session(name="bench-memory")
def bench_memory(session: nox.Session) -> None:
    """Peak bytes per rank by category (params, gathered, grads, optimizer, activations) per placement and depth."""
    _install(session, "test")
    session.run("python", "benchmarks/memory.py", *session.posargs)


@nox.session(name="bench-pp")
def bench_pp(session: nox.Session) -> None:
    """Pipeline schedules on forked gloo ranks: each rank's measured idle fraction beside the simulator's."""
    _install(session, "test")
    session.run("python", "benchmarks/pipeline.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``d9dfn train`` on its embedded default, then ``d9dfn infer``."""
    _install(session, "plot")
    session.run("d9dfn", "train", *session.posargs)
    session.run("d9dfn", "infer")
