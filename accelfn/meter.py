"""`af.Meter`: throughput, step time, data wait, FLOP/s, MFU and memory of a training loop, over the mesh.

A `Meter` wraps a step and is called in its place. It times every call on the host (no device
synchronisation per step), counts the FLOPs of one step once (torch's `FlopCounterMode` on the first, real
step), and `figures()`, called at log intervals, synchronises the device once and gathers every rank's
figures with one collective.

Example:
    >>> import torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1))
    >>> state = step.init(torch.nn.Linear(8, 1))
    >>> meter = af.Meter(step, peak_tflops=1.0)
    >>> for _ in range(3):
    ...     state, metrics = meter(state, {"x": torch.randn(4, 8), "y": torch.randn(4, 1)})
    >>> figures = meter.figures()
    >>> figures["steps"], figures["flops_per_step"], "samples_per_s" in figures, "mfu" in figures
    (2, 128, True, True)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import flop_counter

from . import platforms
from . import tree as _tree
from .mesh import Mesh
from .state import TrainState
from .step import Step

__all__ = ["Meter", "count_flops"]


# torch counts attention in its GPU kernels (flash, memory-efficient, cuDNN); its CPU flash kernel takes the same
# leading arguments, so the same formulas count it (otherwise a CPU run would count no attention FLOPs at all).
def _sdpa(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))


def _sdpa_backward(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad, query, key, value))


_CPU_ATTENTION: dict[Any, Any] = {
    op: formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward),
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
}


def count_flops() -> flop_counter.FlopCounterMode:
    """A `FlopCounterMode` (not printing) that also counts torch's CPU attention kernel.

    Example:
        >>> import torch
        >>> from accelfn.meter import count_flops
        >>> with count_flops() as counter:
        ...     _ = torch.ones(2, 3) @ torch.ones(3, 4)
        >>> counter.get_total_flops()
        48
    """
    return flop_counter.FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


def _batch_size(batch: Any, tokens: Callable[[Any], int] | None) -> tuple[int | None, int | None]:
    """(tokens, samples) of one batch: `tokens(batch)` or the numel of the first integer tensor; the rows of
    the first tensor."""
    leaves = [x for x in _tree.leaves(batch) if isinstance(x, torch.Tensor)]
    samples = int(leaves[0].shape[0]) if leaves and leaves[0].ndim > 0 else None
    if tokens is not None:
        return int(tokens(batch)), samples
    ids = next(
        (x for x in leaves if not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool),
        None,
    )
    return (int(ids.numel()) if ids is not None else None), samples


class Meter:
    """Wraps `step`: `state, metrics = meter(state, batch)` runs it and keeps the loop's statistics.

    - `figures()` (call it on every rank, at log intervals) returns the global figures over the steps since the
      last call: `steps`, `tokens_per_s` and `samples_per_s` (summed over the data-parallel ranks),
      `step_time` and `data_wait` (seconds per step: time inside the step, and time between the end of one
      call and the start of the next, i.e. what the loop spent getting data; the slowest rank's),
      `flops_per_step` (this rank's), `tflops` (achieved TFLOP/s per device), `mfu` (`tflops` / the
      device's dense peak), `memory_peak` and `memory_reserved` (device bytes, the largest rank's) and
      `host_rss` (bytes, the largest rank's); for an MoE step whose metrics carry them (expert parallel's),
      `moe_imbalance` (the largest over these steps: the most loaded expert's rows over the mean) and
      `moe_dropped` (the mean dropped fraction, with a capacity factor). Figures that are not known are left out,
      never guessed.
    - `postfix()`: a short dict of this rank's recent figures for `af.progress(...).set_postfix` (no
      synchronisation, no collective).

    The first call is a warm-up: it runs under torch's `FlopCounterMode` (a real training step, counted once;
    eagerly, so under `af.compile` the graph is compiled on the second call) and is left out of the rates.
    Later batches are assumed to cost the counted FLOPs per token (per sample when there are no tokens).
    `tokens(batch) -> int` counts a batch's tokens (default: the numel of its first integer tensor, the ids).
    `mesh` defaults to `af.shard`'s mesh; `peak_tflops` overrides `Platform.peak_tflops`. `window` is the
    number of recent steps `postfix()` averages over; `clock` is the timer (seconds).

    Example:
        >>> import torch, accelfn as af
        >>> step = af.train_step(lambda m, b: m(b).float().mean(), af.optim.sgd(0.1))
        >>> state = step.init(torch.nn.Embedding(10, 4))
        >>> meter = af.Meter(step)
        >>> for _ in range(3):
        ...     state, _ = meter(state, torch.randint(0, 10, (2, 5)))
        >>> meter.figures()["flops_per_step"], sorted(meter.postfix())
        (0, ['step', 'tok/s', 'wait'])
    """

    def __init__(
        self,
        step: Step,
        *,
        mesh: Mesh | None = None,
        tokens: Callable[[Any], int] | None = None,
        peak_tflops: float | None = None,
        window: int = 20,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(step, Step):
            raise TypeError(f"Meter(step): expected an af.Step, got {type(step).__name__}")
        if window < 1:
            raise ValueError(f"Meter: window must be >= 1, got {window}")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"Meter: peak_tflops must be > 0, got {peak_tflops}")
        if mesh is None:
            shard = next((t for t in step.transforms if t.kind == "shard"), None)
            mesh = getattr(shard, "mesh", None)
        self.step = step
        self.mesh = mesh
        self.tokens = tokens
        self.peak_tflops = peak_tflops
        self.clock = clock
        self.flops: int | None = None  # FLOPs of the counted first step (this rank)
        self.first_step_time: float | None = None  # seconds (includes counting and, later, nothing else)
        self._flops_basis: tuple[str, int] | None = (
            None  # ("tokens"|"samples"|"step", count of the first step)
        )
        self._last_end: float | None = None
        self._recent: collections.deque[tuple[float, int, int, float, float]] = collections.deque(
            maxlen=window + 1
        )
        self._reset(None)

    def _reset(self, start: float | None) -> None:
        self._start = start
        self._steps = 0
        self._tokens = 0
        self._samples = 0
        self._flops_total = 0.0
        self._step_time = 0.0
        self._wait = 0.0
        self._moe: dict[
            str, torch.Tensor
        ] = {}  # MoE metrics over these steps (on the device: no sync per step)
        self._moe_steps = 0

    def _track_moe(self, out: Any) -> None:
        """Keep the step's global MoE metrics (`moe_imbalance`: the largest, `moe_dropped`: summed)."""
        metrics = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else {}
        imbalance, dropped = metrics.get("moe_imbalance"), metrics.get("moe_dropped")
        if imbalance is None:
            return
        self._moe_steps += 1
        for key, value, join in (
            ("moe_imbalance", imbalance, torch.maximum),
            ("moe_dropped", dropped, torch.add),
        ):
            if value is not None:
                value = value.detach().float()
                self._moe[key] = join(self._moe[key], value) if key in self._moe else value.clone()

    # ---- running ---------------------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> Any:
        start = self.clock()
        wait = start - self._last_end if self._last_end is not None else 0.0
        ntokens, nsamples = _batch_size(batch, self.tokens)
        if self.flops is None:
            with torch.compiler.set_stance("force_eager"), count_flops() as counter:
                out = self.step(state, batch)
            end = self.clock()
            self.flops = int(counter.get_total_flops())
            self._flops_basis = (
                ("tokens", ntokens) if ntokens else ("samples", nsamples) if nsamples else ("step", 1)
            )
            self.first_step_time = end - start
            self._last_end = end
            self._reset(end)
            self._recent.append((end, 0, 0, 0.0, 0.0))
            return out
        out = self.step(state, batch)
        end = self.clock()
        self._last_end = end
        self._steps += 1
        self._tokens += ntokens or 0
        self._samples += nsamples or 0
        self._flops_total += self._step_flops(ntokens, nsamples)
        self._step_time += end - start
        self._wait += wait
        self._recent.append((end, ntokens or 0, nsamples or 0, end - start, wait))
        self._track_moe(out)
        return out

    def _step_flops(self, ntokens: int | None, nsamples: int | None) -> float:
        assert self.flops is not None and self._flops_basis is not None
        basis, first = self._flops_basis
        now = {"tokens": ntokens, "samples": nsamples, "step": 1}[basis]
        return self.flops * (now or 0) / first if first else 0.0

    # ---- figures ---------------------------------------------------------------------------------------------
    @property
    def _platform(self) -> platforms.Platform:
        return self.mesh.platform if self.mesh is not None else self.step.plan.platform

    def _device(self) -> torch.device:
        return self.mesh.device if self.mesh is not None else self.step.plan.device

    def _compute_dtype(self) -> torch.dtype:
        plan = self.step.plan
        if plan.autocast_dtype is not None:
            return plan.autocast_dtype
        if any(t.kind == "fp8" for t in plan.transforms):
            return torch.bfloat16  # fp8 training is quoted against the bf16 peak, as torchtitan does
        dtypes = [p.dtype for p in plan.module.parameters() if p.is_floating_point()]
        return dtypes[0] if dtypes else torch.float32

    def peak(self) -> float | None:
        """The dense peak TFLOP/s of one device that MFU divides by (the override, else the platform's table)."""
        if self.peak_tflops is not None:
            return float(self.peak_tflops)
        return self._platform.peak_tflops(self._compute_dtype(), self._device())

    def _memory(self) -> tuple[float, float, float]:
        try:
            stats = self._platform.memory_stats(self._device())
        except (NotImplementedError, RuntimeError):
            stats = {}
        host = platforms.get("cpu").memory_stats()
        return (
            float(stats.get("peak_allocated", -1)),
            float(stats.get("reserved", -1)),
            float(host.get("allocated", -1)),
        )

    def figures(self) -> dict[str, float | int]:
        """The global figures over the steps since the last call (see the class docs). Collective: every rank of
        the mesh calls it; synchronises the device once.

        Example:
            >>> import torch, accelfn as af
            >>> step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
            >>> state = step.init(torch.nn.Linear(2, 1))
            >>> meter = af.Meter(step)
            >>> state, _ = meter(state, torch.ones(3, 2))
            >>> meter.figures()["steps"]   # the first (counted) step is not in the rates
            0
        """
        self._platform.synchronize(self._device())
        now = self.clock()
        elapsed = now - self._start if self._start is not None else 0.0
        mine = [
            float(self._tokens),
            float(self._samples),
            self._flops_total,
            elapsed,
            self._step_time,
            self._wait,
            float(self._steps),
            *self._memory(),
        ]
        rows = self._gather(mine)
        steps = int(mine[6])
        moe = {k: float(v) / (self._moe_steps if k == "moe_dropped" else 1) for k, v in self._moe.items()}
        self._reset(now if self._start is not None else None)

        out: dict[str, float | int] = {"steps": steps}
        if self.flops is not None:
            out["flops_per_step"] = self.flops
        world = len(rows)
        data = self.mesh.data_size if self.mesh is not None else 1
        timed = [r for r in rows if r[3] > 0 and r[6] > 0]
        if timed:
            share = data / world  # ranks of one model-parallel group read the same tokens
            if any(r[0] for r in timed):
                out["tokens_per_s"] = sum(r[0] / r[3] for r in timed) * share
            if any(r[1] for r in timed):
                out["samples_per_s"] = sum(r[1] / r[3] for r in timed) * share
            out["step_time"] = max(r[4] / r[6] for r in timed)
            out["data_wait"] = max(r[5] / r[6] for r in timed)
            if self.flops is not None:
                tflops = sum(r[2] / r[3] for r in timed) / len(timed) / 1e12
                out["tflops"] = tflops
                peak = self.peak()
                if peak is not None:
                    out["mfu"] = tflops / peak
        for i, key in ((7, "memory_peak"), (8, "memory_reserved"), (9, "host_rss")):
            value = max(r[i] for r in rows)
            if value >= 0:
                out[key] = int(value)
        return {**out, **moe}  # the MoE metrics are global already (the step reduced them over the ranks)

    def _gather(self, mine: list[float]) -> list[list[float]]:
        """Every rank's row of figures, with one all-gather (sums, means and maxima all come from it)."""
        if (
            self.mesh is None
            or not dist.is_available()
            or not dist.is_initialized()
            or dist.get_world_size() == 1
        ):
            return [mine]
        device = self.mesh.device
        row = torch.tensor(mine, dtype=torch.float64, device=device)
        out = torch.empty(dist.get_world_size() * len(mine), dtype=torch.float64, device=device)
        gather = (
            getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        )  # renamed in torch 2.13
        gather(out, row)
        return out.view(dist.get_world_size(), len(mine)).tolist()

    def postfix(self) -> dict[str, str]:
        """This rank's figures over the last `window` steps, short, for a progress bar: `tok/s` (or `samples/s`;
        times the data-parallel ranks, assuming even shards), `step` and `wait` times, `mfu`.

        Example:
            >>> import torch, accelfn as af
            >>> step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
            >>> state = step.init(torch.nn.Linear(2, 1))
            >>> meter = af.Meter(step)
            >>> for _ in range(3):
            ...     state, _ = meter(state, torch.ones(3, 2))
            >>> sorted(meter.postfix())
            ['samples/s', 'step', 'wait']
        """
        recent = list(self._recent)
        if len(recent) < 2:
            return {}
        steps = recent[1:]
        elapsed = recent[-1][0] - recent[0][0]
        ntokens, nsamples = sum(s[1] for s in steps), sum(s[2] for s in steps)
        data = self.mesh.data_size if self.mesh is not None else 1
        out: dict[str, str] = {}
        if elapsed > 0 and ntokens:
            out["tok/s"] = _short(ntokens / elapsed * data)
        elif elapsed > 0 and nsamples:
            out["samples/s"] = _short(nsamples / elapsed * data)
        out["step"] = _seconds(sum(s[3] for s in steps) / len(steps))
        out["wait"] = _seconds(sum(s[4] for s in steps) / len(steps))
        peak = self.peak() if self.flops else None
        if peak is not None and elapsed > 0:
            flops = sum(self._step_flops(s[1] or None, s[2] or None) for s in steps)
            out["mfu"] = f"{100 * flops / elapsed / 1e12 / peak:.1f}%"
        return out

    def __repr__(self) -> str:
        return f"Meter({self.step!r})"


def _short(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g}ms" if x < 1 else f"{x:.3g}s"
