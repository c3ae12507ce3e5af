"""Combinators: accumulate, autocast, autocast_fp8, compile, offload, and the lowering rule."""

import copy
import importlib
import itertools
import os
import sys
import types

import pytest
import torch
from torch import nn

import accelfn as af
from tests.models import MLP, lm_batches, tiny_llama


def token_batch(rows=8, seq=6, vocab=5, seed=0):
    """A classification-per-token batch whose rows hold very different numbers of valid labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, seq, 8, generator=g)
    y = torch.randint(0, vocab, (rows, seq), generator=g)
    for r in range(rows):  # row r keeps r % seq + 1 valid positions
        y[r, (r % seq) + 1 :] = -100
    return {"x": x, "y": y}


def token_loss(model, batch):
    return af.losses.cross_entropy(model(batch["x"]), batch["y"])


def token_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))


def run(step, model, batches):
    state = step.init(model)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
    return state, losses


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---- accumulate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(
    "opt,tol", [(lambda: af.optim.sgd(0.5), 1e-6), (lambda: af.optim.adamw(1e-2), 2e-5)], ids=["sgd", "adamw"]
)
def test_accumulate_equals_the_full_batch_step_with_uneven_token_counts(n, opt, tol):
    batches = [token_batch(seed=s) for s in range(5)]
    full_state, full_losses = run(af.train_step(token_loss, opt()), token_model(), batches)
    acc_state, acc_losses = run(af.accumulate(af.train_step(token_loss, opt()), n), token_model(), batches)
    assert acc_losses == pytest.approx(full_losses, abs=1e-6)
    assert max_diff(acc_state.params, full_state.params) <= tol


def test_accumulate_differs_from_naive_mean_of_means():
    """The exactness is real: averaging per-micro-batch means (the common bug) gives another update."""
    batch = token_batch()
    model = token_model()
    ref = copy.deepcopy(model)
    state, _ = run(af.accumulate(af.train_step(token_loss, af.optim.sgd(0.5)), 4), model, [batch])
    for part in range(4):  # naive: mean loss per micro-batch, averaged
        sl = slice(2 * part, 2 * part + 2)
        loss = token_loss(ref, {"x": batch["x"][sl], "y": batch["y"][sl]}).mean() / 4
        loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert max_diff(state.params, dict(ref.named_parameters())) > 1e-4


def test_accumulate_with_mean_losses_equals_full_batch():
    x, y = torch.randn(12, 8), torch.randn(12, 4)

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    acc, _ = run(af.accumulate(af.train_step(loss_fn, af.optim.sgd(0.1)), 3), _seeded_mlp(), [(x, y)])
    ref = _seeded_mlp()  # a plain loop on the full batch
    loss_fn(ref, (x, y)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert max_diff(acc.params, dict(ref.named_parameters())) <= 1e-6


def _seeded_mlp():
    torch.manual_seed(0)
    return MLP()


def test_accumulate_uneven_weights_micro_batches_by_their_rows():
    x, y = torch.randn(10, 8), torch.randn(10, 4)

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    full, _ = run(af.train_step(loss_fn, af.optim.sgd(0.1)), _seeded_mlp(), [(x, y)])
    acc, _ = run(
        af.accumulate(af.train_step(loss_fn, af.optim.sgd(0.1)), 4, uneven=True), _seeded_mlp(), [(x, y)]
    )
    assert max_diff(acc.params, full.params) <= 1e-6


def test_accumulate_rejects_a_batch_not_divisible_by_microbatches():
    step = af.accumulate(af.train_step(token_loss, af.optim.sgd(0.1)), 4)
    state = step.init(token_model())
    with pytest.raises(ValueError, match=r"batch\['x'\] has 6 rows.*not divisible by 4.*uneven=True"):
        step(state, token_batch(rows=6))


# ---- autocast ---------------------------------------------------------------------------------------------------
def test_autocast_bf16_matches_a_plain_autocast_loop_and_keeps_fp32_master_weights():
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(5)]

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    model = _seeded_mlp()
    ref = copy.deepcopy(model)
    state, losses = run(
        af.autocast(af.train_step(loss_fn, af.optim.adamw(1e-2)), torch.bfloat16), model, batches
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(ref, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert max_diff(state.params, dict(ref.named_parameters())) <= 1e-6
    assert all(p.dtype == torch.float32 for p in state.params.values())
    assert state.opt_state.mu["fc1.weight"].dtype == torch.float32


def test_autocast_bf16_really_computes_in_bf16():
    seen = {}

    def loss_fn(m, b):
        out = m(b)
        seen["dtype"] = out.dtype
        return out.float().pow(2).mean()

    step = af.autocast(af.train_step(loss_fn, af.optim.sgd(0.1)), "bf16")
    state = step.init(MLP())
    step(state, torch.randn(4, 8))
    assert seen["dtype"] == torch.bfloat16


def test_fp16_skips_steps_with_inf_gradients_and_halves_the_scale():
    inject = {"on": True}

    def loss_fn(m, b):
        out = m(b).float().pow(2).mean()
        return out * torch.tensor(float("inf")) if inject["on"] else out

    step = af.autocast(af.train_step(loss_fn, af.optim.adamw(1e-2)), torch.float16)
    state = step.init(MLP())
    before = {k: v.detach().clone() for k, v in state.params.items()}
    scale0 = state.extra["loss_scale"]["scale"].item()
    state, metrics = step(state, torch.randn(4, 8))
    assert metrics["skipped"].item() == 1
    assert all(torch.equal(before[k], state.params[k]) for k in before)
    assert int(state.opt_state.count) == 0  # the optimizer never saw the step
    assert state.extra["loss_scale"]["scale"].item() == scale0 / 2
    inject["on"] = False
    state, metrics = step(state, torch.randn(4, 8))
    assert metrics["skipped"].item() == 0 and int(state.opt_state.count) == 1
    assert not torch.equal(before["fc1.weight"], state.params["fc1.weight"])


def test_fp16_scale_grows_after_the_interval():
    cfg = af.LossScaleConfig(init_scale=8.0, growth_interval=3)
    step = af.autocast(
        af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.sgd(0.01)),
        torch.float16,
        loss_scale=cfg,
    )
    state = step.init(MLP())
    scales = []
    for _ in range(7):
        state, metrics = step(state, torch.randn(4, 8))
        scales.append(state.extra["loss_scale"]["scale"].item())
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_fp16_result_matches_grad_scaler_reference():
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(4)]

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    model = _seeded_mlp()
    ref = copy.deepcopy(model)
    state, _ = run(af.autocast(af.train_step(loss_fn, af.optim.sgd(0.1)), torch.float16), model, batches)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for b in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ref, b)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert max_diff(state.params, dict(ref.named_parameters())) <= 1e-6


# ---- composition -----------------------------------------------------------------------------------------------
COMBINATORS = {
    "accumulate": lambda s: af.accumulate(s, 2),
    "autocast": lambda s: af.autocast(s, torch.bfloat16),
    "compile": lambda s: af.compile(s),
    "offload": lambda s: af.offload(s),
}


def _composed(names):
    step = af.train_step(token_loss, af.optim.sgd(0.5, momentum=0.9))
    for n in names:
        step = COMBINATORS[n](step)
    return step


def _result(names):
    torch._dynamo.reset()
    state, losses = run(_composed(names), token_model(), [token_batch(seed=s) for s in range(3)])
    return state, losses


def relative_update_error(params, ref_params, init_params):
    """max |update - reference update| / max |reference update| over all params (0 = the same training)."""
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    moved = max((ref_params[k] - init_params[k]).abs().max().item() for k in ref_params)
    assert moved > 0.05, f"the reference run barely trained (max update {moved})"
    return worst / moved


@pytest.mark.slow
@pytest.mark.parametrize(
    "names",
    [c for k in (2, 3) for c in itertools.combinations(COMBINATORS, k)],
    ids=lambda c: "+".join(c),
)
def test_every_pair_and_triple_gives_the_same_result_in_both_orders(names):
    forward_state, forward_losses = _result(names)
    backward_state, backward_losses = _result(tuple(reversed(names)))
    assert repr(_composed(names)) == repr(_composed(tuple(reversed(names))))
    assert backward_losses == pytest.approx(forward_losses, abs=1e-6)
    assert max_diff(forward_state.params, backward_state.params) <= 1e-6
    # and the composition is not a no-op: its updates match an independent plain loop (torch.optim.SGD on the
    # full batch, fp32) to bf16 precision where bf16 is on, to fp32 round-off otherwise
    ref = token_model()
    init = {k: p.detach().clone() for k, p in ref.named_parameters()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_losses = []
    for s in range(3):
        b = token_batch(seed=s)
        loss = nn.functional.cross_entropy(ref(b["x"]).reshape(-1, 5), b["y"].reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref_params = {k: p.detach() for k, p in ref.named_parameters()}
    bf16 = "autocast" in names
    assert relative_update_error(forward_state.params, ref_params, init) <= (
        0.015 if bf16 else 1e-5
    )  # bf16: ~3e-3
    assert forward_losses == pytest.approx(ref_losses, abs=2e-2 if bf16 else 1e-5)


def test_repr_shows_the_canonical_order():
    step = af.offload(
        af.compile(af.accumulate(af.autocast(af.train_step(token_loss, af.optim.sgd(0.1)), "bf16"), 4))
    )
    assert repr(step) == (
        "Step(train_step(token_loss) -> accumulate(4) -> autocast(bfloat16) -> compile() -> "
        "offload(optimizer_state=True, params=False))"
    )


def test_fp16_with_fp8_is_an_error_naming_both():
    step = af.autocast_fp8(
        af.autocast(af.train_step(token_loss, af.optim.sgd(0.1)), torch.float16), emulate=True
    )
    with pytest.raises(
        af.CompositionError, match=r"autocast_fp8\(.*autocast\(float16\)|autocast\(float16\).*autocast_fp8"
    ):
        step.init(token_model())


def test_applying_a_combinator_twice_is_an_error():
    with pytest.raises(af.CompositionError, match=r"accumulate\(2\) and accumulate\(4\)"):
        af.accumulate(af.accumulate(af.train_step(token_loss, af.optim.sgd(0.1)), 4), 2)


def test_combinator_arguments_are_checked():
    with pytest.raises(TypeError, match="'microbatches'"):
        af.accumulate(af.train_step(token_loss, af.optim.sgd(0.1)), "4")
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        af.autocast(af.train_step(token_loss, af.optim.sgd(0.1)), "fp4")
    with pytest.raises(ValueError, match="backend must be one of"):
        af.autocast_fp8(af.train_step(token_loss, af.optim.sgd(0.1)), backend="cuda")


def test_autocast_auto_follows_the_launcher_setting(monkeypatch):
    base = af.train_step(token_loss, af.optim.sgd(0.1))
    monkeypatch.setenv("ACCELFN_MIXED_PRECISION", "no")
    assert af.autocast(base) is base
    monkeypatch.setenv("ACCELFN_MIXED_PRECISION", "bf16")
    assert "autocast(bfloat16)" in repr(af.autocast(base))
    monkeypatch.setenv("ACCELFN_MIXED_PRECISION", "fp8")
    assert "autocast_fp8" in repr(af.autocast(base)) and "autocast(bfloat16)" in repr(af.autocast(base))


# ---- compile ---------------------------------------------------------------------------------------------------
def test_compile_matches_eager_and_does_not_recompile_after_step_two():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    batches = lm_batches(10, vocab=64)
    sched = af.optim.warmup_cosine(1e-2, warmup=3, total=10)

    def lm_loss(m, b):
        return af.losses.cross_entropy(m(input_ids=b["input_ids"]).logits[:, :-1], b["labels"][:, 1:])

    torch.manual_seed(0)
    model = tiny_llama()
    counters.clear()
    step = af.compile(af.train_step(lm_loss, af.optim.adamw(sched)))
    state = step.init(copy.deepcopy(model))
    losses, frames = [], []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
        frames.append(counters["stats"]["unique_graphs"])
    _, eager_losses = run(af.train_step(lm_loss, af.optim.adamw(sched)), copy.deepcopy(model), batches)
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    assert frames[1] == frames[-1], f"recompiled after step 2: graphs per step {frames}"


def test_regional_compile_compiles_each_block_and_matches_eager():
    from torch._dynamo.utils import counters

    def lm_loss(m, b):
        return af.losses.cross_entropy(m(input_ids=b["input_ids"]).logits[:, :-1], b["labels"][:, 1:])

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny_llama()
    eager_model = copy.deepcopy(model)
    batches = lm_batches(4, vocab=64)
    step = af.compile(af.train_step(lm_loss, af.optim.adamw(1e-2)), regions="blocks")
    state = step.init(model)
    assert "compiled 2/2 blocks of model.layers" in repr(step)
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    counters.clear()
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks really ran compiled
    eager, eager_losses = run(af.train_step(lm_loss, af.optim.adamw(1e-2)), eager_model, batches)
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    assert (
        max_diff(state.params, eager.params) <= 5e-5
    )  # AdamW amplifies the fused kernels' round-off (2.1e-5)


def test_regional_compile_without_blocks_is_a_clear_error():
    step = af.compile(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), regions="blocks")
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        step.init(nn.Linear(3, 3))


# ---- offload ---------------------------------------------------------------------------------------------------
def test_offload_keeps_optimizer_state_in_host_memory_with_identical_results():
    batches = [token_batch(seed=s) for s in range(4)]
    plain, plain_losses = run(af.train_step(token_loss, af.optim.adamw(1e-2)), token_model(), batches)
    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)))
    off, off_losses = run(step, token_model(), batches)
    assert off_losses == plain_losses
    assert max_diff(off.params, plain.params) == 0.0
    assert all(t.device.type == "cpu" for t in af.tree.leaves(off.opt_state))


def test_offload_host_update_uses_this_processs_share_of_the_cores(monkeypatch):
    # `accelfn launch` sets OMP_NUM_THREADS=1 for N processes per node; the host update (memory-bound CPU Adam)
    # runs on cores / LOCAL_WORLD_SIZE threads, and the process's own setting is restored after it
    off = importlib.import_module("accelfn.transforms.host_update")
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert off.share_of_cores() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert off.share_of_cores() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)))
    state = _streaming(step, token_model())
    during = []
    real = off.apply_gradients
    monkeypatch.setattr(off, "apply_gradients", lambda *a: during.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step(state, token_batch(seed=0))
        assert during == [cores] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _streaming(step, model):
    """init `step` and force its host updater to stream (copy params/grads out, write back) as on a GPU."""
    state = step.init(model)
    step.plan.updater.always_stream = True
    return state


@pytest.mark.parametrize("keep_master", [False, True], ids=["stream-params", "host-master"])
def test_offload_streaming_update_equals_the_plain_step(keep_master, monkeypatch):
    # On a GPU the update runs on host copies and the new params are copied back; force that path on the
    # CPU and check it against the plain step, and that it really updated copies, not the params in place.
    off = importlib.import_module("accelfn.transforms.host_update")
    batches = [token_batch(seed=s) for s in range(4)]
    plain, plain_losses = run(af.train_step(token_loss, af.optim.adamw(1e-2)), token_model(), batches)
    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)), params=keep_master)
    state = _streaming(step, token_model())
    seen = []
    real = off.apply_gradients
    monkeypatch.setattr(off, "apply_gradients", lambda tx, g, o, p: seen.append(p) or real(tx, g, o, p))
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    assert losses == plain_losses and max_diff(state.params, plain.params) == 0.0
    ptrs = {p.data_ptr() for p in state.params.values()}
    assert len(seen) == 4 and all(p.data_ptr() not in ptrs for d in seen for p in d.values())
    # with host master params, the same host tensors are updated every step; without, fresh copies each step
    assert (len({id(d) for d in seen}) == 1) == keep_master


def test_offload_host_master_keeps_fp32_precision_for_bf16_params():
    # bf16 params on the device, fp32 master params and state on the host (ZeRO-Offload): equals a plain loop
    # that keeps an fp32 master copy, and differs from re-reading the rounded bf16 params every step.
    batches = [token_batch(seed=s) for s in range(4)]

    def loss_fn(m, b):
        return af.losses.cross_entropy(m(b["x"].bfloat16()).float(), b["y"])

    ref = token_model().bfloat16()
    master = {k: p.detach().float().clone().requires_grad_() for k, p in ref.named_parameters()}
    opt = torch.optim.AdamW(master.values(), lr=1e-2)
    for b in batches:
        logits = ref(b["x"].bfloat16()).float()
        nn.functional.cross_entropy(logits.reshape(-1, 5), b["y"].reshape(-1), ignore_index=-100).backward()
        for k, p in ref.named_parameters():
            master[k].grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for k, p in ref.named_parameters():
                p.copy_(master[k])

    results = {}
    for keep in (True, False):
        step = af.offload(af.train_step(loss_fn, af.optim.adamw(1e-2)), params=keep)
        state = _streaming(step, token_model().bfloat16())
        assert all(t.dtype == torch.float32 for t in af.tree.leaves(state.opt_state.mu))
        for b in batches:
            state, _ = step(state, b)
        assert all(p.dtype == torch.bfloat16 for p in state.params.values())
        results[keep] = state.params
    assert max((results[True][k].float() - master[k]).abs().max().item() for k in master) <= 1e-2
    assert max_diff(results[True], {k: p.detach() for k, p in ref.named_parameters()}) == 0.0
    assert max_diff(results[True], results[False]) > 0


def test_offload_host_master_travels_with_the_state_through_a_checkpoint(tmp_path):
    # The fp32 host master params live in state.extra: a checkpoint saves them, and after loading one into
    # the state (in place) the update continues from the loaded master, not from a stale copy.
    batches = [token_batch(seed=s) for s in range(4)]
    plain, _ = run(af.train_step(token_loss, af.optim.adamw(1e-2)), token_model(), batches)
    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)), params=True)
    state = _streaming(step, token_model())
    for b in batches[:2]:
        state, _ = step(state, b)
    af.checkpoint.save(tmp_path / "c", state)
    for b in batches[2:]:
        state, _ = step(state, b)
    state = af.checkpoint.load(tmp_path / "c", like=state)  # back to step 2, in place
    for b in batches[2:]:
        state, _ = step(state, b)
    assert max_diff(state.params, plain.params) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("keep_master", [False, True], ids=["stream-params", "host-master"])
def test_offload_on_gpu_keeps_state_on_the_host_and_pinned(keep_master):
    batches = [af.tree.map(lambda t: t.cuda(), token_batch(seed=s)) for s in range(4)]
    plain, plain_losses = run(af.train_step(token_loss, af.optim.adamw(1e-2)), token_model().cuda(), batches)
    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)), params=keep_master)
    state, losses = run(step, token_model().cuda(), batches)
    leaves = af.tree.leaves(state.opt_state) + af.tree.leaves(state.extra)
    assert all(t.device.type == "cpu" for t in leaves)
    # what travels between host and device is pinned (moments, master params, the updater's gradient and param
    # buffers); 0-d leaves (the update count, the learning rate) are read by the host and never copied
    assert all(t.is_pinned() for t in leaves if t.is_floating_point() and t.dim())
    updater = step.plan.updater
    buffers = [*updater.grad_buffers.values(), *updater.mirror.values()]
    assert buffers and all(b.is_pinned() for b in buffers)
    assert all(p.device.type == "cuda" for p in state.params.values())
    assert losses == pytest.approx(plain_losses, abs=1e-5)  # the CPU and CUDA fused kernels round differently
    assert max_diff(state.params, plain.params) <= 1e-5


# ---- fp8 (torchao, emulated on CPU) ----------------------------------------------------------------------------
def _llama16():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def pattern_batches(n, batch=4, seq=16, vocab=64):
    """Learnable sequences: each token determines the next (t -> 3t + 1 mod vocab)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            ids[:, t] = (ids[:, t - 1] * 3 + 1) % vocab
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _lm_loss(m, b):
    return af.losses.cross_entropy(m(input_ids=b["input_ids"]).logits[:, :-1], b["labels"][:, 1:])


@pytest.mark.slow
def test_torchao_fp8_training_tracks_bf16_and_keeps_edges_in_high_precision():
    from torchao.float8.float8_linear import Float8Linear

    batches = pattern_batches(50)
    bf16 = af.autocast(af.train_step(_lm_loss, af.optim.adamw(3e-3)), torch.bfloat16)
    _, bf16_losses = run(bf16, _llama16(), batches)
    fp8 = af.autocast_fp8(
        af.autocast(af.train_step(_lm_loss, af.optim.adamw(3e-3)), torch.bfloat16),
        backend="torchao",
        emulate=True,
    )
    state, fp8_losses = run(fp8, _llama16(), batches)
    model = fp8.model
    assert not isinstance(model.lm_head, Float8Linear)  # the last Linear stays high precision
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) >= 10 and "lm_head" not in converted
    assert "model.layers.0.self_attn.q_proj" not in converted  # the first Linear stays high precision
    assert fp8_losses[-1] < fp8_losses[0] * 0.8  # it trains
    for a, b in zip(fp8_losses[-10:], bf16_losses[-10:]):
        assert abs(a - b) / b < 0.05
    # the converted model's state saves and loads (safetensors), and training goes on from it
    import tempfile

    path = tempfile.mkdtemp() + "/fp8"
    af.checkpoint.save(path, state)
    expected = {k: v.detach().clone() for k, v in state.params.items()}
    fresh = fp8.init(_llama16())
    loaded = af.checkpoint.load(path, like=fresh)
    assert all(torch.equal(loaded.params[k], expected[k]) for k in expected)
    _, m = fp8(loaded, batches[0])
    assert torch.isfinite(m["loss"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_fp8_recipes_equal_a_plain_torchao_loop(recipe):
    # The recipe reaches torchao (each layer's config is the recipe's), and the step equals a hand-written
    # loop over torchao's own conversion with torch.optim.SGD.
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))

    def loss_fn(m, x):
        return m(x).float().pow(2).mean()

    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    every_linear = lambda mod, fqn: isinstance(mod, nn.Linear)  # noqa: E731
    step = af.autocast_fp8(af.train_step(loss_fn, af.optim.sgd(0.1)), backend="torchao", recipe=recipe,
                           emulate=True, module_filter=every_linear)  # fmt: skip
    state, losses = run(step, net(), xs)
    want = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    assert [m.config for m in step.model if type(m).__name__ == "Float8Linear"] == [want] * 3

    ref = convert_to_float8_training(net(), config=want, module_filter_fn=every_linear)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x in xs:
        loss = loss_fn(ref, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert max_diff(state.params, dict(ref.named_parameters())) <= 1e-6


def test_unknown_fp8_recipes_are_clear_errors(fake_te):
    with pytest.raises(ValueError, match=r"torchao recipe must be one of .*'rowwise'.*got 'columnwise'"):
        af.autocast_fp8(af.train_step(token_loss, af.optim.sgd(0.1)), backend="torchao", recipe="columnwise")
    step = af.autocast_fp8(af.train_step(token_loss, af.optim.sgd(0.1)), backend="te", recipe="rowwise")
    with pytest.raises(
        ValueError, match=r"backend='te'\): recipe must be 'delayed' or 'current', got 'rowwise'"
    ):
        step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))


def test_torchao_fp8_refuses_cpu_without_emulate():
    step = af.autocast_fp8(af.train_step(token_loss, af.optim.sgd(0.1)), backend="torchao")
    with pytest.raises(RuntimeError, match="no FP8 matmul support.*emulate=True"):
        step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))


def test_torchao_fp8_in_a_dry_run_asks_the_modelled_device_not_the_host():
    """`accelfn dry-run --device cuda --gpu h100` executes on this CPU but models an H100: the fp8 check asks the
    dry run (`dry_mode.fp8_support`), and torchao's fp8 linears lower (here on real CPU tensors, unemulated)."""
    from torchao.float8.float8_linear import Float8Linear

    from accelfn import dry_mode

    class Models(dry_mode.Watcher):
        def __init__(self, fp8: bool) -> None:
            super().__init__()
            self.fp8, self.asked = fp8, []

        def fp8_support(self, kind):
            self.asked.append(kind)
            return self.fp8

    for fp8 in (True, False):
        step = af.autocast_fp8(af.train_step(token_loss, af.optim.sgd(0.1)), backend="torchao",
                               module_filter=lambda m, fqn: fqn == "1")  # fmt: skip
        with dry_mode.watching(Models(fp8)) as watcher:
            if fp8:
                state = step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))
                state, _ = step(state, {"x": torch.randn(16, 32), "y": torch.randint(0, 32, (16,))})
                assert isinstance(step.model[1], Float8Linear) and not step.model[1].config.emulate
            else:  # a modelled device without fp8 (an A100): the same refusal as on that device
                with pytest.raises(RuntimeError, match="no FP8 matmul support"):
                    step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))
        assert watcher.asked == ["cpu"]
    assert dry_mode.fp8_support("cuda") is None  # outside a dry run: the host answers


def test_fp8_module_filter_overrides_the_default():
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    step = af.autocast_fp8(
        af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)),
        backend="torchao",
        emulate=True,
        module_filter=lambda mod, fqn: isinstance(mod, nn.Linear),
    )
    step.init(net)
    assert [type(m).__name__ for m in step.model] == ["Float8Linear"] * 3


# ---- fp8 (Transformer Engine, faked) ---------------------------------------------------------------------------
@pytest.fixture
def fake_te(monkeypatch):
    calls = {"autocast": 0}
    te_pkg = types.ModuleType("transformer_engine")
    te_pkg.__path__ = []
    te_torch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")

    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

        def get_extra_state(self):
            return torch.tensor([1.0, 2.0])  # stands for TE's amax history/scales

    Linear.__module__ = "transformer_engine.pytorch.module.linear"

    class _Ctx:
        def __init__(self, **kw):
            calls["kwargs"] = kw

        def __enter__(self):
            calls["autocast"] += 1

        def __exit__(self, *a):
            return False

    class Format:
        HYBRID = "hybrid"

    class DelayedScaling:
        def __init__(self, **kw):
            self.kw = kw

    te_torch.Linear = Linear
    te_torch.fp8_autocast = _Ctx
    recipe.DelayedScaling = DelayedScaling
    recipe.Format = Format
    recipe.Float8CurrentScaling = lambda: "current"
    for name, mod in [
        ("transformer_engine", te_pkg),
        ("transformer_engine.pytorch", te_torch),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_te_backend_swaps_linears_runs_under_fp8_autocast_and_keeps_scaling_state(fake_te):
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    ref = copy.deepcopy(net)
    step = af.autocast_fp8(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), backend="te")
    state = step.init(net)
    kinds = [type(m).__module__.split(".")[0] for m in step.model]
    assert kinds == ["torch", "transformer_engine", "transformer_engine", "torch"]
    assert torch.equal(step.model[1].weight, ref[1].weight)  # weights copied
    assert set(state.extra["te_fp8"]) == {"1", "2"}
    x = torch.randn(4, 32)
    state, _ = step(state, x)
    assert fake_te["autocast"] == 1 and fake_te["kwargs"]["enabled"] is True
    assert fake_te["kwargs"]["fp8_recipe"].kw["fp8_format"] == "hybrid"


def test_te_reduces_amax_over_the_data_and_context_parallel_group(fake_te, monkeypatch):
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        base = af.autocast_fp8(
            af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), backend="te"
        )
        alone = af.shard(base, mesh)  # one process: no group to reduce over
        alone.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
        with alone.plan.forward_context():
            assert fake_te["kwargs"]["fp8_group"] is None
        monkeypatch.setattr(
            af.Mesh, "grad_size", property(lambda self: 2)
        )  # as if 2 processes saw other tokens
        step = af.shard(base, mesh)
        step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
        with step.plan.forward_context():
            assert fake_te["kwargs"]["fp8_group"] is mesh.group("dp")


def test_te_backend_without_te_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    step = af.autocast_fp8(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), backend="te")
    with pytest.raises(ImportError, match=r"pip install 'accelfn\[te\]'"):
        step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))


def test_auto_backend_picks_torchao_without_te_and_says_so():
    step = af.autocast_fp8(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), emulate=True)
    step.init(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))
    assert "chose torchao" in repr(step)


def test_compile_falls_back_to_regions_around_te_modules(fake_te):
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    step = af.compile(
        af.autocast_fp8(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), backend="te")
    )
    with pytest.warns(UserWarning, match="Transformer Engine"):
        step.init(net)
    assert "TE modules stay eager" in repr(step)


@pytest.mark.slow
def test_pairs_and_triples_with_shard_give_the_same_result_in_both_orders_on_two_ranks():
    from tests._launch import output_of, run_workers

    proc = run_workers("compose_worker.py", 2, timeout=600)
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert proc.stdout.count("OK shard") == 2 * 10, out


@pytest.mark.parametrize("wrap", ["accumulate", "shard"])
def test_fp16_loss_scale_under_accumulate_and_shard_follows_grad_scaler(wrap):
    # Without a local count to divide by before the backward (micro-batches, ranks), the scaled objective
    # is a sum: it must still be normalised, or the effective scale is `scale * count` and fp16 gradients
    # overflow step after step. Reference: torch's GradScaler with the loss divided by the accumulation steps.
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 4))

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(512, 4, generator=g), torch.randn(512, 4, generator=g)) for _ in range(30)]
    cfg = af.LossScaleConfig(growth_interval=5)
    step = af.autocast(af.train_step(lambda m, b: af.losses.mse(m(b[0]).float(), b[1]), af.optim.adam(1e-3)),
                       torch.float16, loss_scale=cfg)  # fmt: skip
    mesh = af.Mesh({"dp": -1}, device="cpu") if wrap == "shard" else None
    step = af.accumulate(step, 2) if wrap == "accumulate" else af.shard(step, mesh)
    state, skipped = step.init(net()), 0
    for b in data:
        state, m = step(state, b)
        skipped += int(m["skipped"])
    if mesh is not None:
        mesh.close()
    ref, parts = net(), 2 if wrap == "accumulate" else 1
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    scaler, ref_skipped = torch.amp.GradScaler("cpu", growth_interval=5), 0
    for x, y in data:
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(ref(xs).float(), ys) / parts
            scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_skipped += scaler.get_scale() < before
    assert (skipped, state.extra["loss_scale"]["scale"].item()) == (ref_skipped, scaler.get_scale())
    assert max_diff(state.params, dict(ref.named_parameters())) <= 1e-3


def test_fp16_loss_scale_is_checkpointed_with_the_state(tmp_path):
    cfg = af.LossScaleConfig(init_scale=8.0, growth_interval=2)
    make = lambda: af.autocast(  # noqa: E731
        af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.sgd(0.01)),
        torch.float16,
        loss_scale=cfg,
    )
    step = make()
    state = step.init(_seeded_mlp())
    for _ in range(3):
        state, _ = step(state, torch.randn(4, 8))
    assert (
        state.extra["loss_scale"]["scale"].item() == 16.0
        and state.extra["loss_scale"]["good_steps"].item() == 1
    )
    af.checkpoint.save(tmp_path / "ckpt", state)
    other = make()
    loaded = af.checkpoint.load(tmp_path / "ckpt", like=other.init(_seeded_mlp()))
    assert loaded.extra["loss_scale"]["scale"].item() == 16.0
    assert loaded.extra["loss_scale"]["good_steps"].item() == 1
    loaded, _ = other(loaded, torch.randn(4, 8))
    assert loaded.extra["loss_scale"]["scale"].item() == 32.0  # the growth interval continues across the save
