"""GPU-only checks (skipped without CUDA): bf16 on CUDA, torchao real FP8, offload placement, fused kernels.

Run them on an H100/H200 machine: `python -m pytest tests/test_gpu.py -m gpu`.
"""

import copy

import pytest
import torch
from torch import nn

import accelfn as af

pytestmark = pytest.mark.gpu


def _lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg).cuda()


def _batches(n):
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (8, 1), device="cuda", generator=g)
        seq = [ids]
        for _ in range(31):
            seq.append((seq[-1] * 5 + 3) % 256)
        out.append(torch.cat(seq, dim=1))
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _loss(m, ids):
    return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])


def test_bf16_autocast_on_cuda_matches_a_plain_autocast_loop():
    model = _lm()
    ref = copy.deepcopy(model)
    batches = _batches(10)
    step = af.autocast(af.train_step(_loss, af.optim.adamw(1e-3)), torch.bfloat16)
    state = step.init(model)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    ref_losses = []
    for b in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss(ref, b).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, abs=1e-3)
    assert all(p.dtype == torch.float32 and p.is_cuda for p in state.params.values())


def test_adamw_uses_the_fused_cuda_kernel_and_matches_torch():
    params = {"w": torch.randn(64, 64, device="cuda"), "b": torch.randn(64, device="cuda")}
    ref = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    tx = af.optim.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    opt = torch.optim.AdamW(ref.values(), lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(20):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        state = af.optim.apply_gradients(tx, grads, state, params)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
    for k in params:
        assert (params[k] - ref[k]).abs().max().item() <= 1e-5


def test_torchao_fp8_trains_on_fp8_hardware():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 hardware (compute capability 8.9+)")
    from torchao.float8.float8_linear import Float8Linear

    batches = _batches(50)
    bf16 = af.autocast(af.train_step(_loss, af.optim.adamw(3e-3)), torch.bfloat16)
    state, ref_losses = bf16.init(_lm()), []
    for b in batches:
        state, m = bf16(state, b)
        ref_losses.append(m["loss"].item())
    ref_drop = _mean(ref_losses[:10]) - _mean(ref_losses[-10:])
    assert ref_drop > 2.0, ref_losses  # bf16 learns the sequences (ln 256 = 5.5 -> ~0.1 in 50 steps)

    # This model's layers are too small to gain from FP8, so the default filter (on FP8 hardware: only shapes
    # that gain) would leave them all in bf16: convert every Linear but the output layer, to test the numerics.
    def every_linear(m, fqn):
        return isinstance(m, nn.Linear) and fqn != "lm_head"

    for recipe in ("tensorwise", "rowwise"):
        fp8 = af.autocast_fp8(
            af.autocast(af.train_step(_loss, af.optim.adamw(3e-3)), torch.bfloat16),
            backend="torchao",
            recipe=recipe,
            module_filter=every_linear,
        )
        state = fp8.init(_lm())
        assert any(isinstance(m, Float8Linear) for m in fp8.model.modules())
        losses = []
        for b in batches:
            state, m = fp8(state, b)
            losses.append(m["loss"].item())
        # The losses head towards zero (the sequences are deterministic), where a relative comparison of the
        # last losses means nothing: compare in absolute terms, and compare how far each curve fell.
        drop = _mean(losses[:10]) - _mean(losses[-10:])
        assert abs(drop - ref_drop) < 0.1 * ref_drop, (recipe, drop, ref_drop)
        assert abs(losses[-1] - ref_losses[-1]) < 0.05, (recipe, losses[-1], ref_losses[-1])
        assert losses[-1] < losses[0] - 2.0, (recipe, losses[0], losses[-1])


def test_compile_on_cuda_matches_eager():
    batches = _batches(6)
    model = _lm()
    eager = af.train_step(_loss, af.optim.adamw(1e-3))
    compiled = af.compile(af.train_step(_loss, af.optim.adamw(1e-3)))
    s1, s2 = eager.init(copy.deepcopy(model)), compiled.init(copy.deepcopy(model))
    for b in batches:
        s1, m1 = eager(s1, b)
        s2, m2 = compiled(s2, b)
        assert m1["loss"].item() == pytest.approx(m2["loss"].item(), abs=1e-4)


def test_autocast_under_shard_autocasts_on_the_gpu_when_the_model_starts_on_the_cpu():
    # autocast is lowered before shard moves the model to the GPU: the device type must be read afterwards
    with af.Mesh({"dp": -1}, device="cuda") as mesh:
        step = af.shard(af.autocast(af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.adamw(1e-3)),
                                    torch.bfloat16), mesh)  # fmt: skip
        seen = []
        model = nn.Linear(64, 64)
        model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        state = step.init(model)  # on the CPU until shard moves it
        assert step.plan.autocast_device_type == "cuda"
        step(state, torch.randn(8, 64))
        assert seen == [torch.bfloat16]


def test_remat_lowers_peak_cuda_memory_and_keeps_results():
    """Allocator statistics on a GPU: full < selective < none for the peak of a training step; same losses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)  # fmt: skip
        return LlamaForCausalLM(cfg).cuda()

    ids = torch.randint(
        0, 256, (16, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
    )
    peaks, losses = {}, {}
    for policy in (None, "selective", "full"):
        step = af.train_step(_loss, af.optim.adamw(1e-3))
        if policy is not None:
            step = af.remat(step, policy)
        state = step.init(model())
        state, _ = step(state, ids)  # optimizer state exists: the measured step is a steady one
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        state, m = step(state, ids)
        torch.cuda.synchronize()
        peaks[policy] = torch.cuda.max_memory_allocated() - base
        losses[policy] = m["loss"].item()
        del state, step
    assert peaks["full"] < peaks["selective"] < peaks[None], peaks
    assert peaks["full"] < 0.6 * peaks[None], peaks
    # the CUDA attention kernels may differ between a forward and its recomputation: close, not bitwise
    assert abs(losses["full"] - losses[None]) < 1e-4 and abs(losses["selective"] - losses[None]) < 1e-4, (
        losses
    )


def test_context_parallel_attention_pieces_on_cuda_match_whole_attention():
    """Context parallel's attention on CUDA's SDPA kernels (lower-right causal pieces: the flash or efficient
    kernel), bf16 and fp32, forward and backward: each rank's queries over the gathered keys equal its part of
    whole-sequence causal attention (the multi-process runs are tested over gloo on CPUs: one GPU cannot hold two
    NCCL ranks)."""
    from accelfn.transforms.shard.context_parallel import gathered_attention, split_sequence

    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        k = torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        v = torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want = torch.autograd.grad(whole.float().square().sum(), (q, k, v))
        size = 4
        gk = torch.cat([split_sequence(k, r, size, dim=2) for r in range(size)], dim=2)
        gv = torch.cat([split_sequence(v, r, size, dim=2) for r in range(size)], dim=2)
        total = 0
        for r in range(size):
            got = gathered_attention(
                split_sequence(q, r, size, dim=2), gk, gv, r, size, causal=True, enable_gqa=True
            )
            torch.testing.assert_close(got, split_sequence(whole, r, size, dim=2), rtol=tol, atol=tol)
            total = total + got.float().square().sum()
        for got_g, want_g in zip(torch.autograd.grad(total, (q, k, v)), want):
            torch.testing.assert_close(got_g, want_g, rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("keep_master", [False, True], ids=["mirror", "host-master"])
def test_delayed_offload_on_cuda_equals_the_plain_delayed_loop(keep_master):
    # The delayed host update on a GPU: pinned pending gradients, the host thread waiting on a CUDA event for
    # the copies it reads; against torch.optim.AdamW on the CPU applying the gradients one step late.
    from tests.test_offload_delayed import BATCHES, delayed_reference
    from tests.test_transforms import token_loss, token_model

    ref_params, ref_losses = delayed_reference(BATCHES, start=1, clip=0.5)
    base = af.train_step(token_loss, af.optim.adamw(1e-2), clip_grad_norm=0.5)
    step = af.offload(base, params=keep_master, delayed_update_from=1)
    state = step.init(token_model().cuda())
    losses = []
    for b in BATCHES:  # no .item() per step: the host must not wait for the device between steps
        state, m = step(state, af.tree.map(lambda t: t.cuda(non_blocking=True), b))
        losses.append(m["loss"])
    losses = [x.item() for x in losses]
    pending = state.extra["offload_pending"]["grads"]
    assert all(g.device.type == "cpu" and g.is_pinned() for g in pending.values())
    assert all(p.device.type == "cuda" for p in state.params.values())
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert max((state.params[k].cpu() - ref_params[k]).abs().max().item() for k in ref_params) <= 1e-5


def test_a_checkpoint_of_a_delayed_offload_state_waits_for_the_pending_gradient_copies(tmp_path):
    # The last step's gradients are still being copied into pinned host buffers when the step returns; a save
    # (also an async one, which stages host tensors at once) must wait for the device before reading them.
    from tests.test_offload_delayed import BATCHES
    from tests.test_transforms import token_loss, token_model

    step = af.offload(af.train_step(token_loss, af.optim.adamw(1e-2)), delayed_update_from=0)
    state = step.init(token_model().cuda())
    for b in BATCHES[:3]:
        state, _ = step(state, af.tree.map(lambda t: t.cuda(non_blocking=True), b))
    af.checkpoint.save(tmp_path / "async", state, async_save=True)
    af.checkpoint.wait()
    torch.cuda.synchronize()
    expected = {k: g.clone() for k, g in state.extra["offload_pending"]["grads"].items()}
    loaded = af.checkpoint.load(tmp_path / "async", like=af.tree.map(torch.zeros_like, state))
    assert all(torch.equal(loaded.extra["offload_pending"]["grads"][k], g) for k, g in expected.items())
