"""Worker: a BERT masked LM pipelined over 2 processes == one process on the same batches (run by
tests/test_blocks_hf.py).

    accelfn launch --nproc-per-node 2 --cpu tests/workers/pp_bert_worker.py

Stage 0 holds the embeddings and encoder layers 0-1, stage 1 layers 2-3 and the masked-LM head (whose decoder is
tied to the word embeddings); each rank checks every step's loss and grad norm and its stage's params against one
process running af.train_step on the whole model.
"""

import torch

import accelfn as af

VOCAB = 64


def make_model():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForMaskedLM(cfg)


def batches(n=2, rows=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(4, VOCAB, (rows, 12), generator=g)
        masked = torch.rand(rows, 12, generator=g) < 0.3
        masked[:, 0] = True  # every row (so every micro-batch) has a masked token
        out.append({"input_ids": ids.masked_fill(masked, 3), "labels": ids.masked_fill(~masked, -100)})
    return out


def masked_loss(model, b):
    return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits, b["labels"])


def run(step, model, data):
    state = step.init(model, seed=3)
    losses, norms = [], []
    for b in data:
        state, met = step(state, b)
        losses.append(met["loss"].item())
        norms.append(met["grad_norm"].item())
    return state, losses, norms


def main():
    data = batches()
    opt = lambda: af.optim.adamw(1e-3, weight_decay=0.1)  # noqa: E731
    ref, ref_losses, ref_norms = run(
        af.train_step(masked_loss, opt(), clip_grad_norm=0.5), make_model(), data
    )
    with af.Mesh({"pp": 2}, device="cpu") as mesh:
        step = af.pipeline(af.train_step(masked_loss, opt(), clip_grad_norm=0.5), mesh, microbatches=2)
        state, losses, norms = run(step, make_model(), data)
        where = f"rank {mesh.rank}"
        assert len(state.params) < len(ref.params), f"{where}: a stage holds the whole model"
        first = (
            "bert.embeddings.position_embeddings.weight" in state.params
        )  # the word embeddings: both (tied)
        assert first == (mesh.rank == 0), f"{where}: embeddings on the wrong stage: {sorted(state.params)}"
        assert "bert.embeddings.word_embeddings.weight" in state.params, f"{where}: no tied word embeddings"
        layers = sorted({k.split(".")[3] for k in state.params if k.startswith("bert.encoder.layer.")})
        assert layers == (["0", "1"] if mesh.rank == 0 else ["2", "3"]), f"{where}: encoder layers {layers}"
        diff = max((v - ref.params[k]).abs().max().item() for k, v in state.params.items())
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        assert loss_diff <= 2e-5, f"{where}: losses {losses} vs one process {ref_losses}"
        assert norm_diff <= 1e-5, f"{where}: grad norms {norms} vs one process {ref_norms}"
        assert diff <= 2e-5, f"{where}: params differ from one process by {diff}"
        print(
            f"{where}: BERT PP OK loss diff {loss_diff:.1e} param diff {diff:.1e} losses {losses}", flush=True
        )


if __name__ == "__main__":
    main()
