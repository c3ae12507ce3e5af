"""Specification of `af.optim`: optimizers, clipping, masking and schedules against independent references.

The reference for SGD / Adam / AdamW, clipping and the schedules is `torch.optim` (single-tensor, for-loop
implementation) with `torch.optim.lr_scheduler`; Lion has no torch reference and is checked against a
per-tensor implementation of the paper's update rule written below. Every optimizer is checked on both paths:
the fused in-place `af.optim.apply_gradients` and the pure `tx.update` + `af.optim.apply_updates`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import accelfn as af

STEPS = 100
ATOL = 1e-5
CLIP = 0.05  # small enough that clipping is active on most steps of the MLP below


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The tensors here are tiny: intra-op threads only add barrier waits (tens of ms on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------------------
# The problem: a small float32 MLP with biases, fixed init and fixed random batches.
# ---------------------------------------------------------------------------------------------------------


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


BATCHES = [
    (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS)
]


def loss_of(model: nn.Module, params: dict[str, torch.Tensor] | None, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x) if params is None else torch.func.functional_call(model, params, (x,))
    return nn.functional.mse_loss(out, y)


def grads_of(model: nn.Module, params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    leaf = {k: v.detach().requires_grad_() for k, v in params.items()}
    gs = torch.autograd.grad(loss_of(model, leaf, batch), list(leaf.values()))
    return dict(zip(leaf, gs))


def initial_params() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in make_mlp().named_parameters()}


def train_af(tx: af.optim.GradientTransformation, path: str, steps: int = STEPS) -> tuple[dict, Any]:
    """Train with `tx` on `path` ("fused": apply_gradients in place, "pure": update + apply_updates)."""
    model = make_mlp()
    params = initial_params()
    state = tx.init(params)
    for batch in BATCHES[:steps]:
        grads = grads_of(model, params, batch)
        if path == "fused":
            state = af.optim.apply_gradients(tx, grads, state, params)
        else:
            updates, state = tx.update(grads, state, params)
            params = af.optim.apply_updates(params, updates)
    return params, state


def train_torch(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    make_sched: Callable[[torch.optim.Optimizer], Any] | None = None,
    clip: float | None = None,
    steps: int = STEPS,
) -> tuple[dict[str, torch.Tensor], int]:
    """Train the same MLP with torch; returns the params and the number of steps where clipping was active."""
    model = make_mlp()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    clipped = 0
    for batch in BATCHES[:steps]:
        opt.zero_grad()
        loss_of(model, None, batch).backward()
        if clip is not None:
            clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach() for k, v in model.named_parameters()}, clipped


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def is_bias(name: str) -> bool:
    return name.endswith("bias")


def torch_adamw_two_groups(model: nn.Module, lr: float, wd: float) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not is_bias(n)], "weight_decay": wd},
            {"params": [p for n, p in named if is_bias(n)], "weight_decay": 0.0},
        ],
        lr=lr,
        foreach=False,
    )


# Each case: (accelfn optimizer, torch optimizer with the same hyper-parameters).
OPTIMIZERS: dict[str, tuple[Callable[[], af.optim.GradientTransformation], Callable[[nn.Module], Any]]] = {
    "sgd": (
        lambda: af.optim.sgd(0.1),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, foreach=False),
    ),
    "sgd_momentum": (
        lambda: af.optim.sgd(0.05, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=False),
    ),
    "sgd_nesterov": (
        lambda: af.optim.sgd(0.05, momentum=0.9, nesterov=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=False),
    ),
    "sgd_weight_decay": (
        lambda: af.optim.sgd(0.1, weight_decay=0.05),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.05, foreach=False),
    ),
    "sgd_nesterov_weight_decay": (
        lambda: af.optim.sgd(0.05, momentum=0.8, nesterov=True, weight_decay=0.05),
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.05, foreach=False
        ),
    ),
    "adam": (
        lambda: af.optim.adam(1e-2),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False),
    ),
    "adam_custom_betas_eps": (
        lambda: af.optim.adam(5e-3, b1=0.8, b2=0.99, eps=1e-6),
        lambda m: torch.optim.Adam(m.parameters(), lr=5e-3, betas=(0.8, 0.99), eps=1e-6, foreach=False),
    ),
    "adam_weight_decay": (
        lambda: af.optim.adam(1e-2, weight_decay=0.1),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False),
    ),
    "adamw": (
        lambda: af.optim.adamw(1e-2, weight_decay=0.1),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False),
    ),
    "adamw_default_weight_decay": (
        lambda: af.optim.adamw(1e-2),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False),
    ),
    "adamw_mask_callable_no_decay_on_biases": (
        lambda: af.optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: not is_bias(k) for k in p}),
        lambda m: torch_adamw_two_groups(m, 1e-2, 0.1),
    ),
    "adamw_mask_pytree_no_decay_on_biases": (
        lambda: af.optim.adamw(1e-2, weight_decay=0.1, mask={k: not is_bias(k) for k in initial_params()}),
        lambda m: torch_adamw_two_groups(m, 1e-2, 0.1),
    ),
}


# ---------------------------------------------------------------------------------------------------------
# Optimizers against torch.optim, with and without clipping, on both paths.
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def torch_reference(name: str, clip: float | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """`train_torch` for `OPTIMIZERS[name]`, computed once and shared by the fused and pure tests."""
    return train_torch(OPTIMIZERS[name][1], clip=clip)


@pytest.mark.parametrize("path", ["fused", "pure"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_torch_optim_over_100_steps(name: str, path: str) -> None:
    params, state = train_af(OPTIMIZERS[name][0](), path)
    expected, _ = torch_reference(name)
    assert max_abs_diff(params, expected) <= ATOL
    assert int(state.count) == STEPS


@pytest.mark.parametrize("path", ["fused", "pure"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_chain_clip_by_global_norm_then_optimizer_matches_clip_grad_norm_then_step(
    name: str, path: str
) -> None:
    tx = af.optim.chain(af.optim.clip_by_global_norm(CLIP), OPTIMIZERS[name][0]())
    params, _ = train_af(tx, path)
    expected, clipped = torch_reference(name, CLIP)
    assert clipped > STEPS // 2, "the reference should actually clip, or this test checks nothing"
    assert max_abs_diff(params, expected) <= ATOL


def test_training_moves_the_params_so_the_comparisons_are_meaningful() -> None:
    params, _ = train_af(af.optim.adamw(1e-2), "fused")
    assert max_abs_diff(params, initial_params()) > 0.1


def test_clip_by_global_norm_scales_to_max_norm_and_leaves_small_updates_alone() -> None:
    tx = af.optim.clip_by_global_norm(1.0)
    big = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}
    out, _ = tx.update(big, tx.init(big))
    assert float(af.optim.global_norm(out)) == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    small = {"a": torch.tensor([0.3, 0.0]), "b": torch.tensor([[0.4]])}
    out, _ = tx.update({k: v.clone() for k, v in small.items()}, tx.init(small))
    assert all(torch.equal(out[k], small[k]) for k in small)


# ---------------------------------------------------------------------------------------------------------
# Fused kernels: one multi-tensor call per (device, dtype, weight-decay) group, not a python loop.
# ---------------------------------------------------------------------------------------------------------


def spy_on(monkeypatch: pytest.MonkeyPatch, kernel: str) -> list[int]:
    """Replace `torch.<kernel>` with a wrapper recording the number of tensors of each successful call."""
    original = getattr(torch, kernel)
    calls: list[int] = []

    def spy(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        out = original(params, *args, **kwargs)
        calls.append(len(params))
        return out

    monkeypatch.setattr(torch, kernel, spy)
    return calls


@pytest.mark.parametrize(
    ("kernel", "make_tx"),
    [
        ("_fused_adamw_", lambda: af.optim.adamw(1e-2, weight_decay=0.1)),
        ("_fused_adamw_", lambda: af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-2))),
        ("_fused_adam_", lambda: af.optim.adam(1e-2, weight_decay=0.1)),
        ("_fused_sgd_", lambda: af.optim.sgd(0.1)),
        ("_fused_sgd_", lambda: af.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ],
    ids=["adamw", "chain_clip_adamw", "adam", "sgd", "sgd_nesterov_weight_decay"],
)
def test_apply_gradients_runs_one_fused_kernel_call_for_all_params(
    monkeypatch: pytest.MonkeyPatch, kernel: str, make_tx: Callable[[], Any]
) -> None:
    calls = spy_on(monkeypatch, kernel)
    tx = make_tx()
    assert tx.apply is not None
    model, params = make_mlp(), initial_params()
    state = tx.init(params)
    for step, batch in enumerate(BATCHES[:3], start=1):
        state = af.optim.apply_gradients(tx, grads_of(model, params, batch), state, params)
        assert calls == [len(params)] * step  # one call per apply, all 6 tensors in it


def test_adamw_with_mask_runs_one_fused_call_per_weight_decay_group(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_on(monkeypatch, "_fused_adamw_")
    tx = af.optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: not is_bias(k) for k in p})
    model, params = make_mlp(), initial_params()
    af.optim.apply_gradients(tx, grads_of(model, params, BATCHES[0]), tx.init(params), params)
    assert sorted(calls) == [3, 3]  # 3 weights with decay, 3 biases without


def test_apply_gradients_updates_params_in_place() -> None:
    tx = af.optim.adamw(1e-2)
    model, params = make_mlp(), initial_params()
    storage = {k: v.data_ptr() for k, v in params.items()}
    before = {k: v.clone() for k, v in params.items()}
    af.optim.apply_gradients(tx, grads_of(model, params, BATCHES[0]), tx.init(params), params)
    assert {k: v.data_ptr() for k, v in params.items()} == storage
    assert max_abs_diff(params, before) > 0


PURE_TRANSFORMS: dict[str, Callable[[], af.optim.GradientTransformation]] = {
    **{name: make_tx for name, (make_tx, _) in OPTIMIZERS.items()},
    "lion_weight_decay": lambda: af.optim.lion(1e-3, weight_decay=0.1),
    "chain_clip_adamw": lambda: af.optim.chain(af.optim.clip_by_global_norm(CLIP), af.optim.adamw(1e-2)),
    "masked_sgd": lambda: af.optim.masked(
        af.optim.sgd(0.1, momentum=0.9), {k: True for k in initial_params()}
    ),
}


@pytest.mark.parametrize("name", list(PURE_TRANSFORMS))
def test_update_does_not_modify_params(name: str) -> None:
    tx = PURE_TRANSFORMS[name]()
    model, params = make_mlp(), initial_params()
    before = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    for batch in BATCHES[:2]:
        _, state = tx.update(grads_of(model, params, batch), state, params)
    assert all(torch.equal(params[k], before[k]) for k in params)


def test_apply_updates_returns_new_params_and_leaves_the_input_unchanged() -> None:
    params = {"w": torch.ones(2)}
    out = af.optim.apply_updates(params, {"w": torch.full((2,), 0.5)})
    assert out["w"].tolist() == [1.5, 1.5]
    assert params["w"].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------
# Schedules: values per step against torch.optim.lr_scheduler, then training with them.
# ---------------------------------------------------------------------------------------------------------

BASE_LR = 2e-2

# Each case: (accelfn schedule, torch scheduler on an optimizer whose lr is BASE_LR, steps to compare).
SCHEDULES: dict[str, tuple[Any, Callable[[torch.optim.Optimizer], Any] | None, int]] = {
    "constant": (af.optim.constant(BASE_LR), None, STEPS),
    "linear": (
        af.optim.linear(1e-2, 1e-3, 50),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, end_factor=0.05, total_iters=50),
        STEPS,
    ),
    "cosine": (
        af.optim.cosine(BASE_LR, 100, 1e-4),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100, eta_min=1e-4),
        STEPS,
    ),
    "warmup_cosine": (
        af.optim.warmup_cosine(BASE_LR, warmup=10, total=100, end=1e-4, init=2e-3),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=10),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=90, eta_min=1e-4),
            ],
            milestones=[10],
        ),
        STEPS,
    ),
    "callable_returning_tensor": (
        lambda step: BASE_LR * 0.97 ** step.double(),  # float64: 0.97**99 in float32 is off by 3e-6
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.97**t),
        STEPS,
    ),
    "callable_returning_float": (
        lambda step: BASE_LR if int(step) < 40 else BASE_LR / 10,
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[40], gamma=0.1),
        STEPS,
    ),
}


def torch_lrs(make_sched: Callable[[torch.optim.Optimizer], Any] | None, steps: int) -> list[float]:
    """The lr torch uses at each of the first `steps + 1` optimizer steps (scheduler.step() after each)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR)
    sched = make_sched(opt) if make_sched else None
    lrs = []
    for _ in range(steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_values_match_torch_lr_scheduler_at_every_step(name: str) -> None:
    schedule, make_sched, steps = SCHEDULES[name]
    fn = af.optim.as_schedule(schedule)
    expected = torch_lrs(make_sched, steps)
    got = [fn(torch.tensor(t)) for t in range(steps + 1)]
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == torch.float32 for v in got)
    torch.testing.assert_close(
        torch.stack(got).double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-9
    )


@functools.cache
def torch_adamw_with_scheduler(name: str) -> tuple[dict[str, torch.Tensor], int]:
    return train_torch(
        lambda m: torch.optim.AdamW(m.parameters(), lr=BASE_LR, weight_decay=0.1, foreach=False),
        SCHEDULES[name][1],
    )


@pytest.mark.parametrize("path", ["fused", "pure"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_adamw_with_schedule_matches_torch_adamw_with_lr_scheduler(name: str, path: str) -> None:
    schedule, make_sched, _ = SCHEDULES[name]
    params, state = train_af(af.optim.adamw(schedule, weight_decay=0.1), path)
    expected, _ = torch_adamw_with_scheduler(name)
    assert max_abs_diff(params, expected) <= ATOL
    assert float(state.lr) == pytest.approx(torch_lrs(make_sched, STEPS)[STEPS - 1], rel=1e-6)


def test_sgd_with_schedule_matches_torch_sgd_with_lr_scheduler() -> None:
    schedule, make_sched, _ = SCHEDULES["warmup_cosine"]
    for path in ("fused", "pure"):
        params, _ = train_af(af.optim.sgd(schedule, momentum=0.9), path)
        expected, _ = train_torch(
            lambda m: torch.optim.SGD(m.parameters(), lr=BASE_LR, momentum=0.9, foreach=False), make_sched
        )
        assert max_abs_diff(params, expected) <= ATOL, path


def test_warmup_cosine_from_zero_follows_the_closed_form() -> None:
    peak, warmup, total, end = 3e-3, 10, 60, 1e-4
    s = af.optim.warmup_cosine(peak, warmup=warmup, total=total, end=end)

    def expected(t: int) -> float:
        if t < warmup:
            return peak * t / warmup
        frac = min(t - warmup, total - warmup) / (total - warmup)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))

    for t in range(total + 20):
        assert float(s(torch.tensor(t))) == pytest.approx(expected(t), rel=1e-6, abs=1e-12), t
    assert float(s(torch.tensor(0))) == 0.0
    assert float(s(torch.tensor(warmup))) == pytest.approx(peak, rel=1e-6)
    assert float(s(torch.tensor(total + 5))) == pytest.approx(end, rel=1e-6)


def test_linear_and_cosine_hold_their_end_value_after_the_last_step() -> None:
    lin, cos = af.optim.linear(1e-2, 1e-3, 20), af.optim.cosine(1e-2, 20, 1e-4)
    for t in (20, 21, 1000):
        assert float(lin(torch.tensor(t))) == pytest.approx(1e-3, rel=1e-6)
        assert float(cos(torch.tensor(t))) == pytest.approx(1e-4, rel=1e-6)


def test_state_lr_and_count_are_tensors_recording_the_last_update() -> None:
    schedule = af.optim.linear(1e-2, 1e-3, 10)
    tx = af.optim.adamw(schedule)
    _, state = train_af(tx, "fused", steps=4)
    assert (
        isinstance(state.count, torch.Tensor) and state.count.ndim == 0 and state.count.dtype == torch.int64
    )
    assert int(state.count) == 4
    assert isinstance(state.lr, torch.Tensor) and state.lr.ndim == 0
    assert float(state.lr) == pytest.approx(1e-2 + (1e-3 - 1e-2) * 3 / 10, rel=1e-6)  # lr of update #4 (t=3)


def test_learning_rate_finds_the_lr_inside_a_chain_state() -> None:
    tx = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.sgd(af.optim.cosine(0.1, 10)))
    for path in ("fused", "pure"):
        _, state = train_af(tx, path, steps=3)
        lr = af.optim.learning_rate(state)
        assert isinstance(lr, torch.Tensor)
        assert lr is state[1].lr
        assert float(lr) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 2 / 10)), rel=1e-6)


def test_learning_rate_is_none_for_a_state_without_one() -> None:
    tx = af.optim.clip_by_global_norm(1.0)
    assert af.optim.learning_rate(tx.init({"w": torch.ones(1)})) is None


# ---------------------------------------------------------------------------------------------------------
# Lion against the paper's update rule.
# ---------------------------------------------------------------------------------------------------------


def train_lion_reference(lr: float, b1: float, b2: float, wd: float, decay: Callable[[str], bool]) -> dict:
    """Lion, one tensor at a time: c = b1*m + (1-b1)*g; p -= lr*(sign(c) + wd*p); m = b2*m + (1-b2)*g."""
    model = make_mlp()
    params = initial_params()
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    for batch in BATCHES:
        grads = grads_of(model, params, batch)
        for k in params:
            p, g, m = params[k], grads[k], mu[k]
            c = b1 * m + (1 - b1) * g
            params[k] = p - lr * (torch.sign(c) + (wd if decay(k) else 0.0) * p)
            mu[k] = b2 * m + (1 - b2) * g
    return params


@pytest.mark.parametrize("path", ["fused", "pure"])
@pytest.mark.parametrize(
    ("kwargs", "reference"),
    [
        ({}, {"b1": 0.9, "b2": 0.99, "wd": 0.0, "decay": lambda k: True}),
        (
            {"b1": 0.8, "b2": 0.95, "weight_decay": 0.5},
            {"b1": 0.8, "b2": 0.95, "wd": 0.5, "decay": lambda k: True},
        ),
        (
            {"weight_decay": 0.5, "mask": lambda p: {k: not is_bias(k) for k in p}},
            {"b1": 0.9, "b2": 0.99, "wd": 0.5, "decay": lambda k: not is_bias(k)},
        ),
    ],
    ids=["defaults", "betas_and_decay", "decay_masked_off_biases"],
)
def test_lion_matches_the_papers_update_rule_over_100_steps(kwargs: dict, reference: dict, path: str) -> None:
    params, state = train_af(af.optim.lion(1e-3, **kwargs), path)
    expected = train_lion_reference(1e-3, **reference)
    assert max_abs_diff(params, expected) <= ATOL
    assert int(state.count) == STEPS


# ---------------------------------------------------------------------------------------------------------
# masked(tx, mask)
# ---------------------------------------------------------------------------------------------------------

MASK = {
    "0.weight": True,
    "0.bias": False,
    "2.weight": True,
    "2.bias": False,
    "4.weight": False,
    "4.bias": True,
}


def test_masked_passes_masked_out_leaves_through_unchanged() -> None:
    tx = af.optim.masked(af.optim.adam(1e-2), MASK)
    model, params = make_mlp(), initial_params()
    state = tx.init(params)
    for batch in BATCHES[:5]:
        grads = grads_of(model, params, batch)
        kept = {k: v.clone() for k, v in grads.items()}
        updates, state = tx.update(grads, state, params)
        for k, on in MASK.items():
            if not on:
                assert torch.equal(updates[k], kept[k]), k


def test_masked_leaves_equal_the_inner_transform_applied_to_the_subset() -> None:
    tx = af.optim.masked(af.optim.sgd(0.1, momentum=0.9, weight_decay=0.01), MASK)
    inner = af.optim.sgd(0.1, momentum=0.9, weight_decay=0.01)
    model, params = make_mlp(), initial_params()
    subset = [k for k, on in MASK.items() if on]
    state, inner_state = tx.init(params), inner.init({k: params[k] for k in subset})
    for batch in BATCHES[:5]:
        grads = grads_of(model, params, batch)
        sub_grads = {k: grads[k].clone() for k in subset}
        updates, state = tx.update(grads, state, params)
        expected, inner_state = inner.update(sub_grads, inner_state, {k: params[k] for k in subset})
        for k in subset:
            torch.testing.assert_close(updates[k], expected[k], atol=0, rtol=0)
        params = af.optim.apply_updates(params, updates)


def test_masked_accepts_a_callable_mask_and_keeps_inner_state_for_the_subset_only() -> None:
    tx = af.optim.masked(af.optim.adam(1e-2), lambda p: {k: is_bias(k) for k in p})
    state = tx.init(initial_params())
    assert sorted(state.inner_state.mu) == ["0.bias", "2.bias", "4.bias"]


def test_chain_of_masked_transforms_trains_weights_and_biases_differently() -> None:
    no_decay = {k: is_bias(k) for k in initial_params()}
    decay = {k: not v for k, v in no_decay.items()}
    tx = af.optim.chain(
        af.optim.masked(af.optim.adamw(1e-2, weight_decay=0.1), decay),
        af.optim.masked(af.optim.adamw(1e-2, weight_decay=0.0), no_decay),
    )
    expected, _ = train_torch(lambda m: torch_adamw_two_groups(m, 1e-2, 0.1))
    for path in ("fused", "pure"):
        params, _ = train_af(tx, path)
        assert max_abs_diff(params, expected) <= ATOL, path


def test_freeze_zeroes_the_masked_updates_and_set_to_zero_all() -> None:
    params = initial_params()
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    frozen = {k: is_bias(k) for k in params}
    tx = af.optim.chain(af.optim.sgd(0.1), af.optim.freeze(frozen))
    updates, _ = tx.update(grads, tx.init(params), params)
    for k, u in updates.items():
        assert torch.equal(u, torch.zeros_like(u) if frozen[k] else torch.full_like(u, -0.1)), k
    tx = af.optim.freeze(lambda p: {k: True for k in p})  # a callable mask, as masked takes
    assert all(not u.any() for u in tx.update(grads, tx.init(params), params)[0].values())
    z = af.optim.set_to_zero()
    assert all(not u.any() for u in z.update(grads, z.init(params), params)[0].values())


# ---------------------------------------------------------------------------------------------------------
# Errors name the culprit.
# ---------------------------------------------------------------------------------------------------------


def test_adamw_with_a_string_learning_rate_raises_type_error_naming_lr() -> None:
    with pytest.raises(TypeError, match="'lr'"):
        af.optim.adamw("a")


def test_sgd_with_a_string_momentum_raises_type_error_naming_momentum() -> None:
    with pytest.raises(TypeError, match="'momentum'"):
        af.optim.sgd(0.1, momentum="x")


def test_sgd_nesterov_without_momentum_raises_value_error() -> None:
    with pytest.raises(ValueError, match="nesterov"):
        af.optim.sgd(0.1, nesterov=True)


@pytest.mark.parametrize(
    "make, culprit",
    [
        (lambda: af.optim.sgd(0.1, momentum=-0.5), "momentum=-0.5"),
        (lambda: af.optim.sgd(0.1, weight_decay=-0.5), "weight_decay=-0.5"),
        (lambda: af.optim.sgd(0.1, momentum=float("nan")), "momentum=nan"),
        (lambda: af.optim.lion(0.1, b1=1.0), "b1 must be in"),
        (lambda: af.optim.lion(0.1, weight_decay=-1.0), "weight_decay must be >= 0"),
    ],
)
def test_sgd_and_lion_refuse_out_of_range_hyperparameters(make, culprit) -> None:
    with pytest.raises(ValueError, match=re.escape(culprit)):
        make()


def test_chain_of_a_non_transformation_raises_type_error() -> None:
    with pytest.raises(TypeError, match="argument 0 is a int"):
        af.optim.chain(1)


@pytest.mark.parametrize("max_norm", [0, 0.0, -1.0])
def test_clip_by_global_norm_with_non_positive_max_norm_raises_value_error(max_norm: float) -> None:
    with pytest.raises(ValueError, match="max_norm"):
        af.optim.clip_by_global_norm(max_norm)


@pytest.mark.parametrize("path", ["init", "fused", "pure"])
def test_adamw_mask_not_matching_params_raises_value_error(path: str) -> None:
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    grads = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = af.optim.adamw(1e-2, mask={"w": True})
    with pytest.raises(ValueError, match="mask structure does not match params"):
        state = tx.init(params)  # checked as early as possible
    state = af.optim.adamw(1e-2, mask={"w": True, "b": False}).init(params)  # a state to update with
    if path == "init":
        return
    with pytest.raises(ValueError, match="mask structure does not match params"):
        if path == "fused":
            af.optim.apply_gradients(tx, grads, state, params)
        else:
            tx.update(grads, state, params)


def test_masked_mask_not_matching_params_raises_value_error() -> None:
    tx = af.optim.masked(af.optim.sgd(0.1), {"w": True, "extra": False})
    with pytest.raises(ValueError, match="masked: mask structure does not match params"):
        tx.init({"w": torch.ones(2)})


def test_weight_decay_without_params_in_update_raises_value_error() -> None:
    grads = {"w": torch.ones(2)}
    for tx in (
        af.optim.adamw(1e-2),
        af.optim.adam(1e-2, weight_decay=0.1),
        af.optim.sgd(0.1, weight_decay=0.1),
    ):
        with pytest.raises(ValueError, match="needs params"):
            tx.update(grads, tx.init(grads))


# ---------------------------------------------------------------------------------------------------------
# The state is a plain pytree of tensors.
# ---------------------------------------------------------------------------------------------------------


def test_adamw_state_is_a_pytree_of_tensors_with_named_paths() -> None:
    tx = af.optim.adamw(1e-2)
    _, state = train_af(tx, "fused", steps=2)
    flat = dict(af.tree.flatten_with_path(state))
    assert all(isinstance(v, torch.Tensor) for v in flat.values())
    assert {"count", "lr", "mu.0.weight", "mu.4.bias", "nu.2.weight"} <= flat.keys()
    assert len(flat) == 2 + 2 * 6
    assert flat["mu.0.weight"] is state.mu["0.weight"]


def test_chain_state_paths_index_the_parts_then_name_their_fields() -> None:
    tx = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.sgd(0.1, momentum=0.9))
    state = tx.init(initial_params())
    paths = [p for p, _ in af.tree.flatten_with_path(state)]
    assert paths[:2] == ["1.count", "1.lr"]
    assert "1.momentum.2.bias" in paths


def test_optimizer_state_round_trips_through_flatten_and_unflatten() -> None:
    tx = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-2))
    _, state = train_af(tx, "fused", steps=2)
    leaves, spec = af.tree.flatten(state)
    rebuilt = af.tree.unflatten(spec, [x.clone() for x in leaves])
    assert type(rebuilt[1]) is af.optim.AdamState
    assert all(torch.equal(a, b) for a, b in zip(af.tree.leaves(rebuilt), leaves))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: af.optim.adamw(-1e-3), "learning rate must be >= 0, got -0.001"),
        (lambda: af.optim.sgd(float("nan")), "learning rate must be >= 0, got nan"),
        (lambda: af.optim.adamw(1e-3, b1=1.0), r"adamw: b1 must be in \[0, 1\), got 1.0"),
        (lambda: af.optim.adam(1e-3, weight_decay=-0.1), "adam: eps and weight_decay must be >= 0"),
    ],
)
def test_invalid_hyperparameters_are_refused_like_torch_optim(make, message):
    with pytest.raises(ValueError, match=message):
        make()
