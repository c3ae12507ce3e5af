"""How long `accelfn plan` takes at full scale on this machine, and how much host memory it uses (issue 30 item 6).

Each row runs `accelfn plan` on an example script unmodified (a `transformers` config, no weights, built on the
meta device) in a fresh process and reads the peak RSS of the planner and of its two dry-run workers
(`os.wait4` on the planner: the largest of the processes it waited for). Dense rows: examples/train_llama.py,
which leaves its strategy, accumulation, pipeline schedule and micro-batches, compile and global batch to the
launch config ("auto"); remat is fixed by a flag, the global batch given here (2 sequences of 8192 per GPU for
8B and 70B, 1 for 405B); the plan searches the mesh (dp, tp, pp, cp; tp and cp inside a node) and those knobs.
The targets (issue 30): 8B on 64 GPUs <= 5 min, 70B on 256 <= 10, 405B on 512 <= 15, host memory <= 4 GiB.

Mixture-of-experts rows: examples/train_moe.py (Qwen3-MoE's published shapes), which leaves its mesh, strategy,
accumulation and offload to the plan (no pipeline, no compile knob); the plan also searches `ep`. Remat fixed
(full), sequences of 4096 (the example's longest), 4 per GPU (the dense rows' tokens per GPU). Targets by the
dense rows' at about the same parameters per GPU and world: Qwen3-30B-A3B on 64 <= 5 min (8B's world),
Qwen3-235B-A22B on 256 <= 10 min (70B's world, between 70B and 405B in parameters).

    python benchmarks/plan.py            # prints a markdown table
    python benchmarks/plan.py --only 0   # the 8B row
    python benchmarks/plan.py --only 3   # the Qwen3-30B-A3B row
    python benchmarks/plan.py --only 5   # the DeepSeek-V3 row
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
LLAMA = ROOT / "examples" / "train_llama.py"
MOE = ROOT / "examples" / "train_moe.py"
LLAMA_ARGS = ("--seq-len", "8192", "--bf16", "--init", "meta")
MOE_ARGS = ("--seq", "4096", "--bf16", "--init", "meta", "--remat", "full")

ROWS = [  # name, nproc per node, nodes, script, script args, target seconds, global batch (sequences)
    ("8B, 64 H100s", 8, 8, LLAMA, ("--model", "8b", "--remat", "selective", *LLAMA_ARGS), 300, 128),
    ("70B, 256 H100s", 8, 32, LLAMA, ("--model", "70b", "--remat", "full", *LLAMA_ARGS), 600, 512),
    ("405B, 512 H100s", 8, 64, LLAMA, ("--model", "405b", "--remat", "full", *LLAMA_ARGS), 900, 512),
    ("Qwen3-30B-A3B, 64 H100s", 8, 8, MOE, ("--model", "30b-a3b", *MOE_ARGS), 300, 256),
    ("Qwen3-235B-A22B, 256 H100s", 8, 32, MOE, ("--model", "235b-a22b", *MOE_ARGS), 600, 1024),
    # DeepSeek-V3 (671B, 256 routed experts, 8 per token) on 256 GPUs: the 405B row's target (its parameters)
    ("DeepSeek-V3 671B, 256 H100s", 8, 32, MOE, ("--model", "deepseek-v3", *MOE_ARGS), 900, 1024),
]


def run(row: tuple, budget_minutes: float) -> dict:
    name, nproc, nnodes, script, args, target, gbs = row
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "accelfn.cli.main", "plan", "--nproc-per-node", str(nproc), "--nnodes",
               str(nnodes), "--budget-minutes", str(budget_minutes), "--global-batch-size", str(gbs), "--no-progress", "--json", str(out),
               str(script), *args]  # fmt: skip
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        stdout, stderr = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 3):
            raise SystemExit(f"{name}: exit {code}\n{stdout}\n{stderr[-4000:]}")
        plan = json.loads(out.read_text())
    chosen = plan["chosen"] or {}
    return {
        "name": name,
        "seconds": seconds,
        "target": target,
        "rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "candidates": plan["candidates"],
        "dry_runs": plan["dry_runs"],
        "extrapolated": plan.get("extrapolated", 0),
        "tiers": plan["tiers"],
        "chosen": chosen.get("candidate", {}).get("label", "none fits"),
        "tokens": chosen.get("tokens_per_s_per_gpu"),
        "peak_gib": chosen["peak"] / 2**30 if chosen else None,
        "table": stdout,
        "load": (
            load_before,
            os.getloadavg()[0],
        ),  # the 1-minute load average before and after (shared machine)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=int, default=None, help="run one row (0-based)")
    p.add_argument(
        "--budget-minutes", type=float, default=None, help="the planner's budget (default: the target)"
    )
    p.add_argument("--verbose", action="store_true", help="also print each plan's table")
    args = p.parse_args()
    rows = ROWS if args.only is None else [ROWS[args.only]]
    print("| model, world (bf16, meta init) | plan time | target | host peak RSS (largest process) | "
          "candidates | dry runs (extrapolated) | fell: lowering / does not fit / dominated / time bound / budget | "
          "chosen | tokens/s/GPU | peak/GPU | load average (before, after) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        budget = args.budget_minutes or row[5] / 60 * 0.9
        r = run(row, budget)
        t = r["tiers"]
        print(
            f"| {r['name']} | {r['seconds']:.0f} s | <= {r['target']} s | {r['rss_gib']:.2f} GiB | "
            f"{r['candidates']} | {r['dry_runs']} ({r['extrapolated']}) | {t['lowering']} / {t['does not fit']} / "
            f"{t['dominated']} / {t['time bound']} / {t['budget']} | "
            f"{r['chosen']} | {r['tokens'] or 0:,.0f} | {r['peak_gib'] or 0:.1f} GiB | "
            f"{r['load'][0]:.1f}, {r['load'][1]:.1f} |",
            flush=True,
        )
        if args.verbose:
            print(r["table"])


if __name__ == "__main__":
    main()
