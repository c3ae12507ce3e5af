"""The `Report` of a dry run's session: memory per rank at the worst call (with the other step objects' states
alive beside it), collectives by mesh axis and FLOPs over one iteration of the script's loop, the prediction
against the device's row, the memory before the first step, and the notes that explain them.

Example:
    >>> from accelfn.dryrun.records import Measured
    >>> from accelfn.dryrun.summary import _worst
    >>> def call(peak, other_states):
    ...     return Measured(peak, {}, {}, {}, 0, 0, 0, 0, {}, 0, None, None, others={"params": other_states})
    >>> _worst([call(10, 5), call(12, 0), call(8, 7)]).peak  # peak + other states; of equals, the later
    8
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from .layout import _axes_comm, _bus, _layout
from .records import Measured
from .report import Assumptions, Report, predict
from .session import Session
from .step_time import compile_regions, pipeline_of, predict_step
from .tracker import CATEGORIES, LOSS_ROW


def _worst(measured: Sequence[Measured]) -> Measured:
    """The call with the largest peak (its own and the other states alive beside it); the later of equals."""
    return max(reversed(measured), key=lambda m: m.total_peak)


def _combined(parts: list[tuple[Any, int, int]], tokens: int | None) -> Any:
    """One loop iteration's prediction from its step objects' (prediction, flops, calls per iteration): times
    add up (each step object's overlap is within its own step)."""
    from .report import Prediction

    if len(parts) == 1 and parts[0][2] == 1:
        return parts[0][0]
    step = sum(p.step_time_s * n for p, _, n in parts)
    main = max(parts, key=lambda x: x[1] * x[2])[0]
    peak = main.assumes["peak_tflops"]
    flops = sum(f * n for _, f, n in parts)
    return Prediction(
        step_time_s=step,
        compute_s=sum(p.compute_s * n for p, _, n in parts),
        comm_s=sum(p.comm_s * n for p, _, n in parts),
        exposed_comm_s=sum(p.exposed_comm_s * n for p, _, n in parts),
        bubble_s=sum(p.bubble_s * n for p, _, n in parts),
        tokens_per_s=tokens / step if tokens and step > 0 else None,
        mfu=flops / (step * peak * 1e12) if peak and step > 0 else None,
        assumes={**main.assumes, "loop": "the sum of the step objects' times in one iteration of the loop"},
    )


def _report(
    session: Session,
    *,
    world: int,
    rank: int,
    nproc_per_node: int,
    device: str,
    spec: Any,
    assumptions: Assumptions,
) -> Report:
    from ..platforms import specs

    shape, groups, data = _layout() or session.layout or ({"world": world}, {}, world)
    loop = session.loop()
    comm: dict[str, dict[str, dict[str, Any]]] = {}
    flops = 0
    tokens: int | None = None
    parts: list[tuple[Any, int, int]] = []
    objects: list[dict[str, Any]] = []
    for rec in session.records:
        last, worst = rec.measured[-1], _worst(rec.measured)
        times = loop.get(rec.index, 0)
        own = _axes_comm(last.comm, groups, shape, nproc_per_node)
        rec_tokens = last.tokens * data if last.tokens else None
        prediction = None
        if spec is not None:
            step_time = predict_step(
                last.timeline,
                spec,
                groups=groups,
                shape=shape,
                nproc_per_node=nproc_per_node,
                compiled=compile_regions(rec.name),
                pipeline=pipeline_of(rec.name),
                timing=assumptions.timing,
                comm=assumptions.comm,
            )
            prediction = predict(
                step_time,
                flops=last.flops,
                peak_tflops=specs.peak_tflops(spec, rec.dtype),
                tokens_per_step=rec_tokens,
                dtype=str(rec.dtype).removeprefix("torch."),
            )
            if session.moe:
                prediction.assumes["moe_routing"] = session.routing
        if times:
            _axes_comm(last.comm, groups, shape, nproc_per_node, into=comm, times=times)
            flops += last.flops * times
            if rec_tokens is not None:
                tokens = max(tokens or 0, rec_tokens)
            if prediction is not None:
                parts.append((prediction, last.flops, times))
        objects.append(
            {
                "index": rec.index,
                "strategy": rec.name,
                "calls": rec.calls,
                "measured": len(rec.measured),
                "skipped": rec.skipped,
                "repeated": rec.repeated,
                "per_iteration": times,
                "per_rank": {
                    "params": worst.params,
                    "buffers": worst.buffers,
                    "grads": worst.grads,
                    "optimizer": worst.optimizer,
                    "activations": worst.own_peak["activations"],
                    "peak": worst.peak,
                    "other_states": sum(worst.others.values()),
                    "peak_with_other_states": worst.total_peak,
                },
                "comm": own,
                "total_bus_bytes": _bus(own),
                "flops_per_step": last.flops,
                "fp8_flops_per_step": last.fp8_flops,
                "tokens_per_step": rec_tokens,
                "predicted": attrs.asdict(prediction) if prediction is not None else None,
            }
        )
    worst = _worst(session.measured)
    others = worst.others
    per_rank = {
        "params": worst.params + others.get("params", 0),
        "buffers": worst.buffers + others.get("buffers", 0),
        "grads": worst.grads,
        "optimizer": worst.optimizer + others.get("optimizer", 0),
        "activations": worst.own_peak["activations"],
        "temporary": worst.at_peak["temporary"],
        "comm_buffers": worst.at_peak["comm_buffers"],
        "peak": worst.total_peak,
        "host": worst.host,
    }
    at_peak = {c: worst.at_peak[c] + others.get(c, 0) for c in CATEGORIES}
    predicted = _combined(parts, tokens) if parts else None
    capacity = fits = headroom = None
    if spec is not None:
        capacity = spec.memory_bytes - assumptions.reserve_bytes
        headroom = capacity - worst.total_peak
        fits = headroom >= 0
    top = sorted(worst.by_module.items(), key=lambda kv: -kv[1])[:8]
    if worst.by_module.get(LOSS_ROW) and LOSS_ROW not in dict(top):  # the loss's row, however small
        top.append((LOSS_ROW, worst.by_module[LOSS_ROW]))
    notes = list(session.notes)
    if worst.trace is not None and device != "cpu":  # the caching allocator's segments (a device's)
        from .allocator import Options, replay

        # the allocator's own configuration, as the real run's processes would read it
        options = Options.from_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        reserved = replay(worst.trace, capacity=capacity, options=options)
        if reserved.allocated != worst.peak:  # the replay's own check: the tracker's peak, to the byte
            notes.append(
                f"the caching allocator's replay allocated {reserved.allocated:,} bytes at its peak where the step's "
                f"peak is {worst.peak:,}: its reserved memory is left out (please report this)"
            )
        else:
            per_rank["reserved"] = reserved.reserved + sum(others.values())
        if reserved.over_capacity:
            notes.append(
                "the simulated caching allocator found no room for a request even after releasing its cached "
                "segments (fragmentation): the real run may run out of memory where the live peak fits; "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids most of it"
            )
    init = _init_report(session, nproc_per_node, capacity, assumptions, notes)
    if init is not None and init["fits"] is False:
        fits = False
    if session.requested_kinds:
        notes.append(
            f"the script asked for {', '.join(session.requested_kinds)}: ran as fake CPU tensors "
            "(CPU autocast casts a different op list than CUDA's; fused kernels are torch's CPU ones)"
        )
    peak_rec = next(r for r in session.records if any(x is worst for x in r.measured))
    if len(session.records) > 1:
        in_loop = ", ".join(f"{i} (x{n})" for i, n in sorted(loop.items()))
        notes.append(
            f"{len(session.records)} step objects called (see step_objects): communication, FLOPs and the "
            f"prediction sum one iteration of the loop, step objects {in_loop}; memory is step object "
            f"{peak_rec.index}'s peak with the other states alive beside it"
        )
    elif (
        session.stopped_by is not None
        and session.target is None
        and world > 1
        and "shard(" not in peak_rec.name
    ):
        notes.append(
            f"the step measured is not sharded over the {world} ranks (each trains the whole model); if the "
            "script trains another step object after this loop (a 2nd phase), --step 2 / step=2 measures it"
        )
    inner = [(i, n) for i, n in sorted(loop.items()) if n > 1]
    if inner:
        notes.append(
            "called several times per loop iteration (calls in a row: after the measured ones they were not run, "
            "the state returned unchanged; communication, FLOPs and the prediction count every call): "
            + ", ".join(f"step object {i} x{n}" for i, n in inner)
        )
    skipped = [r for r in session.records if r.skipped]
    if skipped:
        notes.append(
            "calls skipped (not run, the state returned unchanged) to reach step object "
            f"{session.target}: " + ", ".join(f"{r.skipped} of step object {r.index}" for r in skipped)
        )
    return Report(
        world_size=world,
        rank=rank,
        mesh=shape,
        device=device,
        gpu=spec.key if spec is not None else None,
        per_rank=per_rank,
        at_peak=at_peak,
        top_modules=top,
        comm=comm,
        total_bus_bytes=_bus(comm),
        flops_per_step=flops,
        tokens_per_step=tokens,
        micro_batch=session.micro_batch,
        predicted=predicted,
        capacity_bytes=capacity,
        fits=fits,
        headroom_bytes=headroom,
        max_micro_batch=session.max_micro_batch,
        steps=len(session.measured),
        notes=notes,
        skipped=list(session.skipped),
        strategy=peak_rec.name,
        ranks_tried=[rank],
        step_objects=objects,
        init=init,
        moe=_moe(session),
    )


def _moe(session: Session) -> dict[str, Any] | None:
    """The modelled MoE routing of the measured steps (`Assumptions.moe_routing`): `moe_imbalance`, the max/mean
    rows per expert of an ep group's batch (the worst layer; `accelfn.moe.step_metrics`'s definition), and
    `rank_load`, the rows the rank simulated received over the mean per ep rank (the worst layer; the busiest
    ep rank's under the "uniform" model)."""
    from ..moe.routing_model import imbalance

    if not session.moe:
        return None
    loads = []
    with session.real_tensors():  # (the report is made in the fake world; the counts are real)
        for counts, rank in session.moe.values():
            ep, experts = counts.shape
            per_rank = counts.sum(0).view(ep, experts // ep).sum(1).double()
            loads.append(float(per_rank[rank] / per_rank.mean().clamp_min(1e-12)))
        worst = max(imbalance(c) for c, _ in session.moe.values())
    return {
        "routing": session.routing,
        "moe_imbalance": worst,
        "rank_load": max(loads),
        "layers": len(session.moe),
        "ep": next(iter(session.moe.values()))[0].shape[0],
    }


def _init_report(
    session: Session, nproc_per_node: int, capacity: int | None, assumptions: Assumptions, notes: list[str]
) -> dict[str, Any] | None:
    """The memory held before the first training step (host and device, per rank; the host per node), whether
    it fits, and advice in `notes` where it does not."""
    from .report import gib

    t = session.init
    if t is None:
        return None
    host, device = t.peak["host"], t.peak["device"]
    per_node = host * nproc_per_node
    fits_host = per_node <= assumptions.host_memory_bytes
    fits_device = None if capacity is None or session.device_is_host else device <= capacity
    meta = (
        "build the model on the meta device (`with af.init_empty(): model = ...`): step.init shards it first "
        "and allocates only this rank's shards on the device, with the modules' own init rules; load weights "
        "into them with af.checkpoint.load_pretrained(path, like=state.params)"
    )
    if not fits_host:
        notes.append(
            f"before the first step each rank holds {gib(host)} on the host, {gib(per_node)} per node of "
            f"{nproc_per_node} ranks: more than the {gib(assumptions.host_memory_bytes)} of host memory "
            "assumed (--host-memory-gib). Every rank builds the whole model there; " + meta
        )
    if fits_device is False:
        notes.append(
            f"step.init holds {gib(device)} on the device, more than its {gib(capacity or 0)} usable: the "
            "model is placed on the device whole before it is sharded; "
            + ("building it on the meta device (above) avoids that too" if not fits_host else meta)
        )
    return {
        "host_peak": host,
        "host_per_node": per_node,
        "host_memory": assumptions.host_memory_bytes,
        "device_peak": device,
        "fits_host": fits_host,
        "fits_device": fits_device,
        "fits": fits_host and fits_device is not False,
    }
