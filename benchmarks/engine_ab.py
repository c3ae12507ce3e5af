"""Step time of this checkout's engine against an earlier commit's, interleaved in one process (CPU).

    python benchmarks/engine_ab.py [--ref f014776] [--rounds 40] [--threads 2] [--tiny]

The earlier commit's package is exported (`git archive`) into a temporary folder and imported as
`accelfn_ref` (its absolute imports and pytree namespace renamed), so both engines train copies of the same
model on the same batches in the same process, rounds alternating in order: machine noise hits both alike.
Default workload: step_overhead.py's 4x1024 MLP, batch 64, AdamW; `--tiny`: a Linear(8, 8), where the
engine's own Python overhead is most of the step. Prints ms (or us) per step and the ratio new/ref.
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def export(ref: str, into: Path) -> None:
    """The package at `ref`, as `into/accelfn_ref`."""
    data = subprocess.run(
        ["git", "archive", ref, "accelfn"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "accelfn"
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bimport accelfn\b", "import accelfn_ref", text)
        text = re.sub(r"\bfrom accelfn([. ])", r"from accelfn_ref\1", text)
        text = re.sub(r"([\"'])accelfn\.", r"\1accelfn_ref.", text)
        text = text.replace('NAMESPACE = "accelfn"', 'NAMESPACE = "accelfn_ref"')
        path.write_text(text)
    pkg.rename(into / "accelfn_ref")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ref", default="f014776", help="the commit to compare with (default: before the phases)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a Linear(8, 8): the engine's overhead alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="accelfn-ab-"))
    export(args.ref, tmp)
    sys.path.insert(0, str(tmp))
    import accelfn_ref as ref

    import accelfn as new

    width, rows, per_round = (8, 4, 100) if args.tiny else (1024, 64, 10)

    def model() -> nn.Module:
        torch.manual_seed(0)
        if args.tiny:
            return nn.Linear(width, width)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])

    batch = (torch.randn(rows, width), torch.randn(rows, width))

    def make(af):  # type: ignore[no-untyped-def]
        step = af.train_step(
            lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), af.optim.adamw(1e-3, weight_decay=0.01)
        )
        return step, step.init(model())

    runners = {"ref": make(ref), "new": make(new)}
    states = {k: v[1] for k, v in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for k in runners:  # warm-up
        for _ in range(5):
            states[k], _ = runners[k][0](states[k], batch)
    for r in range(args.rounds):
        for k in ("ref", "new") if r % 2 == 0 else ("new", "ref"):
            t = time.perf_counter()
            for _ in range(per_round):
                states[k], metrics = runners[k][0](states[k], batch)
            metrics["loss"].item()
            times[k].append((time.perf_counter() - t) / per_round)
    unit, scale = ("us", 1e6) if args.tiny else ("ms", 1e3)
    print(f"# engine_ab: ref {args.ref}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for k, ts in times.items():
        print(
            f"{k}: median {statistics.median(ts) * scale:.2f} {unit}/step ({args.rounds} rounds of {per_round})"
        )
    ratios = [n / o for n, o in zip(times["new"], times["ref"])]
    print(f"new/ref: median per-round ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
