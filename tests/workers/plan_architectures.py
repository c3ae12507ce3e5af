"""A user's training script for `transformers` models of several architectures (randomly initialised from a
config, no weights downloaded), leaving its configuration to the launch config (what `accelfn plan` chooses):
the mesh from `af.Mesh.from_env()` (a `pp` axis: `af.pipeline`), strategy / remat / accumulate / global batch /
offload / compile and the pipeline's schedule and micro-batches as "auto" knobs unless a flag fixes them
(tests/test_plan_architectures.py).

`--model`: qwen2, qwen3, mistral (sliding window), gemma2 / gemma3 (sliding and full attention alternating), phi3
(fused qkv and gate-up projections), gpt2 (Conv1D layers, tied embeddings), opt, neox (GPT-NeoX: parallel
attention and MLP), bert (an encoder trained as a masked LM) or llama1 (a Llama of one layer). `--size tiny`
(hidden 64, `--layers` blocks, default 4) or `base` (hidden 768, 12 heads, on the meta device).

    python tests/workers/plan_architectures.py --model gpt2 --steps 2
    accelfn dry-run --nproc-per-node 8 --gpu h100-sxm tests/workers/plan_architectures.py --model gemma2
    accelfn plan --nproc-per-node 8 --gpu h100-sxm --budget-minutes 1 tests/workers/plan_architectures.py --model bert
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

import accelfn as af
from accelfn.launch_env import knob

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plan_knobs, beside this script
import plan_knobs  # noqa: E402

MODELS = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2", "opt", "neox", "bert", "llama1")
SIZES = {"tiny": (64, 4, 512), "base": (768, 12, 32000)}  # hidden, heads, vocabulary


def build(name: str, hidden: int, heads: int, layers: int, vocab: int, seq_len: int) -> torch.nn.Module:
    """The `transformers` model `name` with these widths (the MLP 4 x hidden; grouped-query attention with half
    the heads as key/value heads where the architecture has it), positions for `seq_len` tokens."""
    import transformers as tf

    common = dict(vocab_size=vocab, use_cache=False, attn_implementation="sdpa")
    decoder = dict(common, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                   max_position_embeddings=seq_len)  # fmt: skip
    window = max(2, seq_len // 4)
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**decoder))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**decoder, head_dim=hidden // heads))
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**decoder, sliding_window=window))
    if name == "gemma2":  # every other layer sliding (Gemma-2's alternation), tied embeddings; its attention
        # soft-capping has no SDPA path in transformers: eager attention, as its model card says
        cfg = tf.Gemma2Config(**{**decoder, "attn_implementation": "eager"}, head_dim=hidden // heads,
                              sliding_window=window)  # fmt: skip
        return tf.Gemma2ForCausalLM(cfg)
    if name == "gemma3":  # 5 sliding layers then a full one (Gemma-3's pattern)
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        cfg = tf.Gemma3TextConfig(
            **decoder, head_dim=hidden // heads, sliding_window=window, layer_types=types
        )
        return tf.Gemma3ForCausalLM(cfg)
    if name == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**decoder, pad_token_id=0))
    if name == "llama1":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{**decoder, "num_hidden_layers": 1}))
    if name == "gpt2":
        cfg = tf.GPT2Config(**common, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq_len)
        return tf.GPT2LMHeadModel(cfg)
    if name == "opt":
        cfg = tf.OPTConfig(**common, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, max_position_embeddings=seq_len,
                           word_embed_proj_dim=hidden)  # fmt: skip
        return tf.OPTForCausalLM(cfg)
    if name == "neox":
        cfg = tf.GPTNeoXConfig(**common, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, max_position_embeddings=seq_len)  # fmt: skip
        return tf.GPTNeoXForCausalLM(cfg)
    if name == "bert":
        cfg = tf.BertConfig(**common, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, max_position_embeddings=seq_len)  # fmt: skip
        return tf.BertForMaskedLM(cfg)
    raise SystemExit(f"--model {name!r}: one of {', '.join(MODELS)}")


MASK_ID = 3  # the masked-LM's [MASK] token (any id: the model is random)


def causal_loss(model: torch.nn.Module, ids: torch.Tensor) -> af.Loss:
    """Next-token cross entropy over `ids` of `seq_len` + 1 tokens (the model reads the first `seq_len`)."""
    return af.losses.cross_entropy(model(input_ids=ids[:, :-1]).logits, ids[:, 1:])


def masked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> af.Loss:
    """BERT's masked-LM loss: the masked positions' original tokens (the others' labels are -100)."""
    return af.losses.cross_entropy(model(input_ids=batch["input_ids"]).logits, batch["labels"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="qwen2")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="blocks (default 4 tiny, 12 base; llama1: 1)")
    p.add_argument("--seq-len", type=int, default=64)
    plan_knobs.add_flags(p)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    knobs = plan_knobs.read(args, strategy="fsdp", global_batch=2 * mesh.data_size)
    global_batch = knobs.global_batch
    schedule = knob("pipeline_schedule", "auto", "1f1b")
    microbatches = knob("pipeline_microbatches", "auto", None)
    pp = mesh.axis_size("pp") if "pp" in mesh.axis_names else 1
    if global_batch % mesh.data_size:
        raise SystemExit(
            f"global batch {global_batch} does not split over {mesh.data_size} data-parallel ranks"
        )
    batch = global_batch // mesh.data_size

    hidden, heads, vocab = SIZES[args.size]
    layers = args.layers or (4 if args.size == "tiny" else 12)
    torch.manual_seed(0)
    with af.init_empty() if args.size != "tiny" else contextlib.nullcontext():
        model = build(args.model, hidden, heads, layers, vocab, args.seq_len)

    masked = args.model == "bert"
    step = af.train_step(masked_loss if masked else causal_loss, af.optim.adamw(1e-3, weight_decay=0.0))
    pipeline = None
    if pp > 1:  # every rank of a pipeline reads the same batch, one sequence per micro-batch by default
        n = int(microbatches or batch // knobs.accumulate)
        pipeline = lambda step: af.pipeline(step, mesh, microbatches=n, schedule=schedule)  # noqa: E731
    step = plan_knobs.apply(step, knobs, mesh, pipeline=pipeline)
    state = step.init(model)
    af.dist.print(step)

    gen = torch.Generator().manual_seed(mesh.data_rank)
    for i in range(args.steps):
        ids = torch.randint(4, vocab, (batch, args.seq_len + (0 if masked else 1)), generator=gen)
        if masked:  # 15% of the positions masked, the loss on them only
            chosen = torch.rand(ids.shape, generator=gen) < 0.15
            data: torch.Tensor | dict[str, torch.Tensor] = {
                "input_ids": torch.where(chosen, MASK_ID, ids),
                "labels": torch.where(chosen, ids, -100),
            }
        else:
            data = ids
        state, metrics = step(state, data)
        af.dist.print(f"step {i + 1} loss {metrics['loss'].item():.6f}")


if __name__ == "__main__":
    main()
