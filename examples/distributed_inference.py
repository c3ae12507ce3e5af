"""Distributed inference: each process answers its share of the prompts; the main process gathers them all
and checks them against a single-process run.

    accelfn launch --nproc-per-node 2 --cpu examples/distributed_inference.py
    python examples/distributed_inference.py                                   # one process

`af.dist.split_between_processes` hands each process a contiguous share of the prompts (the first ranks
one more when they do not divide evenly), each process decodes greedily with a tiny GPT-2 (the same
weights everywhere: a real job loads a checkpoint), and `af.dist.gather_object` collects the answers in
rank order, which is prompt order. The main process then decodes every prompt itself and checks that the
answers are the same (exit code 1 if not).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import accelfn as af

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16], [17, 18], [19, 20, 21]]


@torch.no_grad()
def complete(model, prompt: list[int], device: torch.device, new_tokens: int = 4) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    for _ in range(new_tokens):  # greedy decoding
        next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0].tolist()


def main() -> None:
    with af.Mesh.from_env() as mesh:
        torch.manual_seed(0)  # the same weights on every rank
        cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        model = GPT2LMHeadModel(cfg).to(mesh.device).eval()
        with af.dist.split_between_processes(PROMPTS) as mine:
            completions = [complete(model, p, mesh.device) for p in mine]
            print(f"rank {mesh.rank}: answered {len(mine)} prompt(s)", flush=True)
        gathered = af.dist.gather_object(completions)
        everything = [c for part in gathered for c in part]  # rank order = prompt order
        ok = True
        if mesh.is_main:
            print(f"{len(everything)} completions from {mesh.world_size} process(es):")
            for c in everything:
                print(" ", c)
            single = [complete(model, p, mesh.device) for p in PROMPTS]  # the single-process answer
            ok = everything == single
            print("CHECK gathered answers equal a single-process run:", "OK" if ok else "FAILED")
        ok = af.dist.broadcast_object(ok, src=0)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
