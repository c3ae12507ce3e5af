"""Distributed inference: each process answers its share of the prompts; rank 0 prints them all.

Run: `accelfn launch --nproc-per-node 2 --cpu examples/distributed_inference.py`
(or plain `python examples/distributed_inference.py` for one process).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import accelfn as af

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16], [17, 18]]


def main() -> None:
    with af.Mesh.from_env() as mesh:
        torch.manual_seed(0)  # the same weights on every rank (a real job loads a checkpoint)
        cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        model = GPT2LMHeadModel(cfg).to(mesh.device).eval()
        completions = []
        with af.dist.split_between_processes(PROMPTS) as mine, torch.no_grad():
            for prompt in mine:
                ids = torch.tensor([prompt], device=mesh.device)
                for _ in range(4):  # greedy decoding, 4 new tokens
                    next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                    ids = torch.cat([ids, next_id], dim=1)
                completions.append(ids[0].tolist())
        gathered = af.dist.gather_object(completions)
        everything = [c for part in gathered for c in part]  # rank order = prompt order
        if mesh.is_main:
            print(f"{len(everything)} completions")
            for c in everything:
                print(c)


if __name__ == "__main__":
    main()
