"""Worker: context parallel (a `cp` axis, alone or with ddp / fsdp / hsdp over the data axes, or with `tp`) == one process on the
global batch.

    accelfn launch --nproc-per-node 4 --cpu tests/workers/cp_worker.py dp=2,cp=2 llama llama:fsdp

Each config is `model[:option...]`: model in llama (Hugging Face, GQA, RoPE from position_ids), starcoder2
(LayerNorm, biases, tied embeddings), own (a plain model calling SDPA, positions from the batch), bidir (full
attention: not causal); options: accumulate, fsdp, remat, compile (aot_eager), loader (inputs from
af.data.DataLoader: the cp ranks of a data rank read the same rows), eager (the HF model built with
attn_implementation="eager": switched to SDPA), hsdp (replicas over dp, shards over fsdp x cp), nocache (use_cache=False: Hugging Face then reads
position jumps as packed sequences), lora (wrapped by PEFT: the positions reach the model inside),
save=<folder>.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accelfn as af
from accelfn.launch_env import parse_mesh

CONFIGS = [arg.split(":") for arg in sys.argv[2:]]
VOCAB, SEQ, ROWS = 64, 16, 4


class Own(nn.Module):
    """Attention through F.scaled_dot_product_attention; learned positions read from `position_ids`. (No qkv bias:
    the key bias has a zero gradient, whose round-off AdamW would magnify.)"""

    def __init__(self, causal=True, d=32, heads=4):
        super().__init__()
        self.causal, self.heads = causal, heads
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.qkv, self.out, self.head = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d), nn.Linear(d, VOCAB)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])

    def forward(self, ids, position_ids):
        x = self.tok(ids) + self.pos(position_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def make_model(kind, options=()):
    if "lora" in options:  # PEFT's wrapper: its forward takes **kwargs; the positions go to the model inside
        from peft import LoraConfig, get_peft_model

        model = make_model(kind, [o for o in options if o != "lora"])
        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(model, lora)
    torch.manual_seed(0)
    attn = "eager" if "eager" in options else "sdpa"
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=False, use_cache="nocache" not in options)  # fmt: skip
        cfg._attn_implementation = attn
        return LlamaForCausalLM(cfg)
    if kind == "starcoder2":
        from transformers import Starcoder2Config, Starcoder2ForCausalLM

        cfg = Starcoder2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                               residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0,
                               tie_word_embeddings=True)  # fmt: skip
        cfg._attn_implementation = attn
        return Starcoder2ForCausalLM(cfg)
    return Own(causal=kind == "own")


def batches(n=4):
    """Inputs and labels aligned position by position (labels[:, i] is the target of input_ids[:, i])."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        for r in range(ROWS):  # uneven valid-token counts per row and per sequence chunk
            labels[r, (r * 5) % SEQ + 1 :] = -100
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": labels,
                    "position_ids": torch.arange(SEQ).expand(ROWS, SEQ).contiguous()})  # fmt: skip
    return out


def loss_for(kind):
    if kind in ("own", "bidir"):
        return lambda model, b: af.losses.cross_entropy(model(b["input_ids"], b["position_ids"]), b["labels"])
    # a Hugging Face model gets its positions from accelfn (the batch's are not passed)
    return lambda model, b: af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits, b["labels"])


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def check(mesh, kind, options):
    data = batches()
    loss_fn = loss_for(kind)
    opt = lambda: af.optim.adamw(1e-3, weight_decay=0.1)  # noqa: E731
    ref_step = af.train_step(loss_fn, opt(), clip_grad_norm=0.5)
    ref = ref_step.init(make_model(kind, [o for o in options if o == "lora"]), seed=3)
    ref_losses, ref_norms = [], []
    for b in data:
        ref, m = ref_step(ref, b)
        ref_losses.append(m["loss"].item())
        ref_norms.append(m["grad_norm"].item())

    step = af.train_step(loss_fn, opt(), clip_grad_norm=0.5)
    if "accumulate" in options:
        step = af.accumulate(step, 2)
    if "remat" in options:
        step = af.remat(step, "full", blocks=["Linear"] if kind in ("own", "bidir") else None)
    strategy = "hsdp" if "hsdp" in options else "fsdp" if "fsdp" in options else "ddp"
    inputs = "local" if "loader" in options else "global"
    step = af.shard(step, mesh, strategy=strategy, inputs=inputs)
    if "compile" in options:
        step = af.compile(step, backend="aot_eager")
    state = step.init(make_model(kind, options), seed=3)
    assert f"context parallel over cp={mesh.axis_size('cp')}" in repr(step), repr(step)
    # gradients summed over dp x cp
    assert f"{strategy} over {mesh.grad_size} ranks" in repr(step), repr(step)
    if strategy == "hsdp":  # the dense params replicated over dp, sharded over fsdp x cp (one flattened dim)
        shape = tuple(state.params["model.embed_tokens.weight"].device_mesh.shape)
        assert shape == (mesh.axis_size("dp"), mesh.axis_size("fsdp") * mesh.axis_size("cp")), shape
    if "tp" in mesh.axis_names and mesh.axis_size("tp") > 1:  # cp x tp: the model is split over tp as well
        assert f"tensor parallel tp={mesh.axis_size('tp')} on" in repr(step), repr(step)
    if "eager" in options:
        assert "attention switched from 'eager' to 'sdpa'" in repr(step), repr(step)
    if "loader" in options:  # each data rank reads its rows; the cp ranks of one data rank the same ones
        columns = {k: torch.cat([b[k] for b in data]) for k in data[0]}
        loader = af.data.DataLoader(columns, batch_size=ROWS // mesh.data_size, mesh=mesh)
        local = list(loader)
        assert len(local) == len(data)
        mine = local[0]["input_ids"].contiguous()
        everyone = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(everyone, mine)
        cp = mesh.axis_size("cp")
        for r in range(mesh.world_size):
            assert torch.equal(everyone[r], everyone[r - r % cp]), "cp ranks of one data rank read other rows"
        data = local
    losses, norms = [], []
    for b in data:
        state, m = step(state, b)
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    diff = max((full(v) - ref.params[k]).abs().max().item() for k, v in state.params.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    assert loss_diff <= 2e-5, f"rank {mesh.rank}: losses {losses} vs one process {ref_losses}"
    assert norm_diff <= 1e-5, f"rank {mesh.rank}: grad norms {norms} vs one process {ref_norms}"
    worst = max(state.params, key=lambda k: (full(state.params[k]) - ref.params[k]).abs().max().item())
    assert diff <= 2e-5, f"rank {mesh.rank}: params differ from one process by {diff} ({worst})"
    if kind == "starcoder2":
        assert step.model.lm_head.weight is step.model.model.embed_tokens.weight
    for opt_ in options:
        if opt_.startswith("save="):
            af.checkpoint.save(opt_[5:], state)
            af.checkpoint.save(opt_[5:] + "-ref", ref)
    print(f"rank {mesh.rank}: OK {kind} {sorted(o for o in options if not o.startswith('save='))} "
          f"param diff {diff:.1e} loss diff {loss_diff:.1e}", flush=True)  # fmt: skip


def check_errors(mesh):
    """Bad input is refused by name, never a silently different result."""
    loss = loss_for("llama")

    def expect(fn, text):
        try:
            fn()
        except ValueError as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"accepted: {text}")

    b = batches(1)[0]
    cp = mesh.axis_size("cp")
    step = af.shard(af.train_step(loss, af.optim.sgd(0.1)), mesh, inputs="global")
    state = step.init(make_model("llama"))
    odd = {k: v[:, :-2] for k, v in b.items()}  # 14 positions: not a multiple of 2 x cp
    expect(
        lambda: step(state, odd), "batch['input_ids'] has 14 positions along dim 1, not divisible by 2 x cp"
    )
    sliced = af.shard(af.train_step(
        lambda m, b: af.losses.cross_entropy(m(input_ids=b["input_ids"][:, :-1]).logits, b["labels"][:, 1:]),
        af.optim.sgd(0.1)), mesh, inputs="global")  # fmt: skip
    s2 = sliced.init(make_model("llama"))
    expect(lambda: sliced(s2, b), "Give labels aligned with the inputs in the batch")
    masked = af.shard(af.train_step(
        lambda m, b: af.losses.cross_entropy(
            m(input_ids=b["input_ids"], attention_mask=torch.ones_like(b["input_ids"])).logits, b["labels"]),
        af.optim.sgd(0.1)), mesh, inputs="global")  # fmt: skip
    s3 = masked.init(make_model("llama"))
    expect(lambda: masked(s3, b), "the model was called with an attention_mask")
    sdpa_mask = af.shard(af.train_step(  # a model passing SDPA a mask of its own
        lambda m, b: F.scaled_dot_product_attention(*[m(b["input_ids"].float()).unsqueeze(0)] * 3,
                                                    attn_mask=torch.ones(SEQ // cp, SEQ // cp, dtype=torch.bool)).sum(),
        af.optim.sgd(0.1)), mesh, inputs="global")  # fmt: skip
    s5 = sdpa_mask.init(nn.Linear(SEQ // cp, SEQ // cp))
    expect(lambda: sdpa_mask(s5, b), "masks over a split sequence are not supported")
    no_sdpa = af.shard(af.train_step(lambda m, b: m(b["input_ids"].float()).pow(2).mean(), af.optim.sgd(0.1)),
                       mesh, inputs="global")  # fmt: skip
    s4 = no_sdpa.init(nn.Linear(SEQ // mesh.axis_size("cp"), 2))
    expect(lambda: no_sdpa(s4, b), "called no torch.nn.functional.scaled_dot_product_attention")
    expect(lambda: af.shard(af.train_step(loss, af.optim.sgd(0.1)), mesh, backend="deepspeed"),
           "DeepSpeed splits no sequence")  # fmt: skip
    gc = make_model("llama")
    gc.gradient_checkpointing_enable()
    expect(
        lambda: af.shard(af.train_step(loss, af.optim.sgd(0.1)), mesh).init(gc), "use af.remat(step) instead"
    )
    print(f"rank {mesh.rank}: OK errors", flush=True)


if __name__ == "__main__":
    shape = None if sys.argv[1] == "env" else parse_mesh(sys.argv[1])
    with af.Mesh.from_env() if shape is None else af.Mesh(shape, device="cpu") as mesh:
        for kind, *options in CONFIGS:
            if kind == "errors":
                check_errors(mesh)
            else:
                check(mesh, kind, options)
