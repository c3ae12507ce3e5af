"""Big-model inference: build the model on the meta device, load its weights into a device map that keeps
part of it in host memory and part on disk, and check the logits against the model run whole.

    python examples/big_model_inference.py

Steps: (1) a reference tiny Llama (random weights, seed 0) is saved with `save_pretrained` in 50 KB
shards plus an index, as a Hugging Face checkpoint; (2) a skeleton of the same model is built under
`af.init_empty()` (parameters on the meta device, no memory); (3) `af.infer_device_map` plans where each
decoder layer goes from a memory budget -- the accelerator if there is one, then the host, then the disk;
the rest of the model is kept on the first device; (4) `af.load_and_dispatch` fills the skeleton from the
shards, leaving the disk part memory-mapped (loaded only while its layer runs); (5) the logits of a batch
of prompts are compared with the reference's. Equal on the CPU; within 1e-4 on an accelerator (other
kernels). Exits non-zero if they differ.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import accelfn as af


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits

    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder, max_shard_size="50KB")  # shards + model.safetensors.index.json
        n_files = len(list(Path(folder).glob("*.safetensors")))

        with af.init_empty():
            model = LlamaForCausalLM(cfg).eval()
        print(
            f"skeleton: {sum(p.numel() for p in model.parameters()):,} parameters on {model.lm_head.weight.device}"
        )

        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        budget = {"cpu": 2 * layer_bytes, "disk": "1GB"}  # the host holds 2 layers, the disk the rest
        if mesh.device.type != "cpu":  # an accelerator: it holds 2 layers too, and runs everything
            budget = {str(mesh.device): 2 * layer_bytes, **budget}
        layers = af.infer_device_map(model.model.layers, max_memory=budget, no_split=["LlamaDecoderLayer"])
        first = next(iter(budget))
        device_map = {
            "model.embed_tokens": first,
            "model.norm": first,
            "model.rotary_emb": first,
            "lm_head": first,
            **{f"model.layers.{k}": v for k, v in layers.items()},
        }
        print("device map:", device_map)
        placed = set(device_map.values())
        model = af.load_and_dispatch(
            model, folder, device_map=device_map, offload_folder=tempfile.mkdtemp(dir=folder)
        )
        print(
            f"loaded {n_files} shard files; layer {args.layers - 1} weight is on "
            f"{model.model.layers[-1].mlp.up_proj.weight.device} between calls"
        )
        with torch.no_grad():
            got = model(input_ids=ids.to(first)).logits.cpu()

    diff = (got - expected).abs().max().item()
    exact = mesh.device.type == "cpu"
    ok = ("disk" in placed and "cpu" in placed) and (torch.equal(got, expected) if exact else diff <= 1e-4)
    print(
        f"logits {tuple(got.shape)}: max |dispatched - reference| = {diff:.2e} ({'must be 0' if exact else '<= 1e-4'})"
    )
    print("CHECK offloaded model matches the reference:", "OK" if ok else "FAILED")
    mesh.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
