"""Worker: expert parallel (ep, alone or with dp) == one process on the global batch, SGD, fp32.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/ep_worker.py ep=2 qwen qwen:to=0 user:clip

Each config is `model[:option...]`: model in qwen (a tiny transformers Qwen3-MoE, its own ep plan), user (a
user-written MoE module with its own plan and local expert forward); options: clip (a clipping norm that
clips), aux (plus the load-balancing loss of the global batch, vs transformers' aux_loss in one process),
bf16 (af.autocast, vs one process under it), accumulate (2 micro-batches), remat (full activation checkpointing), fsdp (strategy "fsdp": the experts
FSDP-sharded over the data axes but ep), hsdp (strategy "hsdp": dense params replicated over dp and sharded over fsdp x ep,
the experts split over ep, replicated over dp and sharded over fsdp), repeat (a second run is bitwise the same), save=<folder> (save and load the final state), to=<rank> (the router sends every token to that ep rank's experts: the other ranks receive none),
mesh=<axes> (this config on another mesh of the same processes than the first argument's, e.g. mesh=pp=2,ep=2;
with a tp axis: the model's tp plan on attention, embeddings and head, 2 kv heads),
pp (af.pipeline over the mesh's pp axis, 2 micro-batches of 1F1B: each stage's experts split over its ep group),
bias (aux-loss-free balancing: the expert bias updated after each step from the global counts, vs one process),
experts=<n> (n experts instead of 4; under fsdp with fewer local experts than efsdp ranks: checked sharded on dim 1
over efsdp, with no padding), gather (`af.shard(ep_dispatcher=GatherDispatcher)`: a user's dispatcher that moves
the rows by all-gather and select, not all-to-all; named in print(step)), adamw (AdamW with weight decay, in both
runs, instead of SGD), selective (`af.remat(step, "selective")`), fp8 (`af.autocast_fp8(emulate=True)` on the experts only, in both runs: their
grouped GEMMs in emulated mxfp8; hidden size and expert width 32).
Checked: the loss, the gradient norm, the token imbalance (`metrics["moe_imbalance"]`) and the params (experts, router, attention, embeddings) after each of 2 SGD (or AdamW)
steps (under a pipeline: the stage's own); the experts really split; the identity of dispatch-then-combine over the ep group
(accelfn's all-to-all and the user's all-gather dispatcher, which receive the same rows).
"""

import math
import sys

import torch
import torch.distributed as dist
from torch import nn

import accelfn as af
from accelfn.launch_env import parse_mesh
from accelfn.moe import (
    AllToAllDispatcher,
    add_aux_loss,
    add_expert_bias,
    load_balancing_loss,
    local_part,
    update_expert_bias,
)
from accelfn.transforms.shard.expert_parallel import expert_axes

CONFIGS = [arg.split(":") for arg in sys.argv[2:]]
VOCAB, EXPERTS, TOPK = 64, 4, 2
HIDDEN, MOE_F = 16, 8  # the qwen model's hidden size and expert width (32, 32 under fp8: mxfp8's 32-blocks)


class UserExperts(nn.Module):
    """A user's experts: w_in [E, F, D], w_out [E, D, F], GELU, no gate; transformers' experts interface."""

    def __init__(self, d=16, f=8):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, f, d) * 0.3)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, d, f) * 0.3)

    def one(self, x, w_in, w_out):
        return nn.functional.gelu(x @ w_in.T) @ w_out.T

    def forward(self, hidden, idx, weights):  # the dense reference: every expert on this rank
        out = torch.zeros_like(hidden)
        for e in range(EXPERTS):
            tok, pos = torch.where(idx == e)
            y = self.one(hidden[tok], self.w_in[e], self.w_out[e]) * weights[tok, pos, None]
            out = out.index_add(0, tok, y.to(out.dtype))
        return out

    def ep_local_forward(self, rows, counts):  # under ep: this rank's experts on rows grouped by expert
        w_in, w_out = local_part(self.w_in), local_part(self.w_out)
        parts = rows.split(counts.tolist())
        return torch.cat([self.one(x, w_in[e], w_out[e]) for e, x in enumerate(parts)])


class UserMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.router = nn.Linear(16, EXPERTS, bias=False)
        self.experts = UserExperts()
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        flat = h.reshape(-1, 16)
        probs = self.router(flat).softmax(-1)
        w, idx = probs.topk(TOPK, dim=-1)
        return self.head(h + self.experts(flat, idx, w).view_as(h))


GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


class _Gathered(torch.autograd.Function):
    """Every rank's `x` (one shape on all) stacked in rank order, on every rank; the backward sums the gradient of
    the stacked tensor over the ranks (each rank's loss read its copy) and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n, r = grad.shape[0] // dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad[r * n : (r + 1) * n], None


class GatherDispatcher:
    """A user's dispatcher (an `ep_dispatcher` factory: accelfn calls it with these keywords), another algorithm than
    accelfn's all-to-all: every rank all-gathers every rank's rows and expert ids and keeps the rows of its own
    experts (grouped by local expert, then source rank, then position); `combine` all-gathers every rank's outputs
    and each rank picks its own rows' from them."""

    def __init__(self, group, num_experts, size, capacity_factor=None, data_group=None):
        assert capacity_factor is None, "GatherDispatcher is dropless"
        self.group, self.size, self.local = group, size, num_experts // size

    def dispatch(self, x, experts):
        ids, rank = experts.reshape(-1), dist.get_rank(self.group)
        sizes = torch.empty(self.size, dtype=torch.int64)
        GATHER(sizes, torch.tensor([x.shape[0]]), group=self.group)
        most = int(sizes.max())
        every = _Gathered.apply(torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]), self.group)
        every_ids = torch.empty(self.size * most, dtype=ids.dtype)
        GATHER(every_ids, torch.cat([ids, ids.new_full((most - len(ids),), -1)]), group=self.group)
        owner = torch.where(every_ids >= 0, every_ids // self.local, -1)
        picks = []  # per rank: the gathered rows its experts take, by local expert (stable: source rank, position)
        for r in range(self.size):
            idx = torch.nonzero(owner == r).reshape(-1)
            picks.append(idx[torch.argsort(every_ids[idx], stable=True)])
        mine = picks[rank]
        counts = torch.bincount(every_ids[mine] - rank * self.local, minlength=self.local)
        return every[mine], counts, (picks, x.shape[0], most)

    def combine(self, y, handle):
        picks, n, most = handle
        widest = max(len(p) for p in picks)
        outs = _Gathered.apply(torch.cat([y, y.new_zeros((widest - y.shape[0], *y.shape[1:]))]), self.group)
        where = torch.full((self.size * most,), -1, dtype=torch.int64)  # gathered row -> its place in `outs`
        for r, idx in enumerate(picks):
            where[idx] = r * widest + torch.arange(len(idx))
        rank = dist.get_rank(self.group)
        return outs[where[rank * most : rank * most + n]]


USER_PLAN = {
    "experts.w_in": "grouped_gemm",
    "experts.w_out": "grouped_gemm",
    "experts": "ep_dispatch_experts",
}


def make_model(kind, to, bias=False, kv_heads=1):
    torch.manual_seed(0)
    if kind == "user":
        model = UserMoE()
        routers = [model.router]
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=MOE_F,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=8,
                             num_experts=EXPERTS, num_experts_per_tok=TOPK, max_position_embeddings=32,
                             tie_word_embeddings=False)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # transformers zero-initialises the router: give it weights to learn from
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
        routers = [layer.mlp.gate for layer in model.model.layers]
        if bias:
            add_expert_bias(model)
    if to is not None:  # every choice to rank `to`'s experts (ep=2: experts 2*to, 2*to+1)
        for r in routers:
            r.register_forward_hook(lambda m, a, out, to=to: _force(out, to))
    model.chosen = {}  # router -> the experts it chose in the last forward (the reference's token counts)
    for i, r in enumerate(routers):
        r.register_forward_hook(lambda m, a, out, i=i: model.chosen.__setitem__(i, _chosen(out)))
    return model


BIAS_RATE = 0.05  # large enough to change some routing decisions in the second step


def _chosen(out):
    return out[2] if isinstance(out, tuple) else out.softmax(-1).topk(TOPK, dim=-1).indices


def imbalance(chosen):
    """Over the layers, the largest ratio of the most loaded expert's rows to the mean (the step's metric)."""
    counts = torch.stack([torch.bincount(c.reshape(-1), minlength=EXPERTS).float() for c in chosen.values()])
    return (counts.max(1).values / counts.mean(1)).max().item()


def _force(out, to):
    if isinstance(out, tuple):  # transformers' router: (logits, scores, indices)
        return (*out[:2], out[2] % 2 + 2 * to)
    keep = torch.tensor(
        [e // 2 == to for e in range(EXPERTS)]
    )  # the user's router: logits of other experts down
    return out.masked_fill(~keep, -1e4)


def batches(n=2, rows=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (rows, 12), generator=g)
        labels = ids.clone()
        for r in range(rows):  # uneven valid-token counts per row, so per data rank
            labels[r, (r * 3) % 11 + 1 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def lm_loss(model, b):
    out = model(input_ids=b["input_ids"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return af.losses.cross_entropy(logits[:, :-1], b["labels"][:, 1:])


def aligned_loss(model, b):
    """The same loss with the labels shifted in the batch (context parallel splits the sequence: position i's
    target must sit at position i)."""
    return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits, b["next"])


def aligned(data):
    out = []
    for b in data:
        nxt = torch.full_like(b["labels"], -100)
        nxt[:, :-1] = b["labels"][:, 1:]
        out.append({"input_ids": b["input_ids"], "next": nxt})
    return out


def aux_loss(group=None, reference=False):
    """The LM loss plus 0.1 x the load-balancing loss of the global batch: transformers' own (`aux_loss`) in
    the reference process, accelfn's global one (this rank's share) under ep."""

    def fn(model, b):
        out = model(input_ids=b["input_ids"], output_router_logits=True)
        if "next" in b:  # labels aligned (context parallel)
            ce = af.losses.cross_entropy(out.logits, b["next"])
        else:
            ce = af.losses.cross_entropy(out.logits[:, :-1], b["labels"][:, 1:])
        if reference:
            return af.Loss(ce.total + 0.1 * ce.count * out.aux_loss, ce.count)
        share = load_balancing_loss(out.router_logits, EXPERTS, TOPK, group=group)
        return add_aux_loss(ce, share, 0.1, group)

    return fn


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def check_identity(mesh):
    """dispatch then combine is the identity, with uneven and empty sends, over the ep group."""
    g = torch.Generator().manual_seed(10 + mesh.rank)
    ep = mesh.axis_size("ep")
    d = AllToAllDispatcher(mesh.group("ep"), EXPERTS, ep)
    other = GatherDispatcher(mesh.group("ep"), EXPERTS, ep)
    for n in (0, 1, 7):
        x = torch.randn(n, 5, generator=g)
        experts = torch.randint(0, EXPERTS, (n,), generator=g)
        rows, counts, handle = d.dispatch(x, experts)
        assert counts.sum().item() == rows.shape[0], (counts, rows.shape)
        assert torch.equal(d.combine(rows, handle), x)
        # the user's all-gather dispatcher receives the same rows in the same order (by local expert, source rank,
        # position), and its combine is the identity too
        rows2, counts2, handle2 = other.dispatch(x, experts)
        assert torch.equal(rows2, rows) and torch.equal(counts2, counts), (rows2, rows)
        assert torch.equal(other.combine(rows2, handle2), x)


# fp8: one process and the ep ranks quantize alike (an expert's padded row group holds the same rows in the same
# order), but bf16 GEMM outputs of fp32 inputs that differ by round-off can round a bf16 ulp apart
FP8_TOL = 1e-3


def check(mesh, kind, options):
    global EXPERTS, HIDDEN, MOE_F
    EXPERTS = next((int(o[8:]) for o in options if o.startswith("experts=")), 4)
    fp8 = "fp8" in options
    HIDDEN, MOE_F = (32, 32) if fp8 else (16, 8)
    strategy = "fsdp" if "fsdp" in options else "hsdp" if "hsdp" in options else "ddp"
    to = next((int(o[3:]) for o in options if o.startswith("to=")), None)
    clip = 0.05 if "clip" in options else 1e9
    cp = "cp" in mesh.axis_names
    data = aligned(batches()) if cp else batches()
    loss = aligned_loss if cp else lm_loss
    aux = "aux" in options
    adamw = "adamw" in options

    def optimizer():
        return af.optim.adamw(1e-2, weight_decay=0.1) if adamw else af.optim.sgd(0.5)

    ref_step = af.train_step(aux_loss(reference=True) if aux else loss, optimizer(), clip_grad_norm=clip)
    bf16 = "bf16" in options
    if bf16:
        ref_step = af.autocast(ref_step, "bf16")

    def experts_in_fp8(s):  # the experts only (no Linear in fp8: their per-rank scales would differ)
        return af.autocast_fp8(s, backend="torchao", emulate=True, module_filter=lambda m, n: False)

    if fp8:
        ref_step = experts_in_fp8(ref_step)
    bias = "bias" in options
    tp = mesh.axis_size("tp") if "tp" in mesh.axis_names else 1
    ref = ref_step.init(make_model(kind, to, bias, kv_heads=tp), seed=3)
    ref_params, ref_losses, ref_norms, ref_imbalance, ref_biases = [], [], [], [], []
    for b in data:
        ref, m = ref_step(ref, b)
        if bias:
            ref, _ = update_expert_bias(ref, BIAS_RATE)
            ref_biases.append({k: v.clone() for k, v in ref.buffers.items() if k.endswith("expert_bias")})
        ref_imbalance.append(imbalance(ref_step.model.chosen))
        ref_losses.append(m["loss"].item())
        ref_norms.append(m["grad_norm"].item())
        ref_params.append({k: v.clone() for k, v in ref.params.items()})

    tokens = (
        mesh  # group=mesh: the ranks that see different tokens (the data axes and cp; accelfn.moe.row_group)
    )
    step = af.train_step(aux_loss(tokens) if aux else loss, optimizer(), clip_grad_norm=clip)
    if "accumulate" in options:
        step = af.accumulate(step, 2)
    if "remat" in options:
        step = af.remat(step, "full")
    if "selective" in options:
        step = af.remat(step, "selective")
    if bf16:
        step = af.autocast(step, "bf16")
    if fp8:
        step = experts_in_fp8(step)
    pp = "pp" in options
    if pp:
        step = af.pipeline(step, mesh, microbatches=2)
    gather = GatherDispatcher if "gather" in options else None
    step = af.shard(step, mesh, strategy=strategy, inputs="global", ep_plan=USER_PLAN if kind == "user" else None,
                    ep_dispatcher=gather)  # fmt: skip
    state = step.init(make_model(kind, to, bias, kv_heads=tp), seed=3)
    text = repr(step)
    if fp8:
        assert "2 experts module(s) with grouped GEMMs in mxfp8_emulated (torchao)" in text, text
    if gather:
        assert "dispatcher=GatherDispatcher" in text and "GatherDispatcher dispatch" in text, text
    else:
        assert "all-to-all dispatch" in text, text
    split = expert_axes(mesh)  # ep, and the tp and cp axes it borrows
    per_rank = EXPERTS // math.prod(mesh.axis_size(a) for a in split)
    if (
        tp > 1
    ):  # the model's tp plan for attention and head; its entries for the experts give way to the ep plan
        assert "the experts follow the ep plan, not these tp plan entries" in text, text
        q = state.params["model.layers.0.self_attn.q_proj.weight"]
        assert q.device_mesh.mesh_dim_names == ("tp",) and q.placements[0].is_shard(0), q
    assert "expert_parallel(ep=" in text and f"{per_rank} of {EXPERTS} experts per rank" in text, text
    experts = [n for n in state.params if "experts" in n]
    for n in experts:
        p = state.params[n]
        names = p.device_mesh.mesh_dim_names
        assert all(a in names and p.placements[names.index(a)].is_shard() for a in split), (n, p)
        if strategy in (
            "fsdp",
            "hsdp",
        ):  # FSDP2 over the other data axes (efsdp): dim 1 where the local experts are fewer
            efsdp = [
                a for a in names if a not in split and (strategy == "fsdp" or a != "dp")
            ]  # hsdp: dp replicates
            assert strategy == "fsdp" or p.placements[names.index("dp")].is_replicate(), (n, p.placements)
            size = math.prod(mesh.axis_size(a) for a in efsdp)
            dim = 0 if per_rank % size == 0 else 1
            on = [getattr(p.placements[names.index(a)], "dim", None) for a in efsdp]  # Shard or _StridedShard
            assert efsdp and on == [dim] * len(efsdp), (n, p.placements)
            # no padding: every rank holds 1/efsdp of its ep rank's experts (a padded dim 0 gives ranks more or none)
            assert p.to_local().numel() * size * (EXPERTS // per_rank) == p.numel(), (n, p.to_local().shape)
            assert p.to_local().shape[0] == (per_rank // size if dim == 0 else per_rank), (
                n,
                p.to_local().shape,
            )
        else:
            assert p.to_local().shape[0] == per_rank, (n, p)
    if strategy == "fsdp" and per_rank == 1:
        assert "experts FSDP-sharded on dim 1" in text, text
    if strategy == "hsdp":  # dense: replicated over dp, sharded over the other data axes (ep among them)
        q = state.params[
            "model.layers.0.self_attn.q_proj.weight"
            if kind == "qwen"
            else next(n for n in state.params if "experts" not in n)
        ]
        shard = "_".join(a for a in mesh.grad_axes if a != "dp")
        assert q.device_mesh.mesh_dim_names == ("dp", shard), q.device_mesh
        assert q.placements[0].is_replicate() and q.placements[1].is_shard(0), q.placements
    # bf16: the experts' rows in other groupings round otherwise; tp, cp, pp: round-off only (a tp-split norm's
    # gradient left unsummed is 3e-5 off after 2 steps)
    tol = 2e-2 if bf16 else FP8_TOL if fp8 else 1e-6 if tp > 1 or cp or "pp" in options else 2e-5
    if pp:  # this stage's params only: some, experts among them, none of the other stage's
        assert experts and set(state.params) < set(ref_params[0]), sorted(state.params)
    for i, b in enumerate(data):
        state, m = step(state, b)
        if bias:
            state, _ = update_expert_bias(state, BIAS_RATE, group=tokens)
            mine = {k: v for k, v in state.buffers.items() if k.endswith("expert_bias")}
            assert mine and all(torch.equal(full(v), ref_biases[i][k]) for k, v in mine.items()), (i, mine)
        assert abs(m["loss"].item() - ref_losses[i]) < tol, (i, m["loss"].item(), ref_losses[i])
        assert abs(m["grad_norm"].item() - ref_norms[i]) < tol * ref_norms[i], (
            i,
            m["grad_norm"],
            ref_norms[i],
        )
        assert abs(m["moe_imbalance"].item() - ref_imbalance[i]) < 1e-6, (
            i,
            m["moe_imbalance"],
            ref_imbalance[i],
        )
        assert pp or sorted(state.params) == sorted(ref_params[i])
        for k, v in state.params.items():
            diff = (full(v) - ref_params[i][k]).abs().max().item()
            assert diff < tol, f"step {i + 1}: {k} differs from one process by {diff}"
    if "repeat" in options:  # a second run from the same start: bitwise the same params
        again = step.init(make_model(kind, to, bias, kv_heads=tp), seed=3)
        for b in data:
            again, _ = step(again, b)
        for k, v in state.params.items():
            assert torch.equal(full(again.params[k]), full(v)), f"{k}: two runs differ"
    save = next((o[5:] for o in options if o.startswith("save=")), None)
    if save is not None:  # saved at this ep layout, loaded into a fresh state of the same layout: exact
        af.checkpoint.save(save, state)
        gathered = {k: full(v).contiguous() for k, v in state.params.items()}  # collective: on every rank
        if mesh.is_main:  # the whole params, for the test to compare a load without ep with
            from safetensors.torch import save_file

            save_file(gathered, save + "-full.safetensors")
        fresh = step.init(make_model(kind, to, bias, kv_heads=tp), seed=5)
        loaded = af.checkpoint.load(save, like=fresh)
        for k, v in state.params.items():
            assert torch.equal(full(loaded.params[k]), full(v)), k
        state2, m2 = step(loaded, data[0])
        assert torch.isfinite(m2["loss"]), m2
    if to is not None and not adamw:  # the other rank's experts got no token: zero gradients, unchanged (one
        # process too); AdamW's weight decay moves them (checked equal to one process above)
        first = make_model(kind, to, bias, kv_heads=tp).state_dict()
        idle = [e for e in range(EXPERTS) if e // 2 != to]  # the router chose experts 2*to and 2*to+1 only
        for n in experts:
            assert torch.equal(full(state.params[n])[idle], first[n][idle]), n


def main():
    meshes = {sys.argv[1]: af.Mesh(parse_mesh(sys.argv[1]), device="cpu")}
    check_identity(meshes[sys.argv[1]])
    for config in CONFIGS:
        kind, *options = config
        spec = next((o[5:] for o in options if o.startswith("mesh=")), sys.argv[1])
        if spec not in meshes:  # another layout of the same processes (e.g. pp=2,ep=2 beside ep=4)
            meshes[spec] = af.Mesh(parse_mesh(spec), device="cpu")
        check(meshes[spec], kind, [o for o in options if not o.startswith("mesh=")])
        shown = sorted(o for o in options if not o.startswith("save="))  # as tests/_launch.expect_ok reads
        print(f"rank {meshes[spec].rank}: OK {kind} {shown}", flush=True)
    dist.barrier()
    for mesh in meshes.values():
        mesh.close()


if __name__ == "__main__":
    main()
