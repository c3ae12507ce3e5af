"""How long `accelfn dry-run` takes at full scale on this machine, and how much host memory it uses.

Each row runs `accelfn dry-run` on examples/train_llama.py (a `transformers` Llama config, no weights) in a
fresh process and reads the child's peak RSS (`resource.getrusage(RUSAGE_CHILDREN)` via /usr/bin/time-free
`os.wait4`). The targets (issue 20): 8B fsdp over 64 ranks <= 60 s, 70B dp8 x tp8 fsdp + remat over 64 ranks
<= 120 s, 405B tp8 x fsdp over 1024 ranks <= 300 s, each <= 4 GiB of host memory. The 70B and 405B models are
built on the meta device (`--init meta`): built on the host, every rank would hold them whole, more than a node's
memory (the dry run says so and exits 3).

    python benchmarks/dry_run.py            # prints a markdown table (docs/benchmarks.md)
    python benchmarks/dry_run.py --search   # with the largest-micro-batch search (a few more steps)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "train_llama.py"

ROWS = [  # name, launch shape, mesh, script args, target seconds
    ("8B, fsdp, 64 ranks", ("8", "8"), "dp=64", ("--model", "8b", "--strategy", "fsdp"), 60),
    ("70B, dp8 x tp8, fsdp + remat, 64 ranks", ("8", "8"), "dp=8,tp=8",
     ("--model", "70b", "--strategy", "fsdp", "--remat", "--init", "meta"), 120),
    ("405B, tp8 x fsdp128, remat, 1024 ranks", ("8", "128"), "dp=128,tp=8",
     ("--model", "405b", "--strategy", "fsdp", "--remat", "--init", "meta"), 300),
]  # fmt: skip
COMMON = ("--seq-len", "2048", "--batch-size", "1", "--bf16")


def run(row: tuple, search: bool) -> dict:
    name, (nproc, nnodes), mesh, args, target = row
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "accelfn.cli.main", "dry-run", "--nproc-per-node", nproc, "--nnodes", nnodes,
               "--mesh", mesh, "--json", str(out), *(() if search else ("--no-search",)), str(SCRIPT), *args, *COMMON]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        stdout, stderr = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 3):
            raise SystemExit(f"{name}: exit {code}\n{stdout}\n{stderr[-4000:]}")
        report = json.loads(out.read_text())
    return {
        "name": name,
        "seconds": seconds,
        "target": target,
        "rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "peak_gib": report["per_rank"]["peak"] / 2**30,
        "fits": report["fits"],
        "step_ms": report["predicted"]["step_time_s"] * 1e3,
        "mfu": report["predicted"]["mfu"],
        "max_micro_batch": report["max_micro_batch"],
        "init_host_node_gib": report["init"]["host_per_node"] / 2**30,
        "init_device_gib": report["init"]["device_peak"] / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--search", action="store_true", help="also search the largest micro-batch")
    p.add_argument("--only", type=int, default=None, help="run one row (0-based)")
    args = p.parse_args()
    rows = ROWS if args.only is None else [ROWS[args.only]]
    print("| configuration (H100 SXM, bf16 autocast, seq 2048, micro-batch 1) | dry-run time | target | "
          "host peak RSS | predicted peak / GPU | before step 1: host per node, device | fits | predicted step | "
          "MFU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = run(row, args.search)
        print(
            f"| {r['name']} | {r['seconds']:.1f} s | <= {r['target']} s | {r['rss_gib']:.2f} GiB | "
            f"{r['peak_gib']:.1f} GiB | {r['init_host_node_gib']:,.1f} GiB, {r['init_device_gib']:.1f} GiB | "
            f"{'yes' if r['fits'] else 'no'} | {r['step_ms']:,.0f} ms | {r['mfu']:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
