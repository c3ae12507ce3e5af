"""Worker: af.shard(strategy) on N ranks == the unsharded step on the global batch (run by test_shard.py)."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import accelfn as af

CONFIGS = [arg.split(":") for arg in sys.argv[1:]]  # e.g. ddp:gpt2:accumulate:sgd
model_kind = ""


def make_model():
    torch.manual_seed(0)
    if model_kind == "gpt2":
        from tests.models import tiny_gpt2

        return tiny_gpt2(n_embd=32)
    if model_kind == "t5":  # two stacks of blocks (encoder, decoder): FSDP shards each block of both
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                       decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
        return T5ForConditionalGeneration(cfg)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def batches(n=10, rows=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        if model_kind == "t5":
            out.append({"input_ids": torch.randint(0, 64, (rows, 10), generator=g),
                        "labels": torch.randint(0, 64, (rows, 6), generator=g)})  # fmt: skip
        elif model_kind == "gpt2":
            ids = torch.randint(0, 64, (rows, 12), generator=g)
            labels = ids.clone()
            for r in range(rows):  # uneven valid-token counts per row, so per rank
                labels[r, (r * 3) % 11 + 1 :] = -100
            out.append({"input_ids": ids, "labels": labels})
        else:
            x = torch.randn(rows, 8, generator=g)
            y = torch.randint(0, 5, (rows,), generator=g)
            y[: rows // 2 - 1] = -100  # rank 0 sees far fewer valid labels than rank 1
            out.append({"x": x, "y": y})
    return out


def loss_fn(model, b):
    if model_kind == "t5":
        logits = model(input_ids=b["input_ids"], labels=b["labels"]).logits
        return af.losses.cross_entropy(logits, b["labels"])
    if model_kind == "gpt2":
        logits = model(input_ids=b["input_ids"]).logits
        return af.losses.cross_entropy(logits[:, :-1], b["labels"][:, 1:])
    return af.losses.cross_entropy(model(b["x"]), b["y"])


def full(params):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in params.items()}


def check_fp16_skip(strategy, mesh):
    """An inf gradient on one rank only must make every rank skip the step (sharded grads differ by rank)."""

    def loss_fn(model, b):
        loss = model(b["x"]).float().pow(2).mean()
        return loss * float("inf") if mesh.rank == 1 else loss

    step = af.shard(
        af.autocast(af.train_step(loss_fn, af.optim.sgd(0.1)), torch.float16), mesh, strategy=strategy
    )
    torch.manual_seed(0)
    state = step.init(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5)))
    before = full(state.params)
    state, m = step(state, {"x": torch.randn(4, 8)})
    after = full(state.params)
    assert m["skipped"].item() == 1, f"rank {mesh.rank} did not skip"
    assert all(torch.equal(before[k], after[k]) for k in before)
    print(f"rank {mesh.rank}: OK {strategy} fp16-skip ['all ranks']")


def check_frozen_differently(strategy, mesh):
    """Ranks that froze different layers (same shapes) are refused at init, on every rank, naming the param."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[mesh.rank].weight.requires_grad_(False)
    step = af.shard(
        af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh, strategy=strategy
    )
    try:
        step.init(model)
    except ValueError as e:
        assert (
            "the ranks' models differ: '0.weight': frozen [4, 4] on rank 0, trainable [4, 4] on rank 1"
            in str(e)
        ), e
        print(f"rank {mesh.rank}: OK {strategy} frozen-differently")
    else:
        raise AssertionError(f"rank {mesh.rank}: models that differ were accepted")


def check_bf16_count(strategy, mesh):
    """A bf16 loss total with an exact count: the count summed over ranks (151 + 150) stays 301 (bf16: 300)."""
    model = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    step = af.shard(af.train_step(lambda m, b: af.Loss(m(b).sum(), torch.tensor(151 - mesh.rank)), af.optim.sgd(0.0)),
                    mesh, strategy=strategy, inputs="local")  # fmt: skip
    state = step.init(model)
    _, m = step(
        state, torch.ones(64, 4, dtype=torch.bfloat16)
    )  # 256 per rank: the total 512 is exact in bf16
    got = m["loss"].float().item()
    assert abs(got - 512 / 301) <= 1e-3 * 512 / 301, (
        f"rank {mesh.rank}: loss {got}, expected 512/301 (512/300 = {512 / 300})"
    )
    print(f"rank {mesh.rank}: OK {strategy} bf16-count")


def check_fsdp_bf16_policy(mesh):
    """Under fsdp, af.autocast(bf16) becomes FSDP2's MixedPrecisionPolicy: bf16 params in the forward,
    fp32 sharded master params and optimizer state, and a result close to the single-process bf16 run."""
    seen = {}

    def loss_fn(model, b):
        return af.losses.cross_entropy(model(b["x"]).float(), b["y"])

    def record(module, inputs, output):  # inside the forward, FSDP2 has swapped in the unsharded params
        seen["param_dtype"] = module.weight.dtype

    def run(shard):
        step = af.autocast(af.train_step(loss_fn, af.optim.adamw(1e-2)), torch.bfloat16)
        if shard:
            step = af.shard(step, mesh, strategy="fsdp", inputs="global")
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5))
        net[2].register_forward_hook(record)
        state = step.init(net)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            b = {"x": torch.randn(8, 8, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}
            state, m = step(state, b)
            losses.append(m["loss"].item())
        return state, losses

    _, ref = run(False)
    state, losses = run(True)
    assert seen["param_dtype"] == torch.bfloat16, seen
    assert all(v.to_local().dtype == torch.float32 for v in state.params.values())
    assert all(t.dtype == torch.float32 for t in af.tree.leaves(state.opt_state.mu))
    assert max(abs(a - b) for a, b in zip(losses, ref)) < 3e-2, (losses, ref)
    print(f"rank {mesh.rank}: OK fsdp bf16-policy ['mixed precision']")


def check_fp8_fsdp(mesh):
    """torchao tensorwise fp8 (emulated) under fsdp: weights all-gathered in fp8 with scales refreshed after
    each update; equals the same fp8 step under ddp (which casts the full weight itself)."""

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))

    def loss(m, b):
        return m(b).float().pow(2).mean()

    g = torch.Generator().manual_seed(3)
    data = [torch.randn(16, 32, generator=g) for _ in range(4)]
    every = lambda mod, fqn: isinstance(mod, nn.Linear)  # noqa: E731
    results = {}
    # with bf16 autocast too (fp8 around bf16, as the docs write it): FSDP2 casts the linears' inputs to bf16,
    # and under ddp torchao's CUDA-only cast left them fp32 on the CPU (different numerics) until accelfn cast them
    for strategy, bf16 in (("ddp", False), ("fsdp", False), ("ddp", True), ("fsdp", True)):
        inner = af.train_step(loss, af.optim.adamw(1e-2))
        if bf16:
            inner = af.autocast(inner, "bf16")
        base = af.autocast_fp8(inner, backend="torchao", emulate=True, module_filter=every)
        step = af.shard(base, mesh, strategy=strategy, inputs="global")
        state = step.init(net())
        losses = []
        for b in data:
            state, m = step(state, b)
            losses.append(m["loss"].item())
        results[strategy, bf16] = (losses, full(state.params))
        if strategy == "fsdp":
            assert "fp8 all-gather under fsdp" in repr(step), repr(step)
            weights = [v._local_tensor for v in state.params.values() if v.dim() == 2]
            assert {type(w).__name__ for w in weights} == {"WeightWithDynamicFloat8CastTensor"}, weights
            # scales refreshed after each update (one all-reduce for all weights, not one per all-gather)
            assert all(getattr(w, "_precomputed_scale", None) is not None for w in weights)
    for bf16 in (False, True):
        (l1, p1), (l2, p2) = results["ddp", bf16], results["fsdp", bf16]
        diff = max((p1[k] - p2[k]).abs().max().item() for k in p1)
        assert diff <= 1e-5 and max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-5, (bf16, diff, l1, l2)
        assert l2[-1] < l2[0], l2  # it trains
    print(f"rank {mesh.rank}: OK fsdp fp8 (vs ddp: {diff:.1e})", flush=True)


class MoE(nn.Module):
    """Each row goes to one of two experts; a rank whose rows all go to one expert leaves the other unused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.e0, self.e1, self.out = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, route):
        h = self.inp(x)
        parts = torch.zeros_like(h)
        for i, expert in enumerate((self.e0, self.e1)):
            rows = route == i
            if bool(rows.any()):
                parts = parts.index_put((rows.nonzero().squeeze(1),), expert(h[rows]))
        return self.out(parts)


def _moe_loss(m, b):
    return af.losses.mse(m(b["x"], b["route"]), b["y"])


def _moe_reference(data):
    """One process on the global batches (both experts used), SGD with momentum: its final state."""
    ref_step = af.train_step(_moe_loss, af.optim.sgd(0.1, momentum=0.9))
    ref = ref_step.init(MoE())
    for b in data:
        ref, _ = ref_step(ref, b)
    return ref


def check_moe(mesh, strategy, overlap):
    """ddp: per-parameter buckets launched in the same order on every rank although each rank's backward reaches
    a different expert. fsdp (no accumulation): the expert a rank leaves unused is reduce-scattered as zeros
    (it was refused). Either equals one process on the global batch (where both experts are used)."""
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        data.append({"x": x, "y": y, "route": torch.arange(8) // 4})  # rows 0-3 (rank 0) -> e0, 4-7 -> e1

    ref = _moe_reference(data)
    kw = {"overlap": overlap, "bucket_mb": 16 / 2**20} if strategy == "ddp" else {}
    step = af.shard(af.train_step(_moe_loss, af.optim.sgd(0.1, momentum=0.9)), mesh, strategy=strategy,
                    inputs="global", **kw)  # fmt: skip
    state = step.init(MoE())
    if strategy == "ddp":
        assert len(step.plan.grad_sync.buckets) == 8  # one bucket per tensor
    for b in data:
        state, _ = step(state, b)
    params = full(state.params)
    torch.testing.assert_close(params, ref.params, rtol=1e-5, atol=1e-5)  # (a mismatch names the param)
    diff = max((params[k] - ref.params[k]).abs().max().item() for k in ref.params)
    print(f"rank {mesh.rank}: OK {strategy} moe overlap={overlap} ({diff:.1e})", flush=True)


class ExpertList(nn.Module):
    """`MoE` with its experts in a module list: fsdp shards each expert as an FSDP2 unit of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x, route):
        h = self.inp(x)
        parts = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = route == i
            if bool(rows.any()):  # a rank none of whose rows route here does not call the unit
                parts = parts.index_put((rows.nonzero().squeeze(1),), expert(h[rows]))
        return self.out(parts)


def check_moe_fsdp_accumulate(mesh):
    """fsdp with 2 micro-batches that reduce-scatter each: rank 0 routes its first micro-batch to e0 and its
    second to e1, rank 1 the other way round, so each micro-batch's gradients differ in which params they have
    (over the step both ranks use both experts). The unused expert is reduce-scattered as zeros, so the
    collectives pair up: equals one process on the global batch (without it: mismatched reduce-scatters)."""
    g = torch.Generator().manual_seed(6)
    route = torch.tensor([0] * 4 + [1] * 4 + [1] * 4 + [0] * 4)  # rank 0's rows 0-7, rank 1's 8-15
    data = [{"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 4, generator=g), "route": route}
            for _ in range(3)]  # fmt: skip

    ref = _moe_reference(data)
    step = af.shard(af.accumulate(af.train_step(_moe_loss, af.optim.sgd(0.1, momentum=0.9)), 2), mesh,
                    strategy="fsdp", inputs="global")  # fmt: skip
    state = step.init(MoE())
    for b in data:
        state, _ = step(state, b)
    params = full(state.params)
    diff = max((params[k] - ref.params[k]).abs().max().item() for k in ref.params)
    assert diff <= 1e-6, f"rank {mesh.rank}: MoE params differ from one process by {diff}"
    print(f"rank {mesh.rank}: OK fsdp moe-accumulate ({diff:.1e})", flush=True)


class WithUnused(nn.Module):
    """Two layers used, and a `pooler` no rank calls (as BERT's pooler under a masked-LM loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out, self.pooler = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def check_unused_bf16(mesh):
    """fsdp under bf16 autocast (fp32 reductions), a param no rank uses, 2 micro-batches: reduce-scattered each
    (the default) and held to the last (`sync_each_microbatch=False`, FSDP2's no_sync). Zeros for the unused
    param (`set_reduce_scatter_unused_params`) are its bf16 unsharded dtype beside the held fp32 accumulations,
    which FSDP2's reduce-scatter refuses ("uniform gradient dtype"): so only where each micro-batch syncs. Both
    train alike (fp32 sums in another order), the pooler untouched."""
    g = torch.Generator().manual_seed(7)
    data = [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]

    def loss_fn(model, b):
        return af.losses.mse(model(b["x"]).float(), b["y"])

    out = {}
    for each in (True, False):
        step = af.accumulate(
            af.train_step(loss_fn, af.optim.sgd(0.1, momentum=0.9)), 2, sync_each_microbatch=each
        )
        step = af.shard(af.autocast(step, torch.bfloat16), mesh, strategy="fsdp", inputs="global")
        state = step.init(WithUnused())
        start = full(state.params)
        for b in data:
            state, _ = step(state, b)
        out[each] = full(state.params)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)
    for k in ("pooler.weight", "pooler.bias"):
        torch.testing.assert_close(out[False][k], start[k], rtol=0, atol=0)
    assert (out[False]["inp.weight"] - start["inp.weight"]).abs().max() > 1e-3
    print(f"rank {mesh.rank}: OK fsdp unused-bf16", flush=True)


class AuxHead(nn.Module):
    """Three blocks of one shape (FSDP2 units of their own; the root holds no params): `blocks.0` feeds the main
    output `blocks.1` and an auxiliary head `blocks.2`. (Of one shape, FSDP2's collectives on ranks whose backward
    skips the head pair up, wrongly, instead of failing on their sizes or hanging.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = torch.tanh(self.blocks[0](x))
        aux = self.blocks[2](h)
        return self.blocks[1](h), aux


def _aux_loss(fill):
    """The main loss, plus the auxiliary head's on the rows weighted `w` where a rank has any (`fill`: else
    `0 * aux.sum()`, so that its output reaches the loss on every rank)."""

    def loss_fn(m, b):
        main, aux = m(b["x"])
        loss = (main - b["y"]).pow(2).mean()
        if bool(b["w"].any()):
            return loss + (aux.pow(2).mean(1) * b["w"]).mean()
        return loss + 0 * aux.sum() if fill else loss

    return loss_fn


def check_fsdp_unreached(mesh):
    """Every rank runs the auxiliary head's unit, but its output reaches the loss on rank 0 only: FSDP2 would
    reduce-scatter it on rank 1 from the backward's final callback, after the others (sums silently wrong).
    Refused on every rank before the update, naming the unit (and the micro-batch); with `0 * aux.sum()` where
    a rank has no auxiliary rows it equals one process on the global batch, with and without accumulation."""
    g = torch.Generator().manual_seed(8)

    def batch(w):
        return {
            "x": torch.randn(16, 8, generator=g),
            "y": torch.randn(16, 8, generator=g),
            "w": torch.tensor(w),
        }

    rank0_only = [1.0] * 8 + [0.0] * 8  # rank 0's rows 0-7, rank 1's 8-15
    late = [1.0] * 12 + [0.0] * 4  # with 2 micro-batches of 4 rows per rank: rank 1's second has none
    bad = {
        "": (lambda s: s, rank0_only, "'blocks.2' on 1 of 2 ranks: it ran its forward on every rank"),
        "acc": (lambda s: af.accumulate(s, 2), late, "'blocks.2' on 1 of 2 ranks in micro-batch 2"),
        "nosync": (
            lambda s: af.accumulate(s, 2, sync_each_microbatch=False),
            late,
            "'blocks.2' on 1 of 2 ranks:",
        ),
    }
    for name, (wrap, w, text) in bad.items():
        step = af.shard(wrap(af.train_step(_aux_loss(False), af.optim.sgd(0.1))), mesh, strategy="fsdp",
                        inputs="global")  # fmt: skip
        state = step.init(AuxHead())
        before = full(state.params)
        try:
            step(state, batch(w))
        except ValueError as e:
            assert text in str(e) and "0 * out.sum()" in str(e), (name, str(e))
        else:
            raise AssertionError(f"rank {mesh.rank} ({name}): expected an error containing {text!r}")
        after = full(state.params)  # (FSDP2 updates its own params in place: the update did not run)
        assert all(torch.equal(after[k], before[k]) for k in before), name

    data = [batch([1.0] * 16), batch(rank0_only), batch(late)]
    ref_step = af.train_step(_aux_loss(True), af.optim.sgd(0.1, momentum=0.9))
    ref = ref_step.init(AuxHead())
    for b in data:
        ref, _ = ref_step(ref, b)
    diffs = []
    for wrap in (lambda s: s, lambda s: af.accumulate(s, 2)):
        step = af.shard(wrap(af.train_step(_aux_loss(True), af.optim.sgd(0.1, momentum=0.9))), mesh,
                        strategy="fsdp", inputs="global")  # fmt: skip
        state = step.init(AuxHead())
        for b in data:
            state, _ = step(state, b)
        params = full(state.params)
        diffs.append(max((params[k] - ref.params[k]).abs().max().item() for k in ref.params))
    assert max(diffs) <= 1e-6, f"rank {mesh.rank}: params differ from one process by {diffs}"
    print(f"rank {mesh.rank}: OK fsdp unreached ({max(diffs):.1e})", flush=True)


class Boom(Exception):
    pass


def check_abort(mesh, strategy, nosync):
    """A step of 4 micro-batches raising in its second (in the loss, in the middle of the model's forward, or
    in the backward), which the user catches and steps on: FSDP2's state is reset and the first micro-batch's
    gradients dropped (hsdp's partial sums awaiting the replicas' all-reduce, no_sync's unsharded gradients,
    the sharded partial sums), so the next steps equal a run in which that step never happened. Local SGD (each
    rank's own gradients, params averaged every 2 updates) keeps nothing between micro-batches but `.grad`,
    which every step clears first: checked as a regression."""
    calls, fail_at = [0], [None]  # the loss calls so far; the call that raises, and where

    def net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

        def mid_forward(module, args):  # in the forward of the second of the model's FSDP2 units
            if fail_at[0] == (calls[0], "forward"):
                raise Boom("in the forward")

        m[2].register_forward_pre_hook(mid_forward)
        return m

    def loss_fn(model, b):
        calls[0] += 1
        out = model(b["x"])
        if fail_at[0] == (calls[0], "loss"):
            raise Boom("in the loss")
        if fail_at[0] == (calls[0], "backward"):

            def boom(grad):
                raise Boom("in the backward")

            out.register_hook(boom)
        return af.losses.cross_entropy(out, b["y"])

    g = torch.Generator().manual_seed(1)
    data = [
        {"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 5, (16,), generator=g)} for _ in range(4)
    ]

    def run(where):
        calls[0], fail_at[0] = 0, (4 + 2, where)  # step 2, micro-batch 2
        step = af.accumulate(af.train_step(loss_fn, af.optim.adamw(1e-2)), 4, sync_each_microbatch=not nosync)
        kw = {"ddp": {"overlap": True}, "local_sgd": {"sync_every": 2}}.get(strategy, {})
        step = af.shard(step, mesh, strategy=strategy, inputs="global", **kw)
        state = step.init(net())
        losses = []
        for i, b in enumerate(data):
            if where is None and i == 1:  # the reference: that step never happened
                calls[0] += 2
                continue
            try:
                state, m = step(state, b)
                losses.append(m["loss"])
            except Boom:
                assert i == 1 and where is not None, (i, where)
        return full(state.params), torch.stack(losses)

    ref_params, ref_losses = run(None)
    for where in ("loss", "forward", "backward"):
        params, losses = run(where)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")  # noqa: B023
        torch.testing.assert_close(params, ref_params, rtol=1e-5, atol=1e-5)
    extra = ["nosync"] if nosync else []
    print(f"rank {mesh.rank}: OK {strategy} abort {extra}", flush=True)


def check_bn_buffers(mesh, strategy):
    """BatchNorm statistics follow torch DDP (broadcast from rank 0 before each forward), rank by rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))

    g = torch.Generator().manual_seed(6)
    data = [torch.randn(8, 4, generator=g) * (1 + i) for i in range(3)]
    local = [x[mesh.data_rank * 4 : (mesh.data_rank + 1) * 4] for x in data]
    step = af.shard(
        af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh, strategy=strategy
    )
    state = step.init(net())
    for x in local:
        state, _ = step(state, x)
    ref = DDP(net())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in local:
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    want = dict(ref.module.named_buffers())
    diff = max((state.buffers[k].float() - want[k].float()).abs().max().item() for k in want)
    params = full(state.params)
    pdiff = max((params[k] - p).abs().max().item() for k, p in ref.module.named_parameters())
    assert diff <= 1e-6 and pdiff <= 1e-6, (
        f"rank {mesh.rank}: buffers differ from torch DDP by {diff}, params {pdiff}"
    )
    del ref
    print(f"rank {mesh.rank}: OK {strategy} bn-buffers ({diff:.1e})", flush=True)


def check_fsdp_guards(mesh):
    """What FSDP2 cannot do is refused with a clear error instead of a silently wrong result."""

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def loss_fn(m, b):
        return af.losses.mse(m(b["x"]) * b["temp"], b["y"])

    g = torch.Generator().manual_seed(7)
    data = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g), "temp": torch.tensor(2.0)}
            for _ in range(3)]  # fmt: skip  # a 0-d leaf passes through inputs="global" unsplit

    def expect(fn, text):
        try:
            fn()
        except (ValueError, af.CompositionError) as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"expected an error containing {text!r}")

    kept = af.shard(
        af.train_step(loss_fn, af.optim.sgd(0.1), donate=False), mesh, strategy="fsdp", inputs="global"
    )
    state = kept.init(net())
    expect(lambda: kept(state, data[0]), "are not the FSDP module's own parameters")

    step = af.shard(af.train_step(loss_fn, af.optim.sgd(0.1)), mesh, strategy="fsdp", inputs="global")
    state = step.init(net())
    evaluate = af.eval_step(lambda m, b: m(b["x"]))
    evaluate.init(step.model)
    copy_ = state.replace(params={k: v.detach().clone() for k, v in state.params.items()})
    expect(lambda: evaluate(copy_, data[0]), "not the FSDP-sharded model's own parameters")
    state, _ = step(state, data[0])
    state, _ = step(state, data[1])
    state = step.init(step.model)  # again (e.g. after changing requires_grad): reuses the sharded module
    state, _ = step(state, data[2])
    ref_step = af.train_step(loss_fn, af.optim.sgd(0.1))
    ref = ref_step.init(net())
    for b in data[:2]:
        ref, _ = ref_step(ref, b)
    ref = ref_step.init(ref_step.model)
    ref, _ = ref_step(ref, data[2])
    diff = max((v.full_tensor() - ref.params[k]).abs().max().item() for k, v in state.params.items())
    assert diff <= 1e-6, diff

    # experts that are FSDP2 units of their own, called only by the ranks that route to them (after a step in
    # which every rank called both): the unit a rank skips is reduce-scattered after its backward, out of order
    moe = af.shard(af.train_step(_moe_loss, af.optim.sgd(0.1)), mesh, strategy="fsdp", inputs="global")
    moe_state = moe.init(ExpertList())
    assert "experts.0" in moe.plan.grad_sync.forwards.names, moe.plan.grad_sync.forwards.names
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 4), "route": torch.arange(8) % 2}
    moe_state, _ = moe(moe_state, batch)
    batch["route"] = torch.arange(8) // 4
    expect(lambda: moe(moe_state, batch), "the FSDP2 unit 'experts.0' ran its forward on some ranks and not")

    expect(lambda: af.offload(step).init(net()), "offloading FSDP-sharded state is not supported")
    print(f"rank {mesh.rank}: OK fsdp guards (re-init vs one process {diff:.1e})", flush=True)


def check(strategy, extra, mesh):
    data = batches()
    opt = (
        (lambda: af.optim.sgd(0.1, momentum=0.9))
        if "sgd" in extra
        else (lambda: af.optim.adamw(1e-3, weight_decay=0.01))
    )  # noqa: E731

    ref_step = af.train_step(loss_fn, opt(), clip_grad_norm=1.0)
    ref_state = ref_step.init(make_model())
    ref_losses = []
    for b in data:
        ref_state, m = ref_step(ref_state, b)
        ref_losses.append(m["loss"].item())

    step = af.train_step(loss_fn, opt(), clip_grad_norm=1.0)
    if "accumulate" in extra:  # nosync: one reduce-scatter per step (FSDP2's no_sync), else each micro-batch
        step = af.accumulate(step, 2, sync_each_microbatch=False if "nosync" in extra else None)
    kw = {"overlap": True} if "overlap" in extra else {}
    kw["inputs"] = "local" if "local" in extra else "global"
    if "smallbuckets" in extra:  # ~2 KB buckets: many buckets, several in flight at once with overlap
        kw["bucket_mb"] = 0.002
    if "remat" in extra:  # activation checkpointing per block changes memory, never results
        step = af.remat(step, "selective" if "compile" in extra else "full")
    step = af.shard(step, mesh, strategy=strategy, **kw)
    if (
        "compile" in extra
    ):  # under fsdp: each block compiled in place before FSDP2 shards it (aot_eager: no C++ build)
        step = af.compile(step, backend="aot_eager")

    def local_part(b):  # inputs="local": each rank passes only its own rows (what a sharded loader yields)
        if "local" not in extra:
            return b
        n = next(iter(b.values())).shape[0] // mesh.data_size
        return {k: v[mesh.data_rank * n : (mesh.data_rank + 1) * n] for k, v in b.items()}

    calls = {"all_reduce": 0, "reduce_scatter": 0}
    # hsdp: this step's reduce-scatters ("rs") and FSDP2's all-reduces over the replicas ("ar"), in order
    events: list[str] = []
    replicas = None
    if strategy == "hsdp":
        from accelfn.transforms.shard.fsdp import hsdp_mesh

        replicas = hsdp_mesh(mesh).get_group(
            0
        )  # the group FSDP2 all-reduces the reduce-scattered shards over
    real_all_reduce = dist.all_reduce
    # FSDP2 calls dist.reduce_scatter_single (torch 2.13) or dist.reduce_scatter_tensor (before)
    scatter_names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    real_scatters = {n: getattr(dist, n) for n in scatter_names}

    def counting_all_reduce(*a, **k):
        calls["all_reduce"] += 1
        if replicas is not None and k.get("group", a[1] if len(a) > 1 else None) is replicas:
            events.append("ar")
        return real_all_reduce(*a, **k)

    def counting(name):
        def call(*a, **k):
            calls["reduce_scatter"] += 1
            events.append("rs")
            return real_scatters[name](*a, **k)

        return call

    state = step.init(make_model())
    if "compile" in extra:
        from accelfn.transforms.compile import model_blocks

        assert "compile per block under fsdp" in repr(step), repr(step)
        _, blocks = model_blocks(step.model)
        # compiled in place (FSDP2's hooks still run around each block), and sharded by FSDP2
        assert all(b._compiled_call_impl is not None for b in blocks), repr(step)
        assert all(type(b).__name__.startswith("FSDP") for b in blocks), [type(b).__name__ for b in blocks]
    if model_kind == "t5" and strategy == "fsdp":  # both stacks' blocks are FSDP2 units, not only the larger
        units = [n for n, m in step.model.named_modules() if type(m).__name__.startswith("FSDP")]
        assert units == ["", *[f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(2)]], units
    dist.all_reduce = counting_all_reduce
    for name in scatter_names:
        setattr(dist, name, counting(name))
    losses = []
    per_step_calls, per_step_scatters, per_step_events = [], [], []
    for b in data:
        before, scatters = calls["all_reduce"], calls["reduce_scatter"]
        events.clear()
        state, m = step(state, local_part(b))
        per_step_calls.append(calls["all_reduce"] - before)
        per_step_scatters.append(calls["reduce_scatter"] - scatters)
        per_step_events.append(list(events))
        losses.append(m["loss"].item())
    dist.all_reduce = real_all_reduce
    for name, real in real_scatters.items():
        setattr(dist, name, real)

    params = full(state.params)
    diff = max((params[k] - ref_state.params[k]).abs().max().item() for k in params)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    # AdamW's update is about lr * sign(g) where g is near 0, so fp32 round-off in the loss moves a few params by
    # a fraction of lr (measured on gpt2: 7.6e-6 with torch's cross entropy, 1.2e-5 with the chunked one, lr
    # 1e-3); SGD (the "sgd" configs) is linear in the gradient and stays under 2e-7: a gradient's scale shows there
    tolerance = 1e-5 if "sgd" in extra else 2e-5
    assert diff <= tolerance, f"rank {mesh.rank}: params differ from the single-process run by {diff}"
    assert loss_diff <= 1e-5, f"rank {mesh.rank}: losses differ by {loss_diff}: {losses} vs {ref_losses}"
    if strategy == "ddp":
        # one all-reduce per gradient bucket and one for (loss sum, count), per call — whatever accumulate does
        buckets = len(step.plan.grad_sync.buckets)
        assert buckets > 5 if "smallbuckets" in extra else buckets == 1, buckets
        assert per_step_calls == [buckets + 1] * len(data), (per_step_calls, buckets)
        expected = (
            buckets * len(data) if "overlap" in extra else 0
        )  # buckets started during the backward pass
        assert step.plan.grad_sync.overlapped == expected, (step.plan.grad_sync.overlapped, expected)
    if strategy in ("fsdp", "hsdp") and "compile" not in extra:
        # one reduce-scatter per FSDP2 unit per micro-batch (sync_each_microbatch), or per step with nosync
        from torch.distributed.fsdp import FSDPModule

        units = sum(
            1
            for mod in step.model.modules()
            if isinstance(mod, FSDPModule) and mod._get_fsdp_state()._fsdp_param_group is not None
        )
        micro = 2 if "accumulate" in extra and "nosync" not in extra else 1
        assert per_step_scatters == [units * micro] * len(data), (per_step_scatters, units, micro)
        if strategy == "hsdp":
            # one all-reduce over the replicas per unit per step, in the last micro-batch (after every earlier
            # micro-batch's reduce-scatters; with nosync the only one's)
            for ev in per_step_events:
                assert ev.count("ar") == units and "ar" not in ev[: units * (micro - 1)], (ev, units, micro)
    if strategy in ("fsdp", "hsdp") and model_kind == "gpt2":
        # the hooks saw the backward reach every block (compiled, recomputed by remat, or not), in each reducing
        # micro-batch: the check of a unit the backward reached on some ranks only is not vacuous here
        sync = step.plan.grad_sync
        reached = [[n for n, r in zip(sync.forwards.names, micro) if r] for micro in sync.reached]
        blocks = [n for n in sync.forwards.names if n]  # (not the root: token ids need no gradient)
        assert len(blocks) == 2 and reached == [blocks] * len(sync.reached) and reached, (reached, blocks)
    if strategy in ("fsdp", "hsdp"):
        local = sum(_l.numel() for _l in (v.to_local() for v in state.params.values()))
        total = sum(v.numel() for v in params.values())
        opt_local = sum(t.to_local().numel() for t in af.tree.leaves(state.opt_state.mu))
        n = mesh.axis_size("fsdp") if strategy == "hsdp" else mesh.data_size
        assert local <= total / n + 64 * len(params), (local, total)
        assert opt_local <= total / n + 64 * len(params), (opt_local, total)
        print(f"rank {mesh.rank}: local params {local} of {total}, opt mu {opt_local}")
    print(
        f"rank {mesh.rank}: OK {strategy} {model_kind} {sorted(extra)} max param diff {diff:.2e} calls {per_step_calls[:3]}"
    )


# hsdp: 2 replicas of 2 shards on 4 ranks, or of 1 shard on 2 (FSDP2's all-reduce over the replicas alone)
hsdp_axes = {"dp": 2, "fsdp": int(os.environ["WORLD_SIZE"]) // 2}
mesh = af.Mesh(hsdp_axes if CONFIGS[0][0] == "hsdp" else {"dp": -1}, device="cpu")
# the data-parallel group spans every data axis (hsdp: dp x fsdp = all 4 ranks); TE reduces fp8 amax over it
group = mesh.data_group()
ones = torch.ones(1)
dist.all_reduce(ones, group=group)
assert dist.get_world_size(group) == mesh.data_size and ones.item() == mesh.data_size, (ones, mesh.data_size)
del group
# the configs checked by a function of their own, by kind: (strategy, mesh, the config's other parts)
SPECIAL = {
    "fp16skip": lambda strategy, mesh, rest: check_fp16_skip(strategy, mesh),
    "frozen": lambda strategy, mesh, rest: check_frozen_differently(strategy, mesh),
    "bf16count": lambda strategy, mesh, rest: check_bf16_count(strategy, mesh),
    "bf16policy": lambda strategy, mesh, rest: check_fsdp_bf16_policy(mesh),
    "fp8": lambda strategy, mesh, rest: check_fp8_fsdp(mesh),
    "guards": lambda strategy, mesh, rest: check_fsdp_guards(mesh),
    "moe": lambda strategy, mesh, rest: check_moe(mesh, strategy, overlap="overlap" in rest),
    "moeacc": lambda strategy, mesh, rest: check_moe_fsdp_accumulate(mesh),
    "unusedbf16": lambda strategy, mesh, rest: check_unused_bf16(mesh),
    "unreached": lambda strategy, mesh, rest: check_fsdp_unreached(mesh),
    "abort": lambda strategy, mesh, rest: check_abort(mesh, strategy, nosync="nosync" in rest),
    "bn": lambda strategy, mesh, rest: check_bn_buffers(mesh, strategy),
}
for strategy, kind, *rest in CONFIGS:
    model_kind = kind  # read by make_model, batches and loss_fn
    if kind in SPECIAL:
        SPECIAL[kind](strategy, mesh, rest)
    else:
        check(strategy, set(rest), mesh)
mesh.close()
