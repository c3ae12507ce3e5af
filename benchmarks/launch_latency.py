"""Wall time of a trivial 2-process job through `accelfn launch`, `torchrun` and `accelerate launch`.

Each rank initialises gloo, all-reduces one tensor and tears the group down; every process that runs
appends a line to a count file, so the table also says how many processes each launcher really ran.
Runs are interleaved (round-robin) so machine noise hits every launcher alike; the median is reported.

Usage:
    python benchmarks/launch_latency.py --reps 5 [--append docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(os.environ.get("RANK", "?") + "\\n")
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == dist.get_world_size()
    dist.destroy_process_group()
"""


def commands(script: str, count: str) -> dict[str, list[str]]:
    bindir = Path(sys.executable).parent
    accelfn = (
        str(bindir / "accelfn") if (bindir / "accelfn").exists() else shutil.which("accelfn") or "accelfn"
    )
    accelerate = (
        str(bindir / "accelerate") if (bindir / "accelerate").exists() else shutil.which("accelerate")
    )
    cmds = {
        "accelfn launch --nproc-per-node 2 --cpu": [
            accelfn,
            "launch",
            "--nproc-per-node",
            "2",
            "--cpu",
            script,
            count,
        ],
        "torchrun --nproc-per-node 2": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            script,
            count,
        ],
    }
    if accelerate:
        quiet = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        # accelerate 1.15 refuses --multi_gpu together with --cpu; without --cpu, on a machine with no GPU,
        # --multi_gpu runs the processes on CPU; --cpu alone silently runs one process (accelerate 1.15).
        cmds["accelerate launch --multi_gpu --num_processes 2 --cpu"] = [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--cpu",
            *quiet,
            script,
            count,
        ]
        cmds["accelerate launch --multi_gpu --num_processes 2"] = [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            *quiet,
            script,
            count,
        ]
        cmds["accelerate launch --num_processes 2 --cpu"] = [
            accelerate,
            "launch",
            "--num_processes",
            "2",
            "--cpu",
            *quiet,
            script,
            count,
        ]
    return cmds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--append", help="append a 'Launch latency' section with the results to this markdown file"
    )
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="launch_latency_"))
    script = tmp / "trivial.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    env["ACCELERATE_CONFIG_FILE"] = str(tmp / "none.yaml")  # ignore a user's accelerate config
    names = list(commands(str(script), "").keys())
    times: dict[str, list[float]] = {n: [] for n in names}
    procs: dict[str, set[int]] = {n: set() for n in names}
    failures: dict[str, int] = {n: 0 for n in names}
    for rep in range(args.reps):
        for i, name in enumerate(names):
            count = tmp / f"count-{rep}-{i}"
            cmd = commands(str(script), str(count))[name]
            start = time.perf_counter()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            elapsed = time.perf_counter() - start
            if r.returncode != 0:
                failures[name] += 1
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{name}: exit {r.returncode}: {last}", file=sys.stderr)
                continue
            times[name].append(elapsed)
            procs[name].add(len(count.read_text().splitlines()) if count.exists() else 0)

    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    try:
        import torch

        machine += f", torch {torch.__version__}"
    except ImportError:
        pass
    header = "| launcher command | median s | min s | processes that ran | runs |\n|---|---|---|---|---|"
    rows = []
    for name in names:
        t = times[name]
        med = f"{statistics.median(t):.2f}" if t else "-"
        low = f"{min(t):.2f}" if t else "-"
        ran = ", ".join(str(p) for p in sorted(procs[name])) or "-"
        rows.append(f"| `{name}` | {med} | {low} | {ran} | {len(t)} ok, {failures[name]} failed |")
    table = "\n".join([header, *rows])
    print(f"Machine: {machine}\n\n{table}")
    if args.append:
        text = (
            "\n## Launch latency\n\n"
            f"Trivial 2-process job (each rank: init gloo, all-reduce, destroy), median of {args.reps} interleaved runs.\n"
            f"Command: `python benchmarks/launch_latency.py --reps {args.reps}` ({time.strftime('%Y-%m-%d')}).\n"
            f"Machine: {machine}.\n\n{table}\n"
        )
        with open(args.append, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
