"""The dry run's report: memory per rank, communication per mesh axis, FLOPs, a predicted step time, and
whether it fits; a table for people (`str(report)`) and JSON for tools (`report.to_json()`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from ..moe.routing_model import check_routing
from .comm_time import CommAssumptions
from .step_time import StepTime
from .timing import TimingAssumptions

__all__ = ["Report", "Prediction", "Assumptions", "predict", "gib"]


def root_error(e: BaseException) -> BaseException:
    """The innermost exception of `e`'s chain (`raise ... from`, or raised while handling another): the cause a
    wrapper such as torch's pipeline stage ("[Stage 1] failed to run forward") hides.

    Example:
        >>> try:
        ...     try:
        ...         raise ValueError("the cause")
        ...     except ValueError as inner:
        ...         raise RuntimeError("\\n[Stage 1] failed") from inner
        ... except RuntimeError as e:
        ...     error_summary(e)
        'ValueError: the cause (through RuntimeError: [Stage 1] failed)'
    """
    seen = {id(e)}
    while True:
        nxt = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            return e
        seen.add(id(nxt))
        e = nxt


def error_summary(e: BaseException) -> str:
    """One line for a script's failure: the innermost error of the chain (`root_error`), and the outermost's
    first line where it differs."""
    root = root_error(e)
    text = f"{type(root).__name__}: {str(root).strip()}"
    if root is not e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        text += f" (through {type(e).__name__}: {first[:200]})"
    return text


def gib(n: float) -> str:
    """Bytes as GiB (or MiB / KiB when small), for the table."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


@attrs.frozen
class Assumptions:
    """What the dry run assumes (all of it is in the report).

    `timing`: the per-op compute model's figures (`accelfn.dryrun.timing.TimingAssumptions`: the GEMM
    efficiency, attention efficiency, memory efficiency, launch floor, ...); `comm`: the collectives' model's
    (`accelfn.dryrun.comm_time.CommAssumptions`: link efficiencies, NCCL's latencies); `reserve_bytes`: device
    memory kept free; `host_memory_bytes`: host memory of a node; `moe_routing`: how MoE layers route their
    rows (`accelfn.moe.routing_model`): "uniform" (each token's k experts uniformly at random, the null model of
    a balanced router; the rank simulated gets the busiest ep rank's rows), "even" (every expert `rows / E`) or
    a measured max/mean rows per expert (a real run's `metrics["moe_imbalance"]`).

    Example:
        >>> from accelfn.dryrun.timing import TimingAssumptions
        >>> Assumptions(timing=TimingAssumptions(attention_efficiency=0.6)).timing.attention_efficiency
        0.6
    """

    timing: TimingAssumptions = attrs.Factory(TimingAssumptions)
    comm: CommAssumptions = attrs.Factory(CommAssumptions)
    reserve_bytes: int = 2 * 2**30  # CUDA context, NCCL buffers and allocator slack kept free on each device
    host_memory_bytes: int = 2048 * 2**30  # host memory of a node (a DGX H100 / H200 has 2 TiB)
    moe_routing: str | float = attrs.field(default="uniform", converter=check_routing)


@attrs.frozen
class Prediction:
    """A predicted step: `step_time_s` = `compute_s` + `exposed_comm_s` + `bubble_s` (see
    accelfn/dryrun/step_time.py); `comm_s` all collectives' time, overlapped or not; `mfu` the counted FLOPs
    over the step time and the compute dtype's peak; `assumes` every figure used."""

    step_time_s: float
    compute_s: float
    comm_s: float
    tokens_per_s: float | None
    mfu: float | None
    assumes: dict[str, Any]
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0


def predict(
    step: StepTime, *, flops: int, peak_tflops: float | None, tokens_per_step: int | None, dtype: str
) -> Prediction:
    """The report's prediction from a `StepTime` (`step_time.predict_step`), this rank's counted FLOPs and
    tokens.

    Example:
        >>> from accelfn.dryrun.step_time import StepTime
        >>> t = StepTime(2.0, 1.5, 1.0, 0.5, 0.0, {}, 10, 0, {})
        >>> p = predict(t, flops=10**15, peak_tflops=1000.0, tokens_per_step=4096, dtype="bf16")
        >>> p.step_time_s, p.mfu, p.tokens_per_s
        (2.0, 0.5, 2048.0)
    """
    total = step.step_s
    return Prediction(
        step_time_s=total,
        compute_s=step.compute_s,
        comm_s=step.comm_s,
        exposed_comm_s=step.exposed_comm_s,
        bubble_s=step.bubble_s,
        tokens_per_s=tokens_per_step / total if tokens_per_step and total > 0 else None,
        mfu=flops / (total * peak_tflops * 1e12) if peak_tflops and total > 0 else None,
        assumes={
            "peak_tflops": peak_tflops,
            "compute_dtype": dtype,
            **step.assumes,
            "kernels": step.kernels,
            "launch_bound_kernels": step.launch_bound,
            "compute_by_kind_s": step.by_kind,
            "flops": "counted by torch.utils.flop_counter on this rank, recomputation included (hardware FLOPs)",
        },
    )


def _assumes(a: Mapping[str, Any]) -> str:
    """The prediction's figures in one line (the JSON's `predicted.assumes` holds all of them)."""
    if "gemm_efficiency" not in a:
        return ", ".join(f"{k}={v}" for k, v in a.items())
    by = a.get("compute_by_kind_s", {})
    kinds = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in by.items())
    return (
        f"{a['peak_tflops']} TFLOP/s ({a['compute_dtype']}): GEMMs at {a['gemm_efficiency']:.0%} of their dtype's "
        f"peak (quantized over {a['sm_count']} SMs), attention at {a['attention_efficiency']:.0%} "
        f"({a.get('attention_backend', 'flash2')}'s SDPA, torch {a.get('torch_version', '?')}), memory-bound ops at "
        f"{a.get('eager_memory_efficiency', a['memory_efficiency']):.0%} eager / {a['memory_efficiency']:.0%} fused "
        f"of {a['memory_gbs']:,.0f} GB/s ({kinds}); "
        + (
            (
                "compiled per block (the blocks' forward and backward fused, no launch floor; the loss, head, "
                "embedding, FSDP's copies and the update eager, launch floor "
                if a["compiled"] == "blocks"
                else "compiled (forward and backward fused, no launch floor; the update eager, launch floor "
            )
            + f"{a['launch_s'] * 1e6:.0f} us)"
            if a["compiled"]
            else f"eager, launch floor {a['launch_s'] * 1e6:.0f} us"
        )
        + f", {a['kernels']:,} kernels; links {a['intra_efficiency']:.0%} of {a['intra_node_gbs']:,.0f} / "
        f"{a['inter_efficiency']:.0%} of {a['inter_node_gbs']:,.0f} GB/s intra/inter-node, NCCL latencies "
        f"{a['ring_base_us']} us + {a['nvlink_hop_us']}/{a['net_hop_us']} us per hop; {a['overlap']}"
        + (f"; MoE routing {a['moe_routing']}" if "moe_routing" in a else "")
    )


def _moe_line(moe: Mapping[str, Any]) -> str:
    """The report's line on the modelled MoE routing (`Report.moe`)."""
    routing = moe["routing"]
    what = {
        "uniform": "each token's k experts uniformly at random",
        "even": "every expert rows / E",
    }.get(routing, f"the busiest expert {routing}x the mean")
    rank = "the busiest ep rank's rows" if routing != "even" else "its own even share"
    return (
        f"MoE routing (assumed {routing}: {what}; this rank is given {rank}):\n"
        f"  moe_imbalance {moe['moe_imbalance']:.3f} (max/mean rows per expert of the ep={moe['ep']} group's "
        f"batch, worst of {moe['layers']} layers); this rank's experts get {moe['rank_load']:.3f}x the mean"
    )


@attrs.define
class Report:
    """What `af.dry_run` found (see docs/dry_run.md for every field)."""

    world_size: int
    rank: int
    mesh: dict[str, int]
    device: str
    gpu: str | None
    per_rank: dict[str, int]
    at_peak: dict[str, int]
    top_modules: list[tuple[str, int]]
    comm: dict[str, dict[str, dict[str, Any]]]
    total_bus_bytes: int
    flops_per_step: int
    tokens_per_step: int | None
    micro_batch: int | None
    predicted: Prediction | None
    capacity_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None
    max_micro_batch: int | None
    steps: int
    errors: list[str] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    skipped: list[str] = attrs.Factory(list)
    strategy: str = ""
    ranks_tried: list[int] = attrs.Factory(list)
    elapsed_s: float = 0.0
    step_objects: list[dict[str, Any]] = attrs.Factory(list)
    init: dict[str, Any] | None = None  # the memory before the first training step (see _init_report)
    moe: dict[str, Any] | None = None  # the modelled MoE routing and its imbalance (see summary._moe)

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=True)
        out["top_modules"] = [{"module": m, "bytes": b} for m, b in self.top_modules]
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"accelfn dry run: rank {self.rank} of {self.world_size}"
            + (f" (worst of ranks {self.ranks_tried})" if len(self.ranks_tried) > 1 else "")
            + f", mesh {' x '.join(f'{k}={v}' for k, v in self.mesh.items()) or '-'}, "
            f"device {self.device}{f' ({self.gpu})' if self.gpu else ''}, {self.steps} step(s) measured",
        ]
        if self.strategy:
            lines.append(self.strategy)
        if self.errors:
            lines += ["", "errors:"] + [f"  {e}" for e in self.errors]
        lines += ["", "memory per rank                  bytes    at the peak"]
        for key in ("params", "buffers", "grads", "optimizer", "activations", "temporary", "comm_buffers"):
            lines.append(
                f"  {key:<22}{gib(self.per_rank.get(key, 0)):>15}{gib(self.at_peak.get(key, 0)):>15}"
            )
        lines.append(f"  {'peak':<22}{gib(self.per_rank.get('peak', 0)):>15}")
        if "reserved" in self.per_rank:
            lines.append(
                f"  {'peak reserved':<22}{gib(self.per_rank['reserved']):>15}    simulated caching allocator "
                "(torch.cuda.max_memory_reserved)"
            )
        if self.per_rank.get("host"):
            lines.append(f"  {'host (af.offload)':<22}{gib(self.per_rank['host']):>15}    not in the peak")
        if self.capacity_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(
                f"  {verdict}: {gib(self.capacity_bytes)} usable, headroom {gib(self.headroom_bytes or 0)}"
                + (f"; largest micro-batch that fits: {self.max_micro_batch}" if self.max_micro_batch else "")
                + (f" (now {self.micro_batch})" if self.micro_batch else "")
            )
        if self.init is not None:
            i = self.init
            verdicts = {True: "fits", False: "DOES NOT FIT", None: ""}
            lines += [
                "",
                "before the first step (model construction, loading, step.init)",
                f"  {'host, per rank':<22}{gib(i['host_peak']):>15}    per node ({gib(i['host_per_node'])} of "
                f"{gib(i['host_memory'])}): {verdicts[i['fits_host']]}",
            ]
            if i["fits_device"] is not None:
                lines.append(
                    f"  {'device, per rank':<22}{gib(i['device_peak']):>15}    {verdicts[i['fits_device']]}"
                )
        if self.top_modules:
            lines += ["", "activations at the peak, by module"]
            lines += [f"  {m:<48}{gib(b):>15}" for m, b in self.top_modules]
        per = "loop iteration" if len(self.step_objects) > 1 else "step"
        lines += ["", f"{'communication per ' + per:<28} count      bus bytes"]
        for kind, by_axis in sorted(self.comm.items()):
            for axis, row in sorted(by_axis.items()):
                where = "intra-node" if row["intra_node"] else "inter-node"
                lines.append(
                    f"  {kind + ' ' + axis:<24}{row['count']:>8}{gib(row['bus_bytes']):>15}  ({where})"
                )
        lines.append(f"  {'total':<32}{gib(self.total_bus_bytes):>15}")
        lines += ["", f"FLOPs per {per} (this rank): {self.flops_per_step / 1e12:,.2f} TFLOP"]
        if self.moe is not None:
            lines.append(_moe_line(self.moe))
        if len(self.step_objects) > 1:
            lines += [
                "",
                "step objects  per iteration           peak  + other states      bus bytes      TFLOP",
            ]
            for s in self.step_objects:
                r = s["per_rank"]
                lines.append(
                    f"  {s['index']:>2}{s['per_iteration']:>19}{gib(r['peak']):>15}"
                    f"{gib(r['other_states']):>16}{gib(s['total_bus_bytes']):>15}"
                    f"{s['flops_per_step'] / 1e12:>11,.3f}"
                )
                lines.append(f"      {s['strategy'].split('  [')[0]}")
        p = self.predicted
        if p is not None:
            lines.append(
                f"predicted: {p.step_time_s * 1e3:,.1f} ms/{per.split()[-1]} (compute {p.compute_s * 1e3:,.1f} ms, "
                f"communication {p.comm_s * 1e3:,.1f} ms)"
                + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "")
                + (f", MFU {p.mfu:.1%}" if p.mfu is not None else "")
            )
            lines.append(
                f"  exposed communication {p.exposed_comm_s * 1e3:,.1f} ms"
                + (f", pipeline bubble {p.bubble_s * 1e3:,.1f} ms" if p.bubble_s else "")
            )
            lines.append(f"  assumes {_assumes(p.assumes)}")
        for title, items in (("notes", self.notes), ("skipped", self.skipped)):
            if items:
                lines += ["", f"{title}:"] + [f"  {x}" for x in items]
        return "\n".join(lines)
