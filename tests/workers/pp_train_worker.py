"""Worker: pipeline-parallel training == one process on the global batch (run by tests/test_pipeline.py).

    accelfn launch --nproc-per-node 2 --cpu tests/workers/pp_train_worker.py pp=2 llama:1f1b gpt2:gpipe

The first argument is the mesh; each further one is `model[:option...]`: model in llama (4 decoder layers),
gpt2 (4 blocks, head tied to the embedding); options: a schedule name (default 1f1b), ddp / fsdp / hsdp
(af.shard over the data axes), remat, accumulate (af.accumulate(step, 2) on top), tp (the mesh's tp axis), split
(explicit split points), bf16 (af.autocast), fp8 (af.autocast_fp8, torchao emulated), compile (af.compile(step,
backend='aot_eager'): per block under the pipeline; the reference eager), dropout (dropout 0.1 everywhere: the reference is one process under
af.accumulate(step, m), which draws per micro-batch), each (af.pipeline(..., sync_each_microbatch=True): fsdp/hsdp
reduce-scatter each micro-batch's gradients), m=<micro-batches>, pretrained=<folder> (save_pretrained of the final state), save=<folder> (save the final state), load=<folder> (start from it), resume=<folder> (save, go
on, reload and redo: bit-identical).
Each rank checks its stage's params, and every step's loss and grad norm, against one process.
"""

import sys

import torch

import accelfn as af
from accelfn.launch_env import parse_mesh
from accelfn.transforms.pipeline import SCHEDULES

VOCAB = 64


def make_model(kind, p=0.0):
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=False, attention_dropout=p)  # fmt: skip
        return LlamaForCausalLM(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=p,
                     embd_pdrop=p, attn_pdrop=p, tie_word_embeddings=True)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def batches(n=3, rows=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (rows, 12), generator=g)
        labels = ids.clone()
        for r in range(rows):  # uneven valid-token counts per row, so per micro-batch
            labels[r, (r * 3) % 11 + 1 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def aligned_loss(model, b):
    # context parallel splits the sequence: labels come aligned with the inputs (shifted in the batch)
    loss = af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits, b["labels"])
    return loss, {"tokens": loss.count.float()}


def aligned(b):
    labels = torch.full_like(b["labels"], -100)
    labels[:, :-1] = b["labels"][:, 1:]
    return {"input_ids": b["input_ids"], "labels": labels}


def lm_loss(model, b):
    logits = model(input_ids=b["input_ids"]).logits
    loss = af.losses.cross_entropy(logits[:, :-1], b["labels"][:, 1:])
    return loss, {"tokens": loss.count.float()}


def wrapped(step, options, piped=False):
    """The combinators of `options`, the same for the pipeline and its one-process reference (which runs compile's
    options eagerly: the compiled pipeline is held to the eager step)."""
    if "fp8" in options:
        step = af.autocast_fp8(step, backend="torchao", emulate=True)
    if "bf16" in options:
        step = af.autocast(step, "bf16")
    if "remat" in options:
        step = af.remat(step, "full")
    if "compile" in options and piped:  # af.compile as a user writes it: per block under the pipeline
        step = af.compile(step, backend="aot_eager")
    return step


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class ReduceScatters:
    """Counts FSDP2's gradient reduce-scatters while entered (torch's collective it calls, by name at call time)."""

    def __enter__(self):
        import torch.distributed as dist

        self.name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n))
        self.real, self.count = getattr(dist, self.name), 0

        def counted(*args, **kwargs):
            self.count += 1
            return self.real(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        setattr(dist, self.name, self.real)


def check(mesh, kind, options):
    data = batches()
    loss_fn = lm_loss
    if "cp" in mesh.axis_names:
        data, loss_fn = [aligned(b) for b in data], aligned_loss
    opt = lambda: af.optim.adamw(1e-3, weight_decay=0.1)  # noqa: E731
    schedule = next((o for o in options if o in SCHEDULES), "1f1b")
    m = int(next((o[2:] for o in options if o.startswith("m=")), "4"))
    load = next((o[5:] for o in options if o.startswith("load=")), None)

    p = 0.1 if "dropout" in options else 0.0
    ref_step = af.train_step(loss_fn, opt(), clip_grad_norm=0.5)
    # dropout masks, and bf16 / fp8 rounding, depend on the micro-batches: the reference runs the same ones
    same_micro = bool(p) or "bf16" in options or "fp8" in options
    if same_micro:
        ref_step = af.accumulate(ref_step, m)
    ref_step = wrapped(ref_step, options)
    ref = ref_step.init(make_model(kind, p), seed=3)
    if load:
        ref = af.checkpoint.load(load + "-ref", like=ref)
    ref_losses, ref_norms, ref_tokens = [], [], []
    for b in data:
        ref, met = ref_step(ref, b)
        ref_losses.append(met["loss"].item())
        ref_norms.append(met["grad_norm"].item())
        ref_tokens.append(met["tokens"].item())

    step = af.train_step(loss_fn, opt(), clip_grad_norm=0.5)
    micro = m
    if "accumulate" in options:
        step = af.accumulate(step, 2)
        micro = m // 2
    step = wrapped(step, options, piped="pp" in mesh.axis_names)
    split = ["model.layers.1"] if "split" in options and kind == "llama" else None
    piped = "pp" in mesh.axis_names  # without a pp axis: plain af.shard, to move checkpoints across
    if piped:
        step = af.pipeline(step, mesh, microbatches=micro, schedule=schedule, split_points=split,
                           stages_per_rank=1 if split else None, sync_each_microbatch="each" in options)  # fmt: skip
    strategy = next((o for o in ("hsdp", "fsdp", "ddp") if o in options), None)
    if strategy or "tp" in mesh.axis_names or "cp" in mesh.axis_names:
        strategy = strategy or "ddp"
        step = af.shard(step, mesh, strategy=strategy, inputs="global")
    else:
        assert mesh.data_size == 1
    state = step.init(make_model(kind, p), seed=3)
    if load:
        state = af.checkpoint.load(load, like=state)
    assert ("pipeline" in str(step)) == piped, str(step)
    assert ("each" in options) == ("gradients reduce-scattered each" in str(step)), str(step)
    assert ("compile" in options and piped) == ("compile per block under a pipeline" in str(step)), str(step)
    if (
        "tp" in mesh.axis_names and kind == "llama" and "fp8" not in options
    ):  # torchtitan's stages: sequence parallel
        assert "sequence parallel between" in str(step) and "loss on vocabulary shards" in str(step), str(
            step
        )
    losses, norms, tokens = [], [], []
    with ReduceScatters() as reduce_scatters:
        for b in data:
            state, met = step(state, b)
            losses.append(met["loss"].item())
            norms.append(met["grad_norm"].item())
            tokens.append(met["tokens"].item())
    # reducing each micro-batch: every FSDP2 unit of the stage reduce-scatters once per micro-batch, none after
    if "each" in options:
        from accelfn.transforms.shard.fsdp import _param_groups

        units = sum(1 for g in _param_groups(step.model) if g.fsdp_params)
        want = len(data) * m * units
        assert reduce_scatters.count == want, (
            f"{reduce_scatters.count} reduce-scatters, not {want} ({units} units)"
        )
    assert len(state.params) < len(ref.params) or not piped, "a stage holds the whole model"
    diff = max((full(v) - ref.params[k]).abs().max().item() for k, v in state.params.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    # aux metrics are averaged over micro-batches (as under af.accumulate): m of them here
    # (the reference averages over its m too)
    per_ref = m * mesh.grad_size if piped and not same_micro else mesh.grad_size
    tok_diff = max(abs(a * per_ref - b) for a, b in zip(tokens, ref_tokens))  # and ranks
    where = f"rank {mesh.rank} {kind}:{':'.join(options)}"
    assert loss_diff <= 2e-5, f"{where}: losses {losses} vs one process {ref_losses}"
    assert norm_diff <= 1e-5, f"{where}: grad norms {norms} vs one process {ref_norms}"
    assert tok_diff <= 1e-3, f"{where}: tokens {tokens} vs one process {ref_tokens}"
    assert diff <= 2e-5, f"{where}: params differ from one process by {diff}"
    for o in options:
        if o.startswith("resume="):  # save mid-run, go on; load and redo the same steps: bit-identical
            af.checkpoint.save(o[7:], state)
            more = batches(n=2)
            went_on = state
            for b in more:
                went_on, _ = step(went_on, b)
            again = af.checkpoint.load(o[7:], like=went_on)
            for b in more:
                again, _ = step(again, b)
            for k, v in went_on.params.items():
                assert torch.equal(full(v), full(again.params[k])), f"{where}: resumed {k} differs"
            state = again
        if o.startswith("pretrained="):  # the Hugging Face folder of the whole model, from every stage
            af.checkpoint.save_pretrained(o[11:], state, model=step.model)
        if o.startswith("save="):
            af.checkpoint.save(o[5:], state)
            af.checkpoint.save(o[5:] + "-ref", ref)  # the same on every rank: written once
    print(f"{where}: PP OK loss diff {loss_diff:.1e} param diff {diff:.1e}", flush=True)


def main():
    shape = parse_mesh(sys.argv[1])
    with af.Mesh(shape, device="cpu") as mesh:
        for config in sys.argv[2:]:
            kind, *options = config.split(":")
            check(mesh, kind, options)


if __name__ == "__main__":
    main()
