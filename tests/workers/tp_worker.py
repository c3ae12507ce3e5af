"""Worker: tensor parallel (alone, or with ddp / fsdp over the data axes) == one process on the global batch.

    accelfn launch --nproc-per-node 4 --cpu tests/workers/tp_worker.py dp=2,tp=2 llama llama:accumulate llama:fsdp

Each config is `model[:option...]`: model in llama (Hugging Face plan), starcoder2 (GPT-2-style: LayerNorm,
biases, GELU MLP, tied embeddings; its own plan), mistral, qwen2, qwen3moe (Qwen3-MoE: its plan's experts entries,
packed_colwise / moe_tp_experts, left out: the experts stay whole on each tp rank; sequence and loss parallel off
by default, on when asked), mlp (a user plan); options: accumulate, fsdp, hsdp,
lossparallel / seqparallel (passed True), nolossparallel / noseqparallel (passed False; neither: the default,
on for the transformers decoders), fp8, loader (inputs from af.data.DataLoader), compile (aot_eager; per block
under fsdp), blocks (with compile: regions="blocks"), sgd (SGD with momentum instead of AdamW),
remat (with compile: full activation checkpointing around each compiled block, torchtitan's Table 5), bf16 (autocast; compared with the single process under the same autocast), userstyles (torch ParallelStyle objects in the plan), save=<folder> (save the final state there).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import accelfn as af
from accelfn.launch_env import parse_mesh

CONFIGS = [arg.split(":") for arg in sys.argv[2:]]
VOCAB = 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(kind):
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=False)  # fmt: skip
        return LlamaForCausalLM(cfg)
    if kind == "starcoder2":
        from transformers import Starcoder2Config, Starcoder2ForCausalLM

        cfg = Starcoder2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                               residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0,
                               tie_word_embeddings=True)  # fmt: skip
        return Starcoder2ForCausalLM(cfg)
    if kind in ("mistral", "qwen2"):
        import transformers

        name = {"mistral": "Mistral", "qwen2": "Qwen2"}[kind]
        cfg = getattr(transformers, f"{name}Config")(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
        )  # fmt: skip
        return getattr(transformers, f"{name}ForCausalLM")(cfg)
    if kind == "gemma3":  # a scaled embedding whose `embed_scale` buffer tensor parallel makes a DTensor
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                               sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                               attn_implementation="sdpa", tie_word_embeddings=False)  # fmt: skip
        return Gemma3ForCausalLM(cfg)
    if kind == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
        return Qwen3MoeForCausalLM(cfg)
    if kind == "deepseekv3":  # a dense first layer, then an MoE one: routed experts whole, shared ones split
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None,
                               kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1,
                               topk_group=1, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
        return DeepseekV3ForCausalLM(cfg)
    return MLP()


def batches(kind, n=4, rows=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        if kind == "mlp":
            out.append(
                {"x": torch.randn(rows, 8, generator=g), "y": torch.randint(0, 5, (rows,), generator=g)}
            )
        else:
            ids = torch.randint(0, VOCAB, (rows, 12), generator=g)
            labels = ids.clone()
            for r in range(rows):  # uneven valid-token counts per row, so per data rank
                labels[r, (r * 3) % 11 + 1 :] = -100
            out.append({"input_ids": ids, "labels": labels})
    return out


def loss_for(kind):
    if kind == "mlp":
        return lambda model, b: af.losses.cross_entropy(model(b["x"]), b["y"])

    def lm_loss(model, b):
        logits = model(input_ids=b["input_ids"]).logits
        return af.losses.cross_entropy(logits[:, :-1], b["labels"][:, 1:])

    return lm_loss


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def check(mesh, kind, options):
    data = batches(kind)
    loss_fn = loss_for(kind)
    opt = lambda: af.optim.adamw(1e-3, weight_decay=0.1)  # noqa: E731
    # sgd: its out-of-place multi-tensor kernels take DTensors of one mesh only (AdamW's in-place ones pass)
    if "sgd" in options:
        opt = lambda: af.optim.sgd(0.1, momentum=0.9)  # noqa: E731
    fp8 = (
        "fp8" in options
    )  # torchao float8 (emulated on CPU), torchao's float8 TP styles: vs fp8 in one process

    def maybe_fp8(s):
        return af.autocast_fp8(s, backend="torchao", recipe="tensorwise", emulate=True,
                               module_filter=lambda m, fqn: "lm_head" not in fqn) if fp8 else s  # fmt: skip

    ref_step = maybe_fp8(af.train_step(loss_fn, opt(), clip_grad_norm=0.5))
    if "bf16" in options:
        ref_step = af.autocast(ref_step, "bf16")
    ref = ref_step.init(make_model(kind), seed=3)
    ref_losses, ref_norms = [], []
    for b in data:
        ref, m = ref_step(ref, b)
        ref_losses.append(m["loss"].item())
        ref_norms.append(m["grad_norm"].item())

    step = maybe_fp8(af.train_step(loss_fn, opt(), clip_grad_norm=0.5))
    if "accumulate" in options:
        step = af.accumulate(step, 2)
    if "remat" in options:
        step = af.remat(step, "full")
    if "bf16" in options:
        step = af.autocast(step, "bf16")
    plan = None
    if kind == "mlp":
        plan = {"fc1": "colwise", "fc2": "rowwise"}
        if "userstyles" in options:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    strategy = "hsdp" if "hsdp" in options else "fsdp" if "fsdp" in options else "ddp"

    def flag(name):  # True / False when the config passes it, None (the default) otherwise
        return True if name in options else False if f"no{name}" in options else None

    inputs = "local" if "loader" in options else "global"
    # lp: logits split over the vocabulary, the loss on the shards; sp: the residual stream split over the
    # sequence between the TP regions. Both on by default for the transformers decoders, off for the mlp
    given_lp, given_sp = flag("lossparallel"), flag("seqparallel")
    # the decoders the defaults are tested on (DEFAULTS_KNOWN)
    known = kind not in ("mlp", "qwen3moe", "deepseekv3")
    lp = given_lp if given_lp is not None else known
    sp = given_sp if given_sp is not None else known and not fp8  # fp8: torchao's float8 styles instead
    step = af.shard(
        step, mesh, strategy=strategy, inputs=inputs, tp_plan=plan, loss_parallel=given_lp,
        sequence_parallel=given_sp,
    )  # fmt: skip
    if "compile" in options:  # under fsdp (or with "blocks") each decoder layer is compiled on its own
        step = af.compile(step, backend="aot_eager", regions="blocks" if "blocks" in options else None)
    state = step.init(make_model(kind), seed=3)
    if kind == "gemma3":  # DDP broadcasts the buffers each step: this one as a DTensor's local tensor
        from torch.distributed.tensor import DTensor

        scale = step.model.model.embed_tokens.embed_scale
        # beside the plain ones (the rotary inv_freq)
        plain = [n for n, b in step.model.named_buffers() if not isinstance(b, DTensor)]
        assert isinstance(scale, DTensor) and plain, (type(scale), plain)
    assert "tensor parallel tp=" in repr(step), repr(step)
    # compiled per block: asked, or under fsdp, or with remat (the checkpoint stays eager around each block's graph)
    per_block = "compile" in options and ("blocks" in options or strategy != "ddp" or "remat" in options)
    assert ("compiled inside their remat checkpoint" in repr(step)) == (per_block and "remat" in options)
    assert ("compiled 2/2 blocks of model.layers" in repr(step)) == per_block, repr(step)
    assert ("loss on vocabulary shards (lm_head)" in repr(step)) == lp, repr(step)
    assert ("float8 tensor-parallel styles (torchao) on 14 modules" in repr(step)) == (fp8 and not sp), repr(
        step
    )
    assert ("sequence parallel between" in repr(step)) == sp, repr(step)
    whole = "the experts stay whole on every tp rank (replicated over tp"
    assert (whole in repr(step)) == (kind in ("qwen3moe", "deepseekv3")), repr(step)
    for n, p in state.params.items():  # (a DTensor over the data axes only: ddp's / fsdp's, not tp's)
        names = p.device_mesh.mesh_dim_names if hasattr(p, "device_mesh") else ()
        assert ".experts." not in n or "tp" not in names, f"{n} is split over tp: {p.placements}"
    assert ("(the default: loss_parallel=False turns it off)" in repr(step)) == (lp and given_lp is None)
    split = [n for n, p in state.params.items() if getattr(p, "placements", None) and any(
        q.is_shard() for q in p.placements)]  # fmt: skip
    assert split, f"no parameter is split: {repr(step)}"
    if "loader" in options:  # each data rank reads its rows from the loader; the ranks of a tp group the same
        columns = {k: torch.cat([b[k] for b in data]) for k in data[0]}
        rows = len(next(iter(data[0].values())))
        loader = af.data.DataLoader(columns, batch_size=rows // mesh.data_size, mesh=mesh)
        local = list(loader)
        assert len(local) == len(data)
        mine = [v for b in local for v in b.values()]
        everyone = [torch.empty_like(mine[0]) for _ in range(mesh.world_size)]
        dist.all_gather(everyone, mine[0].contiguous())  # same rows within a tp group, others across dp
        tp = mesh.axis_size("tp")
        for r in range(mesh.world_size):
            assert torch.equal(everyone[r], everyone[r - r % tp]), "tp ranks of one data rank read other rows"
        data = local
    seen = []
    if sp:  # the residual stream between the layers really is split over the sequence
        step.model.model.layers[0].register_forward_hook(
            lambda mod, args, out: seen.append(
                getattr(out[0] if isinstance(out, tuple) else out, "placements", None)
            )
        )
    runs = []  # remat + compile: the compiled block forward runs inside the checkpoint, again in the backward
    if per_block and "remat" in options:
        inner = step.model.model.layers[0]._accelfn_remat_inner
        compiled_forward = inner[0]
        inner[0] = lambda *a, **k: (runs.append(torch.is_grad_enabled()), compiled_forward(*a, **k))[1]
    losses, norms = [], []
    for b in data:
        state, m = step(state, b)
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    if runs:  # each step: the forward, then the recomputation in the backward
        assert len(runs) == 2 * len(data) * (2 if "accumulate" in options else 1), runs
    if sp:
        from torch.distributed.tensor import Shard

        assert seen and all(p == (Shard(1),) for p in seen), seen
    diff = max((full(v) - ref.params[k]).abs().max().item() for k, v in state.params.items())
    assert sorted(state.params) == sorted(ref.params), (sorted(state.params), sorted(ref.params))
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    tol = 2e-5
    if "bf16" in options:  # bf16 matmuls summed in another order: close, not equal
        tol, norm_diff = 1e-2, norm_diff / 100
    ptol = None
    if fp8 and (mesh.data_size > 1 or "accumulate" in options):  # fp8 scales follow each rank's own rows, so
        # the run tracks the one-process fp8 run (losses within 2e-3, norms within 1%) rather than equals it;
        # AdamW's first steps move tiny-gradient weights by ~lr either way, so params get 10 x lr
        tol, norm_diff, ptol = 2e-3, norm_diff / 1000, 1e-2
    assert loss_diff <= tol, f"rank {mesh.rank}: losses {losses} vs one process {ref_losses}"
    assert norm_diff <= 1e-5, f"rank {mesh.rank}: grad norms {norms} vs one process {ref_norms}"
    assert diff <= (ptol or tol), f"rank {mesh.rank}: params differ from one process by {diff}"
    if kind != "mlp":  # an eval step on the tensor-parallel module gives the one-process logits
        evaluate = af.eval_step(lambda model, b: model(input_ids=b["input_ids"]).logits)
        evaluate.init(step.model)
        got = evaluate(state, batches(kind)[0])
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        want = af.eval_step(lambda model, b: model(input_ids=b["input_ids"]).logits)
        want.init(ref_step.model)
        ref_logits = want(ref, batches(kind)[0])
        eval_diff = (got.float() - ref_logits.float()).abs().max().item()
        limit = 1e-1 if ptol else 5e-2 if "bf16" in options else 1e-4  # fp8 x dp: params track, not equal
        assert eval_diff <= limit, f"rank {mesh.rank}: eval logits differ by {eval_diff}"
    if kind == "starcoder2":  # tied embeddings stay one parameter
        model = step.model
        assert model.lm_head.weight is model.model.embed_tokens.weight
    for opt_ in options:
        if opt_.startswith("save="):
            af.checkpoint.save(opt_[5:], state)
            af.checkpoint.save_pretrained(opt_[5:] + "-hf", state, config=step.model.config)
            af.checkpoint.save_pretrained(
                opt_[5:] + "-ref", ref, config=ref_step.model.config
            )  # every rank joins
    print(f"rank {mesh.rank}: OK {kind} {sorted(o for o in options if not o.startswith('save='))} "
          f"param diff {diff:.1e} loss diff {loss_diff:.1e} {split[:1]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    # "env": the mesh `accelfn launch --mesh dp=2,tp=2` set (ACCELFN_MESH)
    shape = None if sys.argv[1] == "env" else parse_mesh(sys.argv[1])
    with af.Mesh.from_env() if shape is None else af.Mesh(shape, device="cpu") as mesh:
        for kind, *options in CONFIGS:
            check(mesh, kind, options)
        if not mesh.data_axes:  # tensor parallel alone: fsdp has no data axis to shard over
            try:
                af.shard(af.train_step(loss_for("mlp"), af.optim.sgd(0.1)), mesh, strategy="fsdp")
            except ValueError as e:
                assert "shards over a data axis (dp or fsdp), but the mesh has only ('tp',)" in str(e), e
                print(f"rank {mesh.rank}: OK fsdp without a data axis refused", flush=True)
        dist.barrier()
        world = mesh.world_size
    if world == 4:
        # context parallel with tensor parallel composes (tests/test_context_parallel.py trains it)
        with af.Mesh({"cp": 2, "tp": 2}, device="cpu") as mesh:
            step = af.shard(af.train_step(loss_for("mlp"), af.optim.sgd(0.1)), mesh)
            assert "context_parallel(cp=2)" in repr(step) and "tensor_parallel(tp=2)" in repr(step), repr(
                step
            )
            print(f"rank {mesh.rank}: OK cp with tp", flush=True)
