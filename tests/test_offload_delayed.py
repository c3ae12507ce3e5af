"""`af.offload(..., delayed_update_from=N)`: ZeRO-Offload's delayed parameter update, checked against a plain
PyTorch loop with `torch.optim.AdamW` that applies each step's gradients one step late."""

import importlib
import threading

import pytest
import torch
from torch import nn

import accelfn as af
from tests.test_transforms import max_diff, token_batch, token_loss, token_model

host_update = importlib.import_module("accelfn.transforms.host_update")
BATCHES = [token_batch(seed=s) for s in range(7)]


def delayed_reference(batches, start, clip=None):
    """torch.optim.AdamW; from step `start` on, step t's (clipped) gradients are applied after step t+1's backward."""
    model = token_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    pending, losses = None, []
    for t, b in enumerate(batches):
        if b is None:  # no new step: apply what is pending (af.apply_pending_update)
            apply, pending = pending, None
        else:
            loss = nn.functional.cross_entropy(
                model(b["x"]).reshape(-1, 5), b["y"].reshape(-1), ignore_index=-100
            )
            loss.backward()
            losses.append(loss.item())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            grads = [p.grad.clone() for p in params]
            apply = grads if t < start else pending
            if t >= start:
                pending = grads
        if apply is not None:
            for p, g in zip(params, apply):
                p.grad = g
            opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in model.named_parameters()}, losses


def delayed_step(start, keep_master=False, clip=None):
    base = af.train_step(token_loss, af.optim.adamw(1e-2), clip_grad_norm=clip)
    return af.offload(base, params=keep_master, delayed_update_from=start)


@pytest.mark.parametrize("keep_master", [False, True], ids=["mirror", "host-master"])
@pytest.mark.parametrize("start", [0, 3])
def test_delayed_update_equals_a_plain_loop_applying_gradients_one_step_late(start, keep_master):
    ref_params, ref_losses = delayed_reference(BATCHES, start, clip=0.5)
    step = delayed_step(start, keep_master, clip=0.5)
    state = step.init(token_model())
    losses = []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert max_diff(state.params, ref_params) <= 1e-6
    assert (
        int(state.extra["offload_pending"]["full"]) == 1
    )  # the last step's gradients wait for the next step
    # and it is not the exact update: the same steps without the delay end elsewhere
    exact = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2), clip_grad_norm=0.5))
    exact_state = exact.init(token_model())
    for b in BATCHES:
        exact_state, _ = exact(exact_state, b)
    assert max_diff(exact_state.params, ref_params) > 1e-3
    assert "one step late" in repr(step)


def test_the_host_update_runs_during_the_next_steps_forward(monkeypatch):
    # The delayed update of step t-1 must be running while step t computes its loss: the update waits for the
    # forward to signal it (a sequential implementation would time out), on a thread that is not the caller's.
    forward_started = threading.Event()
    seen = []
    real = host_update.apply_gradients

    def update(tx, grads, opt_state, params):
        seen.append((threading.current_thread() is threading.main_thread(), forward_started.wait(timeout=30)))
        return real(tx, grads, opt_state, params)

    def loss_fn(model, batch):
        forward_started.set()
        return token_loss(model, batch)

    monkeypatch.setattr(host_update, "apply_gradients", update)
    step = af.offload(af.train_step(loss_fn, af.optim.adamw(1e-2)), delayed_update_from=0)
    state = step.init(token_model())
    for b in BATCHES[:4]:
        forward_started.clear()
        state, _ = step(state, b)
    assert (
        seen == [(False, True)] * 3
    )  # steps 1, 2, 3 applied the gradients of steps 0, 1, 2 during their forward


def test_a_checkpoint_with_a_pending_update_resumes_exactly(tmp_path):
    step = delayed_step(start=1)
    state = step.init(token_model())
    for b in BATCHES[:4]:
        state, _ = step(state, b)
    assert int(state.extra["offload_pending"]["full"]) == 1
    af.checkpoint.save(tmp_path / "c", state)
    for b in BATCHES[4:]:
        state, _ = step(state, b)
    fresh = delayed_step(start=1)
    resumed = af.checkpoint.load(tmp_path / "c", like=fresh.init(token_model()))
    for b in BATCHES[4:]:
        resumed, _ = fresh(resumed, b)
    assert max_diff(resumed.params, state.params) == 0.0
    assert max_diff(resumed.opt_state.mu, state.opt_state.mu) == 0.0


def test_a_failing_step_completes_the_pending_update_into_the_state_it_was_given():
    # The pending update (step 2's gradients) runs during step 3; step 3's loss raises. The state given to step 3
    # then holds that update applied and nothing pending: the same params and moments a successful step 3 gives.
    def loss_fn(model, batch):
        if batch.get("fail") is not None:
            raise RuntimeError("bad batch")
        return token_loss(model, batch)

    runs = {}
    for fail in (False, True):
        step = af.offload(af.train_step(loss_fn, af.optim.adamw(1e-2)), delayed_update_from=0)
        state = step.init(token_model())
        for b in BATCHES[:3]:
            state, _ = step(state, b)
        if fail:
            with pytest.raises(RuntimeError, match="bad batch"):
                step(state, {**BATCHES[3], "fail": torch.ones(1)})
            assert int(state.extra["offload_pending"]["full"]) == 0
        else:
            state, _ = step(state, BATCHES[3])
        runs[fail] = af.tree.map(torch.clone, state)  # (the next step updates the state in place)
        state, m = step(state, BATCHES[4])  # and it goes on from there
        assert torch.isfinite(m["loss"])
    assert max_diff(runs[True].params, runs[False].params) == 0.0
    assert max_diff(runs[True].opt_state.mu, runs[False].opt_state.mu) == 0.0
    assert int(runs[True].opt_state.count) == int(runs[False].opt_state.count) == 3


def test_a_failing_host_update_names_the_step(monkeypatch):
    def broken(*args):
        raise RuntimeError("out of host memory")

    step = delayed_step(start=0)
    state = step.init(token_model())
    state, _ = step(state, BATCHES[0])
    monkeypatch.setattr(host_update, "apply_gradients", broken)
    with pytest.raises(
        RuntimeError, match="delayed host update of step 0's gradients failed: out of host memory"
    ):
        step(state, BATCHES[1])


def test_delayed_update_errors_name_the_culprit():
    with pytest.raises(ValueError, match="delayed_update_from must be a step number >= 0, got -1"):
        delayed_step(start=-1)
    exact_state = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2))).init(token_model())
    step = delayed_step(start=0)
    step.init(token_model())
    with pytest.raises(ValueError, match="offload_pending"):
        step(exact_state, BATCHES[0])


def test_a_skipped_fp16_step_applies_the_pending_update_and_drops_its_own_gradients():
    def loss_fn(model, batch):
        return af.losses.cross_entropy(model(batch["x"]).float(), batch["y"])

    base = af.autocast(af.train_step(loss_fn, af.optim.adamw(1e-2)), "fp16")
    step = af.offload(base, delayed_update_from=0)
    state = step.init(token_model())
    for b in BATCHES[:3]:
        state, m = step(state, b)
        assert int(m["skipped"]) == 0
    before = af.tree.map(torch.clone, state.params)
    overflow = {**BATCHES[3], "x": BATCHES[3]["x"] * 1e30}
    state, m = step(state, overflow)
    assert int(m["skipped"]) == 1
    # step 2's gradients were applied during the skipped step; its own were dropped: nothing is pending
    assert int(state.opt_state.count) == 3 and int(state.extra["offload_pending"]["full"]) == 0
    assert max_diff(state.params, before) > 0
    state, m = step(state, BATCHES[4])  # nothing to apply: the count stays, step 4's gradients wait
    assert int(m["skipped"]) == 0 and int(state.opt_state.count) == 3
    assert int(state.extra["offload_pending"]["full"]) == 1


@pytest.mark.slow
def test_delayed_update_under_ddp_on_two_ranks_equals_the_plain_loop_on_the_global_batch():
    from tests._launch import output_of, run_workers

    proc = run_workers("offload_delayed_worker.py", 2, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("OK delayed offload under ddp") == 2, output_of(proc)


def test_without_donation_a_state_replays_to_the_same_result():
    # donate=False: each call works on a copy, so a later step must not overwrite the pending gradients of a
    # state still held (they were the updater's own buffers once)
    base = af.train_step(token_loss, af.optim.adamw(1e-2), donate=False)
    step = af.offload(base, delayed_update_from=0)
    s1, _ = step(step.init(token_model()), BATCHES[0])
    held = af.tree.map(torch.clone, s1.extra["offload_pending"])
    s2, _ = step(s1, BATCHES[1])
    step(s2, BATCHES[2])
    assert max_diff(s1.extra["offload_pending"]["grads"], held["grads"]) == 0.0
    again, _ = step(s1, BATCHES[1])
    assert max_diff(again.params, s2.params) == 0.0


def test_a_step_failing_after_its_update_leaves_a_state_that_retries_exactly():
    # An error after the pending update was joined (here an after-update hook; also Ctrl-C, a metrics
    # reduction): the state given holds that update committed (moments, count, params) and nothing pending.
    step = delayed_step(start=0)
    state = step.init(token_model())
    for b in BATCHES[:3]:
        state, _ = step(state, b)

    def interrupted(module):
        raise KeyboardInterrupt

    step.plan.after_update.append(interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(state, BATCHES[3])
    step.plan.after_update.remove(interrupted)
    assert int(state.opt_state.count) == 3 and int(state.extra["offload_pending"]["full"]) == 0
    state, _ = step(state, BATCHES[3])
    uninterrupted = delayed_step(start=0)
    other = uninterrupted.init(token_model())
    for b in BATCHES[:4]:
        other, _ = uninterrupted(other, b)
    assert max_diff(state.params, other.params) == 0.0 and int(state.opt_state.count) == 3


@pytest.mark.parametrize("delayed", [False, True], ids=["exact", "delayed"])
def test_a_checkpoint_loaded_into_the_live_state_replaces_the_host_mirror(tmp_path, delayed):
    # Rolling back with load(path, like=state) writes the files straight into the params' memory; the host
    # mirror of the params must notice (version counters) or the next update would run on the newer params.
    def make():
        return af.offload(
            af.train_step(token_loss, af.optim.adamw(1e-2)), delayed_update_from=1 if delayed else None
        )

    step = make()
    state = step.init(token_model())
    step.plan.updater.always_stream = True  # the GPU's data path (the delayed update always takes it)
    for b in BATCHES[:4]:
        state, _ = step(state, b)
    af.checkpoint.save(tmp_path / "c", state)
    for b in BATCHES[4:]:
        state, _ = step(state, b)
    reference = af.tree.map(torch.clone, state.params)
    state = af.checkpoint.load(tmp_path / "c", like=state)
    for b in BATCHES[4:]:
        state, _ = step(state, b)
    assert max_diff(state.params, reference) == 0.0


def test_bf16_params_on_the_host_take_the_fp32_host_update():
    # bf16 params with the (fp32) offloaded state on a CPU-only machine: the update runs on an fp32 copy, as on a
    # GPU, not in place on the bf16 params (which failed: "expected scalar type BFloat16 but found Float")
    def loss_fn(model, batch):
        return af.losses.cross_entropy(model(batch["x"].bfloat16()).float(), batch["y"])

    results = []
    for stream in (False, True):
        for start in (None, 1):
            step = af.offload(af.train_step(loss_fn, af.optim.adamw(1e-2)), delayed_update_from=start)
            state = step.init(token_model().bfloat16())
            step.plan.updater.always_stream = stream
            for b in BATCHES[:3]:
                state, _ = step(state, b)
            results.append(state.params)
    exact, delayed, exact_streamed, delayed_streamed = results
    assert max_diff(exact, exact_streamed) == 0.0 and max_diff(delayed, delayed_streamed) == 0.0
    assert max_diff(exact, delayed) > 0


def test_apply_pending_update_applies_the_last_steps_gradients():
    ref_params, _ = delayed_reference([*BATCHES, None], start=1)  # None: one more step that only applies
    step = delayed_step(start=1)
    state = step.init(token_model())
    for b in BATCHES:
        state, _ = step(state, b)
    state = af.apply_pending_update(step, state)
    assert int(state.extra["offload_pending"]["full"]) == 0
    assert max_diff(state.params, ref_params) <= 1e-6
    again = af.apply_pending_update(step, state)  # nothing pending: unchanged
    assert max_diff(again.params, ref_params) <= 1e-6
    exact = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)))
    exact_state = exact.init(token_model())
    assert af.apply_pending_update(exact, exact_state) is exact_state
