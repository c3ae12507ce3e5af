"""The dry run's report: memory per rank, communication per mesh axis, FLOPs, a predicted step time, and
whether it fits; a table for people (`str(report)`) and JSON for tools (`report.to_json()`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["Report", "Prediction", "Assumptions", "predict", "gib"]


def gib(n: float) -> str:
    """Bytes as GiB (or MiB / KiB when small), for the table."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


@attrs.frozen
class Assumptions:
    """What the predicted step time assumes (all of it is in the report).

    `compute_efficiency`: the fraction of the dense peak the matmuls reach (40-55% is typical of well-tuned
    LLM training on H100s); `comm_efficiency`: the fraction of the link bandwidth a collective's bus bandwidth
    reaches (nccl-tests reach ~80% on NVLink and InfiniBand); `overlap`: the fraction of the communication
    hidden behind compute (FSDP's prefetch and DDP's bucketed all-reduces overlap most of it).
    """

    compute_efficiency: float = 0.45
    comm_efficiency: float = 0.8
    overlap: float = 1.0
    reserve_bytes: int = 2 * 2**30  # CUDA context, NCCL buffers and allocator slack kept free on each device
    host_memory_bytes: int = 2048 * 2**30  # host memory of a node (a DGX H100 / H200 has 2 TiB)


@attrs.frozen
class Prediction:
    step_time_s: float
    compute_s: float
    comm_s: float
    tokens_per_s: float | None
    mfu: float | None
    assumes: dict[str, Any]


def predict(
    *,
    flops: int,
    comm: Mapping[str, Mapping[str, Mapping[str, Any]]],
    peak_tflops: float | None,
    bandwidth_gbs: Mapping[bool, float],
    tokens_per_step: int | None,
    assumptions: Assumptions,
    dtype: str,
) -> Prediction:
    """Step time from this rank's FLOPs and bus bytes against the device table.

    `comm` is the report's `{kind: {axis: {"bus_bytes", "intra_node", ...}}}`; `bandwidth_gbs[intra]` the
    per-device link bandwidth within / across nodes.

    Example:
        >>> p = predict(flops=10**15, comm={}, peak_tflops=1000.0, bandwidth_gbs={True: 450, False: 50},
        ...             tokens_per_step=4096, assumptions=Assumptions(compute_efficiency=0.5), dtype="bf16")
        >>> p.step_time_s, p.mfu
        (2.0, 0.5)
    """
    compute = flops / (peak_tflops * 1e12 * assumptions.compute_efficiency) if peak_tflops else 0.0
    comm_s = 0.0
    for by_axis in comm.values():
        for row in by_axis.values():
            bw = bandwidth_gbs[bool(row["intra_node"])] * 1e9 * assumptions.comm_efficiency
            comm_s += row["bus_bytes"] / bw if bw else 0.0
    exposed = max(0.0, comm_s - assumptions.overlap * compute)
    step = compute + exposed
    tokens = tokens_per_step / step if tokens_per_step and step > 0 else None
    mfu = flops / (step * peak_tflops * 1e12) if peak_tflops and step > 0 else None
    return Prediction(
        step_time_s=step,
        compute_s=compute,
        comm_s=comm_s,
        tokens_per_s=tokens,
        mfu=mfu,
        assumes={
            "peak_tflops": peak_tflops,
            "compute_dtype": dtype,
            "compute_efficiency": assumptions.compute_efficiency,
            "comm_efficiency": assumptions.comm_efficiency,
            "intra_node_gbs": bandwidth_gbs[True],
            "inter_node_gbs": bandwidth_gbs[False],
            "overlap": assumptions.overlap,
            "flops": "counted by torch.utils.flop_counter on this rank, recomputation included (hardware FLOPs)",
        },
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
            a = p.assumes
            lines.append(
                f"  assumes {a['compute_efficiency']:.0%} of {a['peak_tflops']} TFLOP/s ({a['compute_dtype']}), "
                f"{a['comm_efficiency']:.0%} of {a['intra_node_gbs']}/{a['inter_node_gbs']} GB/s "
                f"intra/inter-node, {a['overlap']:.0%} of communication overlapped"
            )
        for title, items in (("notes", self.notes), ("skipped", self.skipped)):
            if items:
                lines += ["", f"{title}:"] + [f"  {x}" for x in items]
        return "\n".join(lines)
