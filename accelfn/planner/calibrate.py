"""Calibration from real runs (issue 30 item 4): the measured step times of a run (`af.Meter`'s `step_time`,
as a tracker wrote them to `RUN_DIR/metrics.jsonl`) against the dry run of the configuration it ran, to fit
the device's compute efficiency; the plan's later predictions on that device use it and carry the fit's error.

The fit has one term per device, `scale`: every efficiency of the compute model (GEMMs, attention, memory-bound
ops, torch.compile's measured reductions, the flat `compute_efficiency` of the older model) times `scale` and the
eager launch floor over it, so that the predicted compute time is exactly the model's over `scale`, eager or
compiled; communication and the bubble are left as the model has them. Each calibrated run adds a point (its predicted compute `c`, the rest of its step `n`, its
measured step `m`) to the store, and `scale` is the least-squares fit of `c / scale + n = m` over the points;
the residual (root mean square of the relative misses) is the error band the plan prints. With one point the
fit is exact and the band is the spread of the measured step times.

Example:
    >>> points = [Point(compute_s=1.0, other_s=0.5, measured_s=2.5, run="a", label="dp=8")]
    >>> Calibration.fit("h100-sxm", points).scale
    0.5
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "Point",
    "Calibration",
    "calibrate",
    "read_step_times",
    "scaled_assumptions",
    "default_store",
    "load",
    "save",
]

# every efficiency of the compute model (the flat model's `compute_efficiency` too), and the factor on the measured
# table torch.compile's reductions run at where `reduction_efficiency` is None (its default): `reduction_scale`
EFFICIENCIES = (
    "gemm_efficiency",
    "default_gemm_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "eager_memory_efficiency",
    "reduction_efficiency",
    "reduction_scale",
    "compute_efficiency",
)


@attrs.frozen
class Point:
    """One calibrated run: the model's compute time and the rest of its predicted step (communication not
    hidden, bubble) at scale 1, and the measured step time (the median over the run's logged steps)."""

    compute_s: float
    other_s: float
    measured_s: float
    run: str
    label: str
    spread: float = 0.0  # relative spread of the measured step times (stdev / median)


@attrs.frozen
class Calibration:
    """The fitted `scale` of a device row (`gpu`), its `residual` (relative), and the points it came from."""

    gpu: str
    scale: float
    residual: float
    points: tuple[Point, ...]

    @classmethod
    def fit(cls, gpu: str, points: Sequence[Point]) -> Calibration:
        """Least squares of `compute / scale + other = measured` over `points` (see the module's docstring)."""
        if not points:
            raise ValueError("calibration: no measured runs to fit")
        num = sum(p.compute_s * (p.measured_s - p.other_s) for p in points)
        den = sum(p.compute_s**2 for p in points)
        if den <= 0 or num <= 0:
            raise ValueError(
                "calibration: the measured step times are shorter than the predicted communication and bubble "
                f"alone ({[(p.label, p.measured_s, p.other_s) for p in points]}): the fit has no compute left"
            )
        inverse = num / den
        misses = [(p.compute_s * inverse + p.other_s - p.measured_s) / p.measured_s for p in points]
        residual = math.sqrt(sum(x * x for x in misses) / len(misses))
        if len(points) == 1:
            residual = max(residual, points[0].spread)
        return cls(gpu=gpu, scale=1.0 / inverse, residual=residual, points=tuple(points))

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        return cls(
            gpu=data["gpu"],
            scale=float(data["scale"]),
            residual=float(data["residual"]),
            points=tuple(Point(**p) for p in data["points"]),
        )


def read_step_times(run_dir: str | Path) -> list[float]:
    """The `step_time` of every record of `run_dir/metrics.jsonl` (`af.Meter.figures()` logged by a tracker),
    the first left out when there are several (it holds the warm-up); errors name the run."""
    from ..cli.plot import PlotError, read_metrics

    try:
        records = read_metrics(run_dir)
    except PlotError as e:
        raise ValueError(f"calibration: {e}") from None
    times = [float(r["step_time"]) for r in records if isinstance(r.get("step_time"), (int, float))]
    if not times:
        raise ValueError(
            f"calibration: {run_dir} has no 'step_time' in its metrics.jsonl: log af.Meter's figures "
            "(tracker.log(meter.figures(), step=...)) in the run to calibrate from it"
        )
    return times[1:] if len(times) > 1 else times


def point(run_dir: str | Path, report: dict[str, Any], label: str, scale: float = 1.0) -> Point:
    """The calibration point of a run and the dry run of its configuration (made at `scale`), at scale 1."""
    times = read_step_times(run_dir)
    measured = statistics.median(times)
    p = report.get("predicted") or {}
    if not p.get("compute_s"):
        raise ValueError("calibration: the dry run predicted no compute time (no device row to time against)")
    spread = statistics.pstdev(times) / measured if len(times) > 1 and measured > 0 else 0.0
    return Point(
        compute_s=float(p["compute_s"]) * scale,
        other_s=float(p["step_time_s"]) - float(p["compute_s"]),
        measured_s=measured,
        run=str(run_dir),
        label=label,
        spread=spread,
    )


def scaled_assumptions(
    scale: float, gpu: str | None, reserve_bytes: int | None = None, torch_version: str | None = None
) -> Any:
    """The dry run's `Assumptions` with the compute model's efficiencies (`EFFICIENCIES`: the factor on
    torch.compile's measured reduction table too) times `scale` and the launch floor over it: the predicted
    compute time over `scale`; attention timed as the SDPA kernel `torch_version` picks
    (None: the installed torch's), as `accelfn dry-run --torch-version` times it.

    Example:
        >>> a = scaled_assumptions(1.0, "h100-sxm", torch_version="2.6.0")
        >>> type(a).__name__, a.timing.torch_version
        ('Assumptions', '2.6.0')
    """
    from ..dryrun.report import Assumptions
    from ..platforms import specs

    base = Assumptions() if reserve_bytes is None else Assumptions(reserve_bytes=reserve_bytes)
    if torch_version is not None:
        base = attrs.evolve(base, timing=attrs.evolve(base.timing, torch_version=torch_version))
    if scale == 1.0:
        return base
    timing = getattr(base, "timing", None)
    if timing is None:  # the flat model: one compute efficiency
        flat = base.compute_efficiency * scale  # type: ignore[attr-defined, unused-ignore]
        return attrs.evolve(base, compute_efficiency=flat)  # type: ignore[call-arg, unused-ignore]
    changes: dict[str, Any] = {}
    for name in EFFICIENCIES:
        value = getattr(timing, name, None)
        if name == "gemm_efficiency" and value is None and gpu is not None and hasattr(timing, "gemm"):
            value = timing.gemm(specs.spec(gpu))  # the device's measured figure
        if isinstance(value, float):
            changes[name] = value * scale
    if isinstance(getattr(timing, "launch_s", None), float):
        changes["launch_s"] = timing.launch_s / scale
    return attrs.evolve(base, timing=attrs.evolve(timing, **changes))


def default_store() -> Path:
    """Where calibrations are kept: beside the launcher's default config (`~/.cache/accelfn/calibration.json`)."""
    from ..launch.config import default_config_path

    return default_config_path().parent / "calibration.json"


def load(gpu: str, store: str | Path | None = None) -> Calibration | None:
    """The calibration of device row `gpu` in `store` (default `default_store()`), or None."""
    path = Path(store) if store is not None else default_store()
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Calibration.from_dict(data[gpu]) if gpu in data else None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"calibration file {str(path)!r} cannot be read: {e}") from None


def save(calibration: Calibration, store: str | Path | None = None) -> Path:
    """Write `calibration` under its device row in `store` (the other rows kept), atomically."""
    path = Path(store) if store is not None else default_store()
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[calibration.gpu] = calibration.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def calibrate(
    run_dir: str | Path,
    script: str | Path,
    args: Sequence[str] = (),
    *,
    config: str | Path | None = None,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    gpu: str | None = None,
    device: str = "cuda",
    store: str | Path | None = None,
    torch_version: str | None = None,
    mixed_precision: str | None = None,
) -> Calibration:
    """Dry-run the configuration `run_dir` ran (`script` with `args` under the launch `config` it was started
    with, in `mixed_precision` where the launch's flag gave it, else the config's; attention timed as the SDPA
    kernel of `torch_version`, the run's torch: None for the installed one),
    add the run's point to the device's calibration in `store` and refit it; return the calibration.

    Example:
        >>> cal = calibrate("runs/exp1", "train.py", config="plan.yaml", gpu="h100-sxm")  # doctest: +SKIP
        >>> cal.scale, cal.residual  # doctest: +SKIP
    """
    from ..launch import config as launch_config
    from .search import Job, run_job

    if not Path(script).is_file():
        raise ValueError(f"calibration: no such script: {str(script)!r}")
    read_step_times(run_dir)  # the run's errors first, before a dry run
    cfg = launch_config.load(config) if config else launch_config.Config()
    if nproc_per_node is None:
        nproc_per_node = cfg.num_processes if isinstance(cfg.num_processes, int) else 8
    if nnodes is None:
        nnodes = launch_config.parse_nnodes(cfg.num_machines)[1]
    gpu = gpu or ("cpu" if device == "cpu" else "h100-sxm")
    env = cfg.plan.env()
    pp = launch_config.parse_mesh(cfg.mesh).get("pp", 1) if cfg.mesh else 1
    job = Job(str(script), tuple(args), nproc_per_node, nnodes, mesh=cfg.mesh or None,
              env=tuple(env.items()), device=device, gpu=gpu, rank="ends" if pp > 1 else 0,
              torch_version=torch_version, precision=tuple(cfg.precision_env(mixed_precision).items()))  # fmt: skip
    label = " ".join(
        [
            cfg.mesh or f"world={job.world}",
            *(f"{k}={v}" for k, v in attrs.asdict(cfg.plan).items() if v is not None),
        ]
    )
    old = load(gpu, store)
    others = [p for p in (old.points if old else ()) if p.run != str(run_dir)]
    scale = old.scale if old else 1.0
    for _ in range(4):  # the exposed communication can depend on the compute time: refit at the fitted scale
        result = run_job(attrs.evolve(job, scale=scale))
        if "error" in result:
            raise RuntimeError(
                f"calibration: the dry run of the run's configuration fails: {result['error']}"
            )
        calibration = Calibration.fit(gpu, [*others, point(run_dir, result["report"], label, scale)])
        if abs(calibration.scale - scale) <= 1e-6 * scale:
            break
        scale = calibration.scale
    save(calibration, store)
    return calibration
