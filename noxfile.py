"""Developer sessions: `nox -s fast tests lint docs bench demo` (each in its own venv, torch pinned)."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True
TORCH = "torch==2.13.0"


def _install(session: nox.Session, extras: str = "") -> None:
    session.install(TORCH)
    session.install("-c", "constraints.txt", "-e", f".{extras}")


# two pytest workers, each taking whole files (a module's fixtures are built once): about 34 minutes for the
# suite on the 2-core CI machine, against 45 one test at a time
PARALLEL = ("-n", "2", "--dist", "loadfile")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (the README's test command, in a nox venv)."""
    _install(session, "[test]")
    session.run("python", "-m", "pytest", *PARALLEL, *session.posargs)


@nox.session
def fast(session: nox.Session) -> None:
    """The inner loop: the about 1,900 tests not marked `slow` (most multi-process launches and long dry runs are),
    about 11 minutes on 2 cores; `nox -s fast -- tests/test_x.py` narrows it further."""
    _install(session, "[test]")
    session.run("python", "-m", "pytest", "-m", "not slow", *PARALLEL, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check on everything (as CI), mypy on the package."""
    _install(session)
    session.install("ruff", "mypy", "types-PyYAML")
    session.run("ruff", "format", "--check")
    session.run("ruff", "check")
    session.run("mypy", "accelfn")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ (strict: broken links fail)."""
    _install(session, "[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks side by side with their peers; paste the tables into docs/benchmarks.md."""
    _install(session, "[test]")
    scripts = [
        "step_overhead.py",
        "compile_speedup.py",
        "ddp_scaling.py",
        "launch_latency.py",
        "checkpoint_io.py",
        "big_model.py",
        "offload_overlap.py",
        "engine_ab.py",
    ]
    for script in session.posargs or [f"benchmarks/{s}" for s in scripts]:
        session.run("python", script)


@nox.session
def demo(session: nox.Session) -> None:
    """The README demo: a small byte-level GPT on the text shipped in examples/data."""
    _install(session)
    session.run("python", "examples/train_lm.py")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Verify a GPU machine (GPU tests, the demo on the GPU, throughput): `bash benchmarks/verify_gpu.sh`.

    Runs with the machine's own python and torch (no venv); under 9 minutes on one H100.
    """
    session.run("bash", "benchmarks/verify_gpu.sh", external=True)
