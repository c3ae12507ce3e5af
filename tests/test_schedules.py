"""Specification of the transformers-style schedules in `af.optim` against transformers and Accelerate.

The reference for each schedule is the transformers function it is named after (`get_*_schedule_with_warmup`,
`get_inverse_sqrt_schedule`) driving a real `torch.optim.SGD` through its `LambdaLR`: the lr the optimizer
uses at each update, the scheduler stepped after each. Then training: `af.train_step` with
`af.optim.adamw(schedule)` against `torch.optim.AdamW` with the transformers scheduler in a plain loop. Last,
the conversion the migration page gives for a scheduler passed to `accelerator.prepare`, against accelerate's
own `AcceleratedScheduler` stepping it `num_processes` times per update.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import accelerate.scheduler
import pytest
import torch
import transformers
from torch import nn
from torch._dynamo.testing import CompileCounter

import accelfn as af

PEAK = 2e-2
AFTER = 15  # updates compared past `total`


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The tensors here are tiny: intra-op threads only add barrier waits (tens of ms on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def torch_lrs(
    make_sched: Callable[[torch.optim.Optimizer], Any], updates: int, lr: float = PEAK
) -> list[float]:
    """The lr torch uses at each of `updates` optimizer steps, `scheduler.step()` after each."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_sched(opt)
    lrs = []
    for _ in range(updates):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def af_lrs(schedule: Any, updates: int) -> torch.Tensor:
    """The lr `schedule` gives at counts 0..updates-1, as the optimizers call it (an int64 0-d tensor)."""
    got = [schedule(torch.tensor(t, dtype=torch.int64)) for t in range(updates)]
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == torch.float32 for v in got)
    return torch.stack(got).double()


def assert_lrs_equal(got: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Values at every update against transformers' schedules on torch.optim.SGD.
# Each case: (accelfn schedule, transformers scheduler on an optimizer whose lr is PEAK, `total` or None).
# ---------------------------------------------------------------------------------------------------------

tf = transformers.optimization

CASES: dict[str, tuple[af.optim.Schedule, Callable[[torch.optim.Optimizer], Any], int]] = {
    "linear": (
        af.optim.warmup_linear(PEAK, 10, 100),
        lambda o: tf.get_linear_schedule_with_warmup(o, 10, 100),
        100,
    ),
    "linear_no_warmup": (
        af.optim.warmup_linear(PEAK, 0, 37),
        lambda o: tf.get_linear_schedule_with_warmup(o, 0, 37),
        37,
    ),
    "linear_warmup_is_total": (
        af.optim.warmup_linear(PEAK, 12, 12),
        lambda o: tf.get_linear_schedule_with_warmup(o, 12, 12),
        12,
    ),
    "linear_one_update_warmup": (
        af.optim.warmup_linear(PEAK, 1, 25),
        lambda o: tf.get_linear_schedule_with_warmup(o, 1, 25),
        25,
    ),
    "constant": (
        af.optim.warmup_constant(PEAK, 10),
        lambda o: tf.get_constant_schedule_with_warmup(o, 10),
        60,
    ),
    "constant_no_warmup": (
        af.optim.warmup_constant(PEAK, 0),
        lambda o: tf.get_constant_schedule_with_warmup(o, 0),
        20,
    ),
    "polynomial_default_end_power": (
        af.optim.warmup_polynomial(PEAK, 10, 100),
        lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, 10, 100),
        100,
    ),
    "polynomial_power_2": (
        af.optim.warmup_polynomial(PEAK, 0, 40, end=1e-4, power=2.0),
        lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, 0, 40, lr_end=1e-4, power=2.0),
        40,
    ),
    "polynomial_power_half_end_0": (
        af.optim.warmup_polynomial(PEAK, 5, 33, end=0.0, power=0.5),
        lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, 5, 33, lr_end=0.0, power=0.5),
        33,
    ),
    "polynomial_power_0": (  # peak up to and at total, then end
        af.optim.warmup_polynomial(PEAK, 3, 20, end=1e-3, power=0.0),
        lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, 3, 20, lr_end=1e-3, power=0.0),
        20,
    ),
    "cosine_restarts_1_cycle": (
        af.optim.warmup_cosine_restarts(PEAK, 10, 100),
        lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, 10, 100),
        100,
    ),
    "cosine_restarts_3_cycles": (
        af.optim.warmup_cosine_restarts(PEAK, 0, 60, cycles=3),
        lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, 0, 60, num_cycles=3),
        60,
    ),
    "cosine_restarts_2_cycles_odd": (
        af.optim.warmup_cosine_restarts(PEAK, 7, 52, cycles=2),
        lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, 7, 52, num_cycles=2),
        52,
    ),
    "inverse_sqrt": (
        af.optim.inverse_sqrt(PEAK, 10),
        lambda o: tf.get_inverse_sqrt_schedule(o, 10),
        100,
    ),
    "inverse_sqrt_timescale": (
        af.optim.inverse_sqrt(PEAK, 4, timescale=20),
        lambda o: tf.get_inverse_sqrt_schedule(o, 4, timescale=20),
        100,
    ),
    "inverse_sqrt_no_warmup": (  # timescale defaults to 10_000
        af.optim.inverse_sqrt(PEAK, 0),
        lambda o: tf.get_inverse_sqrt_schedule(o, 0),
        100,
    ),
    "from_lambda_table": (
        af.optim.from_lambda(
            PEAK,
            functools.partial(
                tf._get_cosine_schedule_with_warmup_lr_lambda,
                num_warmup_steps=5,
                num_training_steps=50,
                num_cycles=1.0,
            ),
            steps=50 + AFTER,
        ),
        lambda o: tf.get_cosine_schedule_with_warmup(o, 5, 50, num_cycles=1.0),
        50,
    ),
    "from_lambda_on_the_host": (
        af.optim.from_lambda(PEAK, lambda k: 0.97**k),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.97**k),
        80,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_equals_the_transformers_schedule_at_every_update(name: str) -> None:
    schedule, make_sched, total = CASES[name]
    updates = total + AFTER
    assert_lrs_equal(af_lrs(schedule, updates), torch_lrs(make_sched, updates))


@pytest.mark.parametrize(("warmup", "total"), [(10, 100), (0, 50), (1, 9), (7, 7)])
def test_warmup_cosine_equals_get_cosine_schedule_with_warmup_up_to_total_then_holds_end(
    warmup: int, total: int
) -> None:
    schedule = af.optim.warmup_cosine(PEAK, warmup, total)
    expected = torch_lrs(lambda o: tf.get_cosine_schedule_with_warmup(o, warmup, total), total + AFTER)
    got = af_lrs(schedule, total + AFTER)
    assert_lrs_equal(got[: total + 1], expected[: total + 1])
    # past `total` transformers' cosine (num_cycles=0.5) climbs back towards the peak; ours stays at `end`
    assert got[total + 1 :].eq(0).all()
    assert expected[total + 2] > 0


WARMUP_PAST_TOTAL = {  # warmup > total: transformers' functions take it; the warm-up never ends
    "linear": (
        lambda w, t: af.optim.warmup_linear(PEAK, w, t),
        lambda w, t: lambda o: tf.get_linear_schedule_with_warmup(o, w, t),
    ),
    "cosine": (
        lambda w, t: af.optim.warmup_cosine(PEAK, w, t),
        lambda w, t: lambda o: tf.get_cosine_schedule_with_warmup(o, w, t),
    ),
    "polynomial": (
        lambda w, t: af.optim.warmup_polynomial(PEAK, w, t, end=1e-4, power=2.0),
        lambda w, t: lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, w, t, lr_end=1e-4, power=2.0),
    ),
    "cosine_restarts": (
        lambda w, t: af.optim.warmup_cosine_restarts(PEAK, w, t, cycles=2),
        lambda w, t: lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, w, t, num_cycles=2),
    ),
}


@pytest.mark.parametrize("name", list(WARMUP_PAST_TOTAL))
@pytest.mark.parametrize(("warmup", "total"), [(100, 30), (31, 30), (5, 0)])
def test_warmup_longer_than_total_gives_transformers_numbers_with_a_warning(
    name: str, warmup: int, total: int
) -> None:
    make, make_sched = WARMUP_PAST_TOTAL[name]
    with pytest.warns(
        af.optim.WarmupPastTotalWarning, match=rf"warmup={warmup} > total={total}: .* never ends"
    ):
        schedule = make(warmup, total)
    updates = warmup + AFTER
    got, expected = af_lrs(schedule, updates), torch_lrs(make_sched(warmup, total), updates)
    if name == "cosine":  # equal through the end of the warm-up; then transformers' cosine climbs back
        got, expected = got[: warmup + 2], expected[: warmup + 2]
    assert_lrs_equal(got, expected)
    assert got[total] == pytest.approx(PEAK * total / warmup, rel=1e-6)  # still rising at `total`


def test_warmup_up_to_total_gives_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    af.optim.warmup_linear(PEAK, 30, 30)
    af.optim.warmup_cosine(PEAK, 0, 30)
    af.optim.warmup_polynomial(PEAK, 29, 30)
    af.optim.warmup_cosine_restarts(PEAK, 30, 30)
    assert not [w for w in recwarn if issubclass(w.category, af.optim.WarmupPastTotalWarning)]


@pytest.mark.parametrize("num_processes", [2, 3])
def test_accelerate_port_on_small_data_warmup_past_total(
    num_processes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nlp_example's num_warmup_steps=100 on a data set of 40 updates, converted as the migration page says."""
    warmup, total = 100, 40
    updates = math.ceil(warmup / num_processes) + 3
    with pytest.warns(af.optim.WarmupPastTotalWarning):
        schedule = af.optim.warmup_linear(PEAK, warmup / num_processes, total / num_processes)
    expected = accelerate_lrs(
        lambda o: tf.get_linear_schedule_with_warmup(o, warmup, total), updates, num_processes, 1, monkeypatch
    )
    assert_lrs_equal(af_lrs(schedule, updates), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_in_float32_as_on_accelerators_is_within_float32_round_off(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On accelerators the count is computed in float32 (`af.platforms.count_dtype`), not float64.
    schedule, make_sched, total = CASES[name]
    expected = torch_lrs(make_sched, total + AFTER)
    monkeypatch.setattr(af.platforms, "count_dtype", lambda device: torch.float32)
    got = af_lrs(schedule, total + AFTER)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=PEAK * 1e-6)


def test_from_lambda_holds_the_value_at_steps_past_the_table() -> None:
    s = af.optim.from_lambda(0.1, lambda k: 1 / (k + 1), steps=4)
    assert [float(s(torch.tensor(t))) for t in (4, 5, 1000)] == [pytest.approx(0.02, rel=1e-6)] * 3


def test_schedules_on_the_update_count_trace_into_one_graph_with_no_host_sync() -> None:
    schedules = [s for name, (s, _, _) in CASES.items() if name != "from_lambda_on_the_host"]
    schedules.append(af.optim.warmup_cosine(PEAK, 10, 100))
    for s in schedules:  # as `tx.init` does, eagerly (from_lambda copies its table to the count's device)
        s(torch.tensor(0))
    counter = CompileCounter()
    fn = torch.compile(
        lambda count: torch.stack([s(count) for s in schedules]), backend=counter, fullgraph=True
    )
    for t in (0, 3, 57, 200):
        count = torch.tensor(t, dtype=torch.int64)
        torch.testing.assert_close(fn(count), torch.stack([s(count) for s in schedules]))
    assert counter.frame_count == 1  # the count is a tensor: no recompile when it changes


# ---------------------------------------------------------------------------------------------------------
# Training: af.train_step + af.optim.adamw(schedule) against torch.optim.AdamW + the transformers scheduler.
# ---------------------------------------------------------------------------------------------------------

STEPS = 40


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


BATCHES = [
    (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
    for g in [torch.Generator().manual_seed(1)]
    for _ in range(STEPS)
]


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


# Each case: accelfn schedule, transformers scheduler, both for STEPS updates with warm-up and decay.
TRAINING: dict[str, tuple[af.optim.Schedule, Callable[[torch.optim.Optimizer], Any]]] = {
    "warmup_linear": (
        af.optim.warmup_linear(PEAK, 5, 30),
        lambda o: tf.get_linear_schedule_with_warmup(o, 5, 30),
    ),
    "warmup_constant": (
        af.optim.warmup_constant(PEAK, 5),
        lambda o: tf.get_constant_schedule_with_warmup(o, 5),
    ),
    "warmup_polynomial": (
        af.optim.warmup_polynomial(PEAK, 5, 30, end=1e-3, power=2.0),
        lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, 5, 30, lr_end=1e-3, power=2.0),
    ),
    "warmup_cosine": (
        af.optim.warmup_cosine(PEAK, 5, STEPS),
        lambda o: tf.get_cosine_schedule_with_warmup(o, 5, STEPS),
    ),
    "warmup_cosine_restarts": (
        af.optim.warmup_cosine_restarts(PEAK, 5, 30, cycles=2),
        lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, 5, 30, num_cycles=2),
    ),
    "inverse_sqrt": (af.optim.inverse_sqrt(PEAK, 5), lambda o: tf.get_inverse_sqrt_schedule(o, 5)),
    "from_lambda": (
        af.optim.from_lambda(PEAK, lambda k: min(1.0, (k + 1) / 5) * 0.9**k, steps=STEPS),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: min(1.0, (k + 1) / 5) * 0.9**k),
    ),
}


@pytest.mark.parametrize("name", list(TRAINING))
def test_train_step_with_schedule_equals_torch_adamw_with_the_transformers_scheduler(name: str) -> None:
    schedule, make_sched = TRAINING[name]
    step = af.train_step(mse, af.optim.adamw(schedule, weight_decay=0.1))
    state = step.init(make_mlp())
    ours, our_lrs = [], []
    for batch in BATCHES:
        state, metrics = step(state, batch)
        ours.append(metrics["loss"].item())
        our_lrs.append(float(metrics["lr"]))

    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK, weight_decay=0.1, foreach=False)
    sched = make_sched(opt)
    theirs, their_lrs = [], []
    for batch in BATCHES:
        their_lrs.append(opt.param_groups[0]["lr"])
        loss = mse(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        theirs.append(loss.item())

    assert our_lrs == pytest.approx(their_lrs, rel=1e-6, abs=1e-12)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    ref = dict(model.named_parameters())
    assert max(float((state.params[k].detach() - ref[k].detach()).abs().max()) for k in ref) <= 1e-5
    assert int(state.step) == STEPS


# ---------------------------------------------------------------------------------------------------------
# The migration page's conversion: a scheduler passed to `accelerator.prepare` (AcceleratedScheduler, the
# default split_batches=False) steps `num_processes` times per update, and not at all on the micro-steps of
# gradient accumulation; the accelfn schedule with warmup and total divided by num_processes is equal.
# ---------------------------------------------------------------------------------------------------------


def accelerate_lrs(
    make_sched: Callable[[torch.optim.Optimizer], Any],
    updates: int,
    num_processes: int,
    accumulation: int,
    monkeypatch: pytest.MonkeyPatch,
) -> list[float]:
    """The lr of each of `updates` optimizer updates of an Accelerate loop, `lr_scheduler.step()` called after
    every micro-batch as in Accelerate's examples, through accelerate's own `AcceleratedScheduler`."""
    monkeypatch.setattr(
        accelerate.scheduler, "AcceleratorState", lambda: types.SimpleNamespace(num_processes=num_processes)
    )
    gradient_state = types.SimpleNamespace(sync_gradients=True, adjust_scheduler=False)
    monkeypatch.setattr(accelerate.scheduler, "GradientState", lambda: gradient_state)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    opt.step_was_skipped = False  # as AcceleratedOptimizer says after a step that was not skipped
    sched = accelerate.scheduler.AcceleratedScheduler(make_sched(opt), opt)
    lrs = []
    for _ in range(updates):
        for micro in range(accumulation):
            gradient_state.sync_gradients = micro == accumulation - 1
            if gradient_state.sync_gradients:
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
            sched.step()
    return lrs


@pytest.mark.parametrize(("num_processes", "accumulation"), [(2, 1), (3, 1), (4, 2), (8, 4)])
def test_accelerate_scheduler_steps_num_processes_times_so_accelfn_divides_its_counts(
    num_processes: int, accumulation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmup, total = 100, 1000  # Accelerate's num_warmup_steps, num_training_steps (not multiples of 3 or 8)
    updates = math.ceil(total / num_processes) + 3
    cases = [
        (
            af.optim.warmup_linear(PEAK, warmup / num_processes, total / num_processes),
            lambda o: tf.get_linear_schedule_with_warmup(o, warmup, total),
        ),
        (
            af.optim.warmup_cosine(PEAK, warmup / num_processes, total / num_processes),
            lambda o: tf.get_cosine_schedule_with_warmup(o, warmup, total),
        ),
        (
            af.optim.warmup_polynomial(PEAK, warmup / num_processes, total / num_processes, power=2.0),
            lambda o: tf.get_polynomial_decay_schedule_with_warmup(o, warmup, total, power=2.0),
        ),
        (
            af.optim.warmup_cosine_restarts(PEAK, warmup / num_processes, total / num_processes, cycles=3),
            lambda o: tf.get_cosine_with_hard_restarts_schedule_with_warmup(o, warmup, total, num_cycles=3),
        ),
        (
            af.optim.warmup_constant(PEAK, warmup / num_processes),
            lambda o: tf.get_constant_schedule_with_warmup(o, warmup),
        ),
        (
            af.optim.inverse_sqrt(PEAK, warmup / num_processes),
            lambda o: tf.get_inverse_sqrt_schedule(o, warmup),
        ),
    ]
    for schedule, make_sched in cases:
        expected = accelerate_lrs(make_sched, updates, num_processes, accumulation, monkeypatch)
        got = af_lrs(schedule, updates)
        if (
            schedule == cases[1][0]
        ):  # warmup_cosine: transformers' cosine climbs back past total, ours stays 0
            until = total // num_processes + 1  # the updates whose scheduler count is <= total
            assert got[until:].eq(0).all()
            got, expected = got[:until], expected[:until]
        assert_lrs_equal(got, expected)
    # and the naive port (Accelerate's numbers unchanged) follows another curve
    naive = af_lrs(af.optim.warmup_linear(PEAK, warmup, total), updates)
    expected = accelerate_lrs(cases[0][1], updates, num_processes, accumulation, monkeypatch)
    assert not torch.allclose(naive, torch.tensor(expected, dtype=torch.float64), rtol=1e-2)


# ---------------------------------------------------------------------------------------------------------
# Arguments are checked, naming the culprit.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: af.optim.warmup_linear(-1e-3, 0, 5), "peak must be a finite number >= 0"),
        (lambda: af.optim.warmup_linear(1e-3, -1, 5), "warmup must be a finite number >= 0"),
        (lambda: af.optim.warmup_linear(1e-3, 0, float("nan")), "total must be a finite number >= 0"),
        (lambda: af.optim.warmup_constant(1e-3, -2), "warmup_constant: warmup must be"),
        (lambda: af.optim.warmup_cosine(1e-3, 1, 5, end=-1.0), "warmup_cosine: end must be"),
        (
            lambda: af.optim.warmup_polynomial(1e-3, 5, 5),
            r"warmup must differ from total .* got warmup=5, total=5",
        ),
        (lambda: af.optim.warmup_polynomial(1e-3, 0, 5, end=1e-3), "end must be < peak, got end=0.001"),
        (lambda: af.optim.warmup_polynomial(1e-3, 0, 5, power=-1.0), "power must be a finite number >= 0"),
        (lambda: af.optim.warmup_cosine_restarts(1e-3, 0, 5, cycles=0), "cycles must be an int >= 1"),
        (lambda: af.optim.inverse_sqrt(1e-3, 0, timescale=0), "timescale must be a finite number > 0"),
        (lambda: af.optim.inverse_sqrt(1e-3, -5), "inverse_sqrt: warmup must be"),
        (lambda: af.optim.from_lambda(1e-3, lambda k: 1.0, steps=-1), "steps must be >= 0"),
        (lambda: af.optim.from_lambda(1e-3, lambda k: 1.0 - k, steps=3), r"lr \* fn\(2\) must be a finite"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_wrong_argument_types_raise_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match="'cycles'"):
        af.optim.warmup_cosine_restarts(1e-3, 0, 5, cycles=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'warmup'"):
        af.optim.warmup_linear(1e-3, "10", 100)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'fn'"):
        af.optim.from_lambda(1e-3, 0.5)  # type: ignore[arg-type]


def test_schedules_print_their_settings() -> None:
    assert repr(af.optim.warmup_linear(1e-3, 10, 100)) == "_WarmupLinear(peak=0.001, warmup=10, total=100)"
    assert "cycles=3" in repr(af.optim.warmup_cosine_restarts(1e-3, 0, 9, cycles=3))
    assert "timescale=10000" in repr(af.optim.inverse_sqrt(1e-3, 0))
