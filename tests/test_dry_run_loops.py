"""Where the dry run stops a script: its loop coming round, an inner loop (a GAN's critic steps) counted as many
times as it runs per iteration, and no code after the script's loop run on fake values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import accelfn as af


def _steps(mesh: af.Mesh) -> tuple[af.Step, af.Step]:
    critic = af.shard(af.train_step(lambda m, b: m(b).mean(), af.optim.adam(1e-3)), mesh)
    gen = af.shard(af.train_step(lambda m, b: m(b).mean(), af.optim.adam(1e-3)), mesh)
    return critic, gen


def _models() -> tuple[nn.Module, nn.Module]:
    return nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))


def test_an_inner_loop_counts_every_call_of_the_iteration() -> None:
    def wgan() -> None:  # 5 critic steps per generator step (WGAN's n_critic)
        mesh = af.Mesh({"dp": -1})
        critic, gen = _steps(mesh)
        c, g = _models()
        cs, gs = critic.init(c), gen.init(g)
        for _ in range(100):
            for _ in range(5):
                cs, _ = critic(cs, torch.zeros(8, 64))
            gs, _ = gen(gs, torch.zeros(8, 64))
        raise AssertionError("the dry run stops the loop")

    r = af.dry_run(wgan, nproc_per_node=8, device="cpu", search=False)
    got = [(s["calls"], s["repeated"], s["per_iteration"]) for s in r.step_objects]
    assert got == [(5, 4, 5), (1, 0, 1)]  # 4 critic calls skipped, the 6th stopped the script
    critic, gen = r.step_objects
    assert r.flops_per_step == 5 * critic["flops_per_step"] + gen["flops_per_step"]
    assert (
        r.comm["all_reduce"]["dp"]["count"]
        == 5 * critic["comm"]["all_reduce"]["dp"]["count"] + gen["comm"]["all_reduce"]["dp"]["count"]
    )
    assert any("step object 1 x5" in n for n in r.notes)


def _wgan_variant(kind: str) -> Callable[[], None]:
    def wgan() -> None:
        mesh = af.Mesh({"dp": -1})
        critic, gen = _steps(mesh)
        c, g = _models()
        cs, gs = critic.init(c), gen.init(g)
        batches = iter(range(10**6))
        for _ in range(100):
            for i in range(7):
                if kind == "with":
                    with torch.no_grad():  # the usual `fake = G(z)` before the critic's step
                        fake = torch.zeros(8, 64)
                elif kind == "try":
                    try:
                        next(batches)
                    except StopIteration:
                        batches = iter(range(10))
                    fake = torch.zeros(8, 64)
                else:  # "continue": 2 of the 7 inner iterations skip the critic
                    if i >= 5:
                        continue
                    fake = torch.zeros(8, 64)
                if kind != "continue" and i >= 5:
                    break
                cs, _ = critic(cs, fake)
            gs, _ = gen(gs, torch.zeros(8, 64))
        raise AssertionError("the dry run stops the loop")

    return wgan


@pytest.mark.parametrize("kind", ["with", "try", "continue"])
def test_inner_loops_with_with_try_continue_and_break(kind: str) -> None:
    """`with`, `try` and `continue` / `break` in the inner loop (their jumps differ by Python version; the
    dry run reads the loops from the source lines)."""
    r = af.dry_run(_wgan_variant(kind), nproc_per_node=8, device="cpu", search=False)
    assert [(s["calls"], s["repeated"], s["per_iteration"]) for s in r.step_objects] == [(5, 4, 5), (1, 0, 1)]


def test_the_code_after_the_loop_does_not_run() -> None:
    def epochs(n_epochs: int) -> None:
        mesh = af.Mesh({"dp": -1})
        step, _ = _steps(mesh)
        state = step.init(nn.Linear(64, 64))
        for _ in range(n_epochs):
            for _ in range(3):
                state, _ = step(state, torch.zeros(8, 64))
        raise AssertionError("ran after the loop")  # e.g. checks that read the trained values

    for n in (1, 2, 5):  # the loop comes round (a 2nd epoch), or it ends after the first
        r = af.dry_run(lambda n=n: epochs(n), nproc_per_node=8, device="cpu", search=False)
        (s,) = r.step_objects
        assert (s["calls"], s["repeated"], s["per_iteration"]) == (3, 2, 1), n


def test_a_single_loop_stops_at_its_second_call() -> None:
    def single() -> None:
        mesh = af.Mesh({"dp": -1})
        step, _ = _steps(mesh)
        state = step.init(nn.Linear(64, 64))
        for _ in range(1000):
            state, _ = step(state, torch.zeros(8, 64))

    r = af.dry_run(single, nproc_per_node=8, device="cpu", search=False)
    assert [(s["calls"], s["repeated"], s["per_iteration"]) for s in r.step_objects] == [(1, 0, 1)]


def test_an_epoch_loop_stops_after_16_calls_in_a_row_or_its_end() -> None:
    def epochs(batches: int) -> None:
        mesh = af.Mesh({"dp": -1})
        step, _ = _steps(mesh)
        state = step.init(nn.Linear(64, 64))
        for _ in range(3):
            for _ in range(batches):
                try:
                    state, _ = step(state, torch.zeros(8, 64))
                except RuntimeError:
                    continue
        raise AssertionError("ran after the loop")

    for batches, calls in ((1000, 16), (4, 4)):
        r = af.dry_run(lambda b=batches: epochs(b), nproc_per_node=8, device="cpu", search=False)
        assert [(s["calls"], s["per_iteration"]) for s in r.step_objects] == [(calls, 1)], batches


def test_an_inner_loop_in_another_function_stops_at_its_second_call() -> None:
    """The limit, pinned: the loops must be in one function for the dry run to see that one is inside the
    other; else the critic's second call stops the script (its loop came round, as far as it can tell)."""

    def wgan() -> None:
        mesh = af.Mesh({"dp": -1})
        critic, gen = _steps(mesh)
        c, g = _models()
        state = {"c": critic.init(c), "g": gen.init(g)}

        def train_critic() -> None:
            for _ in range(5):
                state["c"], _ = critic(state["c"], torch.zeros(8, 64))

        for _ in range(100):
            train_critic()
            state["g"], _ = gen(state["g"], torch.zeros(8, 64))

    r = af.dry_run(wgan, nproc_per_node=8, device="cpu", search=False)
    assert [(s["calls"], s["per_iteration"]) for s in r.step_objects] == [(1, 1)]


def test_no_tracer_is_left_behind() -> None:
    import sys

    before = sys.gettrace()

    def boom() -> None:
        mesh = af.Mesh({"dp": -1})
        step, _ = _steps(mesh)
        state = step.init(nn.Linear(64, 64))
        for _ in range(2):
            for i in range(3):
                if i == 2:
                    raise ValueError("the script's own error, inside the inner loop")
                state, _ = step(state, torch.zeros(8, 64))

    with pytest.raises(ValueError, match="the script's own error"):
        af.dry_run(boom, nproc_per_node=8, device="cpu", search=False)
    assert sys.gettrace() is before
