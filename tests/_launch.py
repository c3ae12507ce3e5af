"""Start a worker script on N local CPU processes, the way users do, for multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(
    script: Path, nproc: int, args: tuple[str, ...], launch_args: tuple[str, ...] = ()
) -> list[str]:
    """The command line that starts `nproc` CPU processes running `script` (the one place to change it).

    `launch_args` are extra `accelfn launch` options (not available under ACCELFN_TEST_TORCHRUN=1)."""
    if (ROOT / "accelfn" / "cli" / "main.py").exists() and os.environ.get("ACCELFN_TEST_TORCHRUN") != "1":
        return [sys.executable, "-m", "accelfn.cli.main", "launch", *launch_args, "--nproc-per-node", str(nproc), "--cpu",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), *args]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]  # fmt: skip


def run_workers(
    script: str,
    nproc: int,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    launch_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run `tests/workers/<script>` on `nproc` processes; return the finished process (output as text)."""
    path = WORKERS / script
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELFN_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    full_env.pop("WORLD_SIZE", None)
    full_env.update(env or {})
    proc = subprocess.run(
        launch_command(path, nproc, args, launch_args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    return proc


def output_of(proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )


def expect_ok(proc: subprocess.CompletedProcess[str], configs: list[str], ranks: int) -> None:
    """A worker run of `model[:option...]` configs succeeded: every rank printed `rank R: OK model [options]`
    for each (`save=...` options left out), and `OK errors` for an `errors` config."""
    out = output_of(proc)
    assert proc.returncode == 0, out
    for c in configs:
        kind, *options = c.split(":")
        if kind == "errors":
            assert proc.stdout.count("OK errors") == ranks, out
            continue
        options = sorted(o for o in options if not o.startswith("save="))
        for r in range(ranks):
            assert f"rank {r}: OK {kind} {options}" in proc.stdout, out
