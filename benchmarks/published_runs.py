"""The dry run's predicted throughput against every published run of accelfn/dryrun/published_runs.json, rows
CI does not afford included (405B at 512 ranks, 70B at 256: 30-80 s each on this project's 2-core machine).

Each row's own `accelfn dry-run` command runs in a fresh process with `--no-search` (as tests/_published.py
runs it) and `--json`; the table gives the published and predicted tokens/s per GPU, their ratio, the peak
memory (reserved or allocated, as the row publishes it) beside the published one, the dry run's wall time, and the ratio recorded in
tests/test_published_runs.py's `RATIO`: a ratio more than 5% from it is drift (the exit status is 1), which catches
the rows CI does not run. Held-out rows (`"held_out": true`: encoded after the time model was built, not used to
build it) are marked.

    python benchmarks/published_runs.py                      # every row (about 10 minutes)
    python benchmarks/published_runs.py --held-out           # the held-out rows only
    python benchmarks/published_runs.py torchtitan-t4-70b-256-2d --json out.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
ROWS = json.loads((ROOT / "accelfn" / "dryrun" / "published_runs.json").read_text())["rows"]


def run_row(row: dict) -> dict:
    """Dry-run one row's command; its predicted tokens/s per GPU, peak GiB and wall seconds."""
    words = shlex.split(row["command"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        argv = [
            sys.executable,
            "-m",
            "accelfn.cli.main",
            "dry-run",
            "--no-search",
            "--json",
            str(out),
            *words[2:],
        ]
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if not out.exists():
            raise RuntimeError(
                f"{row['id']}: the dry run wrote no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        report = json.loads(out.read_text())
    predicted = report["predicted"]["tokens_per_s"] / report["world_size"]
    return {
        "id": row["id"],
        "held_out": bool(row.get("held_out")),
        "published": row["published"]["tokens_per_s_per_gpu"],
        "predicted": predicted,
        "ratio": predicted / row["published"]["tokens_per_s_per_gpu"],
        # the peak of the kind published: reserved (torchtitan's) or allocated (ours)
        "memory_gib": report["per_rank"][
            "reserved" if row["published"]["memory_kind"] == "reserved" else "peak"
        ]
        / 2**30,
        "published_gib": row["published"]["memory_gib"],
        "fits": report["fits"],
        "wall_s": wall,
    }


def recorded_ratios() -> dict[str, float]:
    """tests/test_published_runs.py's `RATIO`: each row's predicted / published ratio when it was last measured."""
    sys.path.insert(0, str(ROOT))
    from tests.test_published_runs import RATIO

    return dict(RATIO)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ids", nargs="*", help="rows to run (default: all)")
    p.add_argument("--held-out", action="store_true", help="only the held-out rows")
    p.add_argument("--json", help="also write the results as JSON")
    args = p.parse_args()
    unknown = set(args.ids) - {r["id"] for r in ROWS}
    if unknown:
        p.error(f"no such rows: {sorted(unknown)}")
    rows = [
        r for r in ROWS if (not args.ids or r["id"] in args.ids) and (r.get("held_out") or not args.held_out)
    ]
    recorded = recorded_ratios()
    print(
        "| run | held out | published tok/s/GPU | predicted | ratio | recorded | peak GiB (published) | dry run |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    results, drifted = [], []
    for row in rows:
        try:
            r = run_row(row)
        except RuntimeError as e:  # one row's failure does not stop the others
            print(f"| {row['id']} | failed: {str(e).splitlines()[0]} ||||||", flush=True)
            drifted.append(row["id"])
            continue
        results.append(r)
        was = recorded.get(r["id"])
        if was is None or abs(r["ratio"] / was - 1) > 0.05:
            drifted.append(r["id"])
        published_gib = "-" if r["published_gib"] is None else f"{r['published_gib']:.1f}"
        print(
            f"| {r['id']} | {'yes' if r['held_out'] else ''} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
            f"{r['ratio']:.3f} | {'-' if was is None else f'{was:.3f}'} | {r['memory_gib']:.1f} ({published_gib}) "
            f"| {r['wall_s']:.0f} s |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if drifted:
        print(f"drift (more than 5% from RATIO, unrecorded, or failed): {drifted}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
