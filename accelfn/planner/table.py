"""The planner's answer: the ranked candidates, what fell at each tier and why, as a table, JSON, a PNG and the
launch config of the chosen one (`accelfn launch --config plan.yaml` / `accelfn dry-run --config plan.yaml`).

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> row = Row(Candidate({"dp": 8}, "fsdp"), peak=2**30, headroom=2**33, fits=True, step_time_s=0.5,
    ...           compute_s=0.4, tokens_per_s_per_gpu=1000.0, mfu=0.4, bubble_s=None)
    >>> round(row.exposed_comm_s, 3)
    0.1
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from ..dryrun.report import gib
from .candidates import Candidate

__all__ = ["Row", "Fallen", "Plan"]


@attrs.frozen
class Row:
    """A candidate the dry run measured: peak per rank, headroom, and the prediction's figures."""

    candidate: Candidate
    peak: int
    headroom: int | None
    fits: bool | None
    step_time_s: float | None
    compute_s: float | None
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    bubble_s: float | None
    states: int = 0  # params, buffers, grads and optimizer state on the device, per rank
    error_band: float | None = None  # the prediction's expected relative error, where the time model gives it

    exposed_s: float | None = None  # the prediction's exposed communication, where the time model gives it
    extrapolated: bool = False  # from dry runs with a few blocks per stage (`extrapolate`), not yet confirmed
    dry_run_s: float | None = None  # the dry run's wall time (extrapolated: its full dry run's, estimated)

    @property
    def exposed_comm_s(self) -> float | None:
        """The communication not hidden behind compute: the prediction's own figure, else the step time not
        spent computing or in the bubble."""
        if self.exposed_s is not None:
            return self.exposed_s
        if self.step_time_s is None or self.compute_s is None:
            return None
        return max(0.0, self.step_time_s - self.compute_s - (self.bubble_s or 0.0))

    @classmethod
    def of(cls, c: Candidate, report: dict[str, Any]) -> Row:
        """From a dry run's report (as `Report.to_dict()`); reads the prediction's optional fields (`bubble_s`,
        `error_band`) where the time model has them."""
        p = report.get("predicted") or {}
        tokens = p.get("tokens_per_s")
        return cls(
            candidate=c,
            peak=int(report["per_rank"]["peak"]),
            headroom=report.get("headroom_bytes"),
            fits=report.get("fits"),
            step_time_s=p.get("step_time_s"),
            compute_s=p.get("compute_s"),
            tokens_per_s_per_gpu=tokens / report["world_size"] if tokens else None,
            mfu=p.get("mfu"),
            bubble_s=p.get("bubble_s"),
            states=sum(
                int(report["per_rank"].get(k, 0)) for k in ("params", "buffers", "grads", "optimizer")
            ),
            error_band=p.get("error_band"),
            exposed_s=p.get("exposed_comm_s"),
            extrapolated="extrapolated" in report,
            dry_run_s=report.get("elapsed_s"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["candidate"] = {
            "label": self.candidate.label,
            "mesh": self.candidate.mesh,
            **self.candidate.knobs(),
        }
        out["exposed_comm_s"] = self.exposed_comm_s
        return out


@attrs.frozen
class Fallen:
    """A candidate that fell at `tier` (legality, states bound, lowering, failed, does not fit, script fixes
    the mesh, budget), and why."""

    candidate: Candidate
    tier: str
    reason: str


TIERS = (
    "legality",
    "states bound",
    "lowering",
    "failed",
    "script fixes the mesh",
    "does not fit",
    "dominated",
    "time bound",
    "budget",
)


def _ms(s: float | None) -> str:
    return f"{s * 1e3:,.1f}" if s is not None else "-"


@attrs.define
class Plan:
    """What `af.plan` found: `rows` ranked best first (fitting, by predicted tokens/s per GPU), `fallen`,
    the knobs the script left open and those it fixes, and the world it planned for."""

    script: str
    args: list[str]
    nproc_per_node: int
    nnodes: int
    gpu: str | None
    rows: list[Row]
    fallen: list[Fallen]
    open_knobs: list[str]
    fixed_knobs: list[str]
    candidates: int
    elapsed_s: float = 0.0
    notes: list[str] = attrs.Factory(list)
    unfit: list[Row] = attrs.Factory(list)  # measured, but over the device's memory
    capacity_bytes: int | None = None
    global_batch_size: int | None = None
    dry_runs: int = 0  # how many dry runs the search ran (a layer-extrapolated candidate's two count as one)
    extrapolated: int = 0  # how many candidates were measured by the layer-extrapolated tier
    confirmed: int = 0  # ... of which the full dry run confirmed (re-measured) the best
    mixed_precision: str = (
        "no"  # the mixed precision every dry run launched with (`af.plan(mixed_precision=)`)
    )

    @property
    def best(self) -> Row | None:
        """The chosen configuration: the first row that fits (None when none does)."""
        return next((r for r in self.rows if r.fits is not False), None)

    def counts(self) -> dict[str, int]:
        """How many candidates fell at each tier (and how many were measured and fit)."""
        out = {t: sum(1 for f in self.fallen if f.tier == t) for t in TIERS}
        out["measured, fits"] = len(self.rows)
        return out

    def config(self) -> Any:
        """The chosen configuration as a launch `Config` (processes, mesh, mixed precision and the `plan:`
        knobs)."""
        from ..launch.config import Config, PlanConfig

        best = self.best
        if best is None:
            raise ValueError("af.plan: no candidate fits, so there is no configuration to write")
        return Config(
            num_processes=self.nproc_per_node,
            num_machines=self.nnodes,
            mesh=best.candidate.mesh_spec,
            mixed_precision=self.mixed_precision,
            plan=PlanConfig(**best.candidate.knobs()),  # type: ignore[arg-type]
        )

    def write_config(self, path: str | Path) -> Path:
        """Write `config()` as YAML: `accelfn launch --config PATH script.py` and `accelfn dry-run --config
        PATH script.py` both apply it."""
        from ..launch.config import save

        return save(self.config(), path)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "script": self.script,
            "args": self.args,
            "world_size": self.nproc_per_node * self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "gpu": self.gpu,
            "global_batch_size": self.global_batch_size,
            "mixed_precision": self.mixed_precision,
            "capacity_bytes": self.capacity_bytes,
            "candidates": self.candidates,
            "dry_runs": self.dry_runs,
            "extrapolated": self.extrapolated,
            "confirmed": self.confirmed,
            "open_knobs": self.open_knobs,
            "fixed_knobs": self.fixed_knobs,
            "chosen": best.to_dict() if best else None,
            "rows": [r.to_dict() for r in self.rows],
            "tiers": self.counts(),
            "fallen": [{"label": f.candidate.label, "tier": f.tier, "reason": f.reason} for f in self.fallen],
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self, top: int = 10) -> str:
        """The ranked table of the `top` rows, then the tiers' counts with a reason of each."""
        world = self.nproc_per_node * self.nnodes
        lines = [
            f"accelfn plan: {self.script} on {self.nproc_per_node} x {self.nnodes} = {world} "
            f"{self.gpu or 'devices'}; {self.candidates} candidates, {self.dry_runs} dry runs, {self.elapsed_s:,.1f} s",
            *(
                [
                    f"  {self.extrapolated} measured with a few blocks per stage and extrapolated (~), "
                    f"{self.confirmed} of the best confirmed by full dry runs"
                ]
                if self.extrapolated
                else []
            ),
            f"  chosen by the plan: {', '.join(k for k in self.open_knobs if k != 'global_batch_size')}",
        ]
        if self.global_batch_size and "global_batch_size" in self.open_knobs:
            lines.append(f"  global batch held at {self.global_batch_size}")
        elif self.global_batch_size:
            lines.append(
                f"  global batch {self.global_batch_size} NOT held: the script does not read global_batch_size "
                "(its batch per rank is fixed), so the rows train different global batches; compare them by "
                "tokens/s/GPU, or have the script take the global batch from the launch config"
            )
        if self.fixed_knobs:
            lines.append(f"  kept as the script fixes them: {', '.join(self.fixed_knobs)}")
        head = (
            f"  {'#':>3}  {'configuration':<48}{'peak/rank':>12}{'headroom':>12}{'step ms':>10}"
            f"{'tok/s/GPU':>11}{'MFU':>7}{'exposed ms':>11}{'bubble ms':>10}{'error':>7}"
        )
        lines += ["", head]
        for i, r in enumerate(self.rows[:top], 1):
            lines.append(
                f"  {i:>3}{'~' if r.extrapolated else ' '} {r.candidate.label:<48}{gib(r.peak):>12}"
                f"{gib(r.headroom) if r.headroom is not None else '-':>12}{_ms(r.step_time_s):>10}"
                f"{f'{r.tokens_per_s_per_gpu:,.0f}' if r.tokens_per_s_per_gpu else '-':>11}"
                f"{f'{r.mfu:.1%}' if r.mfu is not None else '-':>7}{_ms(r.exposed_comm_s):>11}"
                f"{_ms(r.bubble_s):>10}{f'±{r.error_band:.0%}' if r.error_band is not None else 'n/a':>7}"
            )
        if not self.rows:
            lines.append("  (no candidate fits)")
        lines += ["", "candidates by tier"]
        for tier, n in self.counts().items():
            if not n:
                continue
            first = next((f.reason for f in self.fallen if f.tier == tier), "")
            lines.append(f"  {tier:<24}{n:>6}" + (f"   e.g. {first}" if first else ""))
        for note in self.notes:
            lines.append(f"note: {note}")
        per_block = sorted(
            {r.candidate.remat for r in self.rows[:top] if r.candidate.remat and ":" in r.candidate.remat}
        )
        if per_block:
            lines.append(
                f"note: remat={per_block[0]} and the like: that policy on every n-th block only (blocks n, 2n, ...: "
                "af.remat(step, POLICY, every=N))"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """A PNG of peak memory per rank against tokens/s per GPU, every measured candidate, the chosen one
        marked (needs matplotlib)."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ValueError("af.plan: the picture needs matplotlib: pip install 'accelfn[plot]'") from None
        fig = Figure(figsize=(8, 5))
        ax = fig.add_subplot(1, 1, 1)
        for rows, label, color in ((self.rows, "fits", "tab:blue"), (self.unfit, "does not fit", "tab:gray")):
            drawn = [r for r in rows if r.tokens_per_s_per_gpu]
            if drawn:
                x = [r.tokens_per_s_per_gpu or 0.0 for r in drawn]
                ax.scatter(x, [r.peak / 2**30 for r in drawn], s=18, c=color, label=label)
        if self.capacity_bytes:
            ax.axhline(self.capacity_bytes / 2**30, color="tab:red", lw=0.8, ls="--", label="usable memory")
        best = self.best
        if best is not None and best.tokens_per_s_per_gpu:
            ax.scatter(
                [best.tokens_per_s_per_gpu], [best.peak / 2**30], s=120, marker="*", c="red", label="chosen"
            )
            ax.annotate(
                best.candidate.label,
                (best.tokens_per_s_per_gpu, best.peak / 2**30),
                xytext=(-6, 8),
                textcoords="offset points",
                ha="right",
                fontsize=8,
            )
        ax.set_xlabel("predicted tokens/s per GPU")
        ax.set_ylabel("peak memory per rank (GiB)")
        ax.set_title(f"accelfn plan: {Path(self.script).name}, {self.nproc_per_node * self.nnodes} ranks")
        ax.legend()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        return out
