"""`af.remat`: activation checkpointing changes memory, never results (bitwise on CPU in fp32, dropout on).

Memory is measured with torch.profiler's memory profile (tests/memory_profile.py): on a CPU it is the one
way to see which live bytes are activations (tensors kept for the backward).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accelfn as af
from tests.memory_profile import peak_bytes
from tests.models import tiny_gpt2


def llama(dropout: float = 0.1, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attention_dropout=dropout,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)  # use_cache=True by default: the recomputation must not append to a cache


def gpt2():
    torch.manual_seed(0)
    return tiny_gpt2(dropout=0.1, n_layer=3)


def lm_loss(model, batch):
    logits = model(input_ids=batch).logits
    return af.losses.cross_entropy(logits[:, :-1], batch[:, 1:])


def train(step, model, data, seed=1):
    state = step.init(model, seed=seed)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(m["loss"])
    return state, torch.stack(losses)


def data_for(vocab: int, n: int = 3, rows: int = 4, seq: int = 24):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n)]


def save_matmuls(op) -> bool:
    return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(
    "kwargs",
    [{"policy": "full"}, {"policy": "selective"}, {"policy": "full", "every": 2}, {"policy": save_matmuls}],
    ids=["full", "selective", "every2", "callable"],
)
def test_remat_equals_no_remat_bitwise_with_dropout(make, kwargs):
    vocab = 128 if make is llama else 64
    data = data_for(vocab)
    base = af.train_step(lm_loss, af.optim.adamw(1e-3, weight_decay=0.1), clip_grad_norm=1.0)
    want, want_losses = train(base, make(), data)
    step = af.remat(
        af.train_step(lm_loss, af.optim.adamw(1e-3, weight_decay=0.1), clip_grad_norm=1.0), **kwargs
    )
    got, got_losses = train(step, make(), data)
    assert torch.equal(got_losses, want_losses), (got_losses, want_losses)
    for k, v in want.params.items():
        assert torch.equal(got.params[k], v), k
    # dropout really is on: another seed gives other losses
    _, other = train(af.remat(af.train_step(lm_loss, af.optim.adamw(1e-3)), **kwargs), make(), data, seed=2)
    assert not torch.equal(other, want_losses)
    n_blocks = 4 if make is llama else 3
    chosen = n_blocks // kwargs.get("every", 1)
    what = "LlamaDecoderLayer" if make is llama else "GPT2Block"
    assert f"on {chosen} of {n_blocks} blocks ({what})" in repr(step), repr(step)


def test_remat_lowers_peak_activation_memory():
    data = torch.randint(0, 128, (8, 128), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for policy in (None, "selective", "full"):
        step = af.train_step(lm_loss, af.optim.sgd(1e-3))
        if policy is not None:
            step = af.remat(step, policy)
        box = [step.init(llama(dropout=0.0))]
        box[0], _ = step(box[0], data)  # warm: the profiled step is a steady-state one

        def one_step(step=step, box=box):
            box[0], _ = step(box[0], data)

        peaks[policy] = peak_bytes(one_step)
    act = {k: v["activation"] for k, v in peaks.items()}
    # measured: none 25.9 MiB, selective 11.8 MiB (torchtitan's policy since 2026-11-27; 16.3 saving every matmul),
    # full 4.5 MiB of activations (4 layers, 8 x 128 tokens)
    assert act["full"] < 0.3 * act[None], act
    assert act["full"] < act["selective"] < 0.8 * act[None], act
    assert peaks["full"]["total"] < 0.6 * peaks[None]["total"], peaks


def test_blocks_are_whole_layers_never_their_children():
    from accelfn.transforms.remat import find_remat_blocks

    what, blocks = find_remat_blocks(llama(layers=2))
    assert what == "LlamaDecoderLayer" and len(blocks) == 2
    what, blocks = find_remat_blocks(gpt2())
    assert what == "GPT2Block" and len(blocks) == 3

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(
                nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            )  # a bigger list inside

        def forward(self, x):
            return self.inner(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(), Layer()

        def forward(self, x):
            return self.b(self.a(x))

    what, blocks = find_remat_blocks(Net(), ["Layer"])
    assert what == "Layer" and len(blocks) == 2
    with pytest.raises(ValueError, match=r"no module of class \['Block'\].*'Layer'"):
        find_remat_blocks(Net(), ["Block"])
    with pytest.raises(ValueError, match="no repeated blocks"):
        af.remat(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))).init(nn.Linear(2, 2))


def test_remat_keeps_parameter_names_and_eval_runs_without_recomputation():
    step = af.remat(af.train_step(lm_loss, af.optim.sgd(0.1)))
    model = gpt2()
    names = [n for n, _ in model.named_parameters()]
    state = step.init(model)
    assert (
        list(state.params) == names
    )  # the block is changed in place: names, checkpoints, FSDP units as before
    evaluate = af.eval_step(lambda m, b: m(input_ids=b).logits)
    evaluate.init(model)
    logits = evaluate(state, data_for(64)[0])  # no gradients recorded: the plain forward runs
    assert logits.shape == (4, 24, 64) and not logits.requires_grad


def test_bad_arguments_are_named():
    base = af.train_step(lm_loss, af.optim.sgd(0.1))
    with pytest.raises(ValueError, match="policy must be one of"):
        af.remat(base, "some")
    with pytest.raises(ValueError, match="every must be >= 1"):
        af.remat(base, every=0)
    with pytest.raises(ValueError, match=r"memory_budget must be in \(0, 1\]"):
        af.remat(base, memory_budget=1.5)
    with pytest.raises(ValueError, match="do not also pass policy"):
        af.remat(base, "selective", memory_budget=0.5)
    with pytest.raises(af.CompositionError, match="needs af.compile"):
        af.remat(base, memory_budget=0.5).init(gpt2())
    with pytest.raises(af.CompositionError, match="each combinator may be applied once"):
        af.remat(af.remat(base), "selective")


def test_memory_budget_is_handed_to_the_compiler_and_scoped_to_its_step():
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    before = functorch_config.activation_memory_budget
    seen = []

    def partition(*args, **kwargs):  # what torch's partitioner reads while this step compiles
        seen.append(functorch_config.activation_memory_budget)
        return min_cut_rematerialization_partition(*args, **kwargs)

    boxed = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731  # run the traced graphs as they are
    backend = aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)
    data = data_for(64, n=2)
    plain = lambda: (torch.manual_seed(0), tiny_gpt2(n_layer=3))[1]  # noqa: E731  # no dropout: compiled RNG differs
    want, want_losses = train(af.train_step(lm_loss, af.optim.sgd(0.1)), plain(), data)
    step = af.compile(af.remat(af.train_step(lm_loss, af.optim.sgd(0.1)), memory_budget=0.5), backend=backend)
    got, got_losses = train(step, plain(), data)
    assert seen and set(seen) == {0.5}
    # the process-global setting is back: no later compile in the process inherits the budget
    assert functorch_config.activation_memory_budget == before
    other_seen = len(seen)
    other = af.compile(
        af.train_step(lambda m, b: lm_loss(m, b), af.optim.sgd(0.1)), backend=backend
    )  # a new trace
    train(other, plain(), data)
    assert len(seen) > other_seen and set(seen[other_seen:]) == {before}
    assert "activation memory budget 0.5" in repr(step)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)


# torchtitan's "op" selective checkpointing, copied by hand from torchtitan/parallelisms/parallelize_llama.py
# (2024-12, `_save_list` and `_apply_ac_to_transformer_block`); the CPU's SDPA kernel stands for CUDA's there.
# accelfn leaves `abs` out (accelfn/transforms/remat.py says why): a bf16 block runs none
_TORCHTITAN_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _torchtitan_context():
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[f"{mode}_mm_count"] += 1
        to_save = func in _TORCHTITAN_SAVE and not (
            func == torch.ops.aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0
        )
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrap_like_torchtitan(model) -> None:
    import functools

    from torch.utils.checkpoint import checkpoint

    model.config.use_cache = False  # no key/value cache for the recomputation to append to a second time
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = functools.partial(
            lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, context_fn=_torchtitan_context, **k),
            forward,
        )


def _backward_ops(model, batch):
    """The gradients, and the ops run in the backward (the recomputation's and the gradients' own) by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran[str(func)] += 1
            return func(*args, **(kwargs or {}))

    loss = lm_loss(model, batch).mean()
    with Ops() as ops:
        loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}, ops.ran


def test_selective_is_torchtitans_op_policy_recomputing_every_second_mm_of_each_block():
    """Per call of a block: a counter shared by the layers would recompute q, v, gate and down of the second
    layer (7 matmuls a layer), and one shared by the forward and the recomputation would not replay."""
    from accelfn.transforms.remat import save_matmuls as former_selective

    layers = 2
    batch = data_for(128, n=1)[0]
    want, plain = _backward_ops(llama(dropout=0.0, layers=layers), batch)
    reference = llama(dropout=0.0, layers=layers)
    _wrap_like_torchtitan(reference)
    ref_grads, ref_ops = _backward_ops(reference, batch)
    ours = llama(dropout=0.0, layers=layers)
    af.remat(af.train_step(lm_loss, af.optim.sgd(0.1)), "selective").init(
        ours
    )  # checkpoints its layers in place
    got, ran = _backward_ops(ours, batch)
    assert ran == ref_ops  # the same ops recomputed (so the same outputs saved), one for one
    # each layer's 7 matmuls (q k v o gate up down): 2 gradient mms each, and k, o, up again; the head's 2
    mm = "aten.mm.default"
    assert plain[mm] == 2 * 7 * layers + 2 and ran[mm] == (2 * 7 + 3) * layers + 2
    for k, g in want.items():
        assert torch.equal(got[k], g), k  # and the gradients of no remat, bitwise
    old = llama(dropout=0.0, layers=layers)
    af.remat(af.train_step(lm_loss, af.optim.sgd(0.1)), former_selective).init(old)
    _, old_ran = _backward_ops(old, batch)
    assert old_ran[mm] == plain[mm] and old_ran != ran  # the former policy: every matmul kept
