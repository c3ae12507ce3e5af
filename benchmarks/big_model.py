"""Big-model inference on CPU with CPU + disk offload under a memory cap: accelfn vs accelerate.

1. A Llama of ~270M parameters (fp32, ~1.1 GB) is built from a config and saved with `save_pretrained` in
   shards to a temporary folder.
2. In a fresh process per library and round: build the skeleton on the meta device, load it with a host
   memory cap (`max_memory={"cpu": CAP}`: the rest stays on disk), then greedy-decode with a KV cache.
   Reported: load time, time per generated token, peak RSS growth over the process's baseline, and whether
   the logits equal those of the fully loaded model.
3. Device-map computation for a 10k-module skeleton: `af.infer_device_map` vs `accelerate.infer_auto_device_map`.

Run: `python benchmarks/big_model.py [--cap 400MB] [--rounds 2] [--new-tokens 8]`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip

RUN = """
import json, os, sys, time
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
lib, folder, cap, new_tokens, offload = sys.argv[1:6]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
cfg = LlamaConfig(**json.loads(os.environ["CONFIG"]))
if lib == "accelfn":
    import accelfn as af
    with af.init_empty():
        model = LlamaForCausalLM(cfg).eval()
else:
    import accelerate
    with accelerate.init_empty_weights():
        model = LlamaForCausalLM(cfg).eval()
before = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t0 = time.perf_counter()
if lib == "accelfn":
    model = af.load_and_dispatch(model, folder, max_memory={"cpu": cap}, offload_folder=offload)
else:
    model = accelerate.load_checkpoint_and_dispatch(model, folder, device_map="auto", max_memory={"cpu": cap},
                                                    offload_folder=offload, no_split_module_classes=["LlamaDecoderLayer"])
load_s = time.perf_counter() - t0
ids = torch.arange(16).unsqueeze(0) % cfg.vocab_size
times, tokens = [], []
with torch.no_grad():
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    first_logits = out.logits[0, -1].clone()
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(int(new_tokens)):
        t = time.perf_counter()
        out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        times.append(time.perf_counter() - t)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
torch.save(first_logits, os.path.join(offload, "..", f"logits-{lib}.pt"))
resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
print(json.dumps({"resident": resident, "load_s": load_s, "token_s": sorted(times)[len(times) // 2], "peak_growth": peak() - before,
                  "tokens": tokens}))
"""


def run(lib: str, folder: str, cap: str, new_tokens: int, work: Path) -> dict:
    offload = work / f"offload-{lib}"
    offload.mkdir(exist_ok=True)
    env = {**os.environ, "CONFIG": json.dumps(CONFIG), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN), lib, folder, cap, str(new_tokens), str(offload)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{lib} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def device_map_times(rounds: int) -> dict[str, float]:
    import torch
    from accelerate import infer_auto_device_map
    from torch import nn

    import accelfn as af

    with af.init_empty():
        model = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64))
                for _ in range(2000)
            ]
        )
    n = sum(1 for _ in model.modules())
    out = {"modules": n}
    best = {"accelfn": float("inf"), "accelerate": float("inf")}
    for _ in range(rounds):
        t = time.perf_counter()
        af.infer_device_map(model, max_memory={"cuda:0": "10MB", "cuda:1": "10MB", "cpu": "20MB"})
        best["accelfn"] = min(best["accelfn"], time.perf_counter() - t)
        t = time.perf_counter()
        infer_auto_device_map(model, max_memory={0: 10**7, 1: 10**7, "cpu": 2 * 10**7})
        best["accelerate"] = min(best["accelerate"], time.perf_counter() - t)
    del torch
    return {**out, **best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", default="400MB", help="host memory cap (max_memory['cpu'])")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="accelfn-big-") as tmp:
        work = Path(tmp)
        folder = work / "llama"
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size="200MB")
        ids = torch.arange(16).unsqueeze(0) % CONFIG["vocab_size"]
        with torch.no_grad():
            reference = model(ids).logits[0, -1]
        del model
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        shards = len(list(folder.glob("*.safetensors")))
        print(
            f"model: Llama, {n_params / 1e6:.0f}M params, {size / 1e9:.2f} GB in {shards} shards; cap {args.cap}"
        )
        results: dict[str, list[dict]] = {"accelfn": [], "accelerate": []}
        for _ in range(args.rounds):
            for lib in results:
                results[lib].append(run(lib, str(folder), args.cap, args.new_tokens, work))
        rows = []
        for lib, rs in results.items():
            logits = torch.load(work / f"logits-{lib}.pt")
            rows.append(
                (lib, min(r["load_s"] for r in rs), min(r["token_s"] for r in rs),
                 max(r["peak_growth"] for r in rs) / 1e6, torch.equal(logits, reference), rs[0]["tokens"],
                 rs[0]["resident"] / 1e6)
            )  # fmt: skip
        dm = device_map_times(args.rounds)
    print(
        "\n| library | weights in RAM MB | load s | s / token | peak RSS growth MB | logits == full model |"
    )
    print("|---|---|---|---|---|---|")
    for lib, load, tok, rss, eq, _, resident in rows:
        print(f"| {lib} | {resident:.0f} | {load:.2f} | {tok:.3f} | {rss:.0f} | {eq} |")
    print(f"\ngenerated tokens equal: {rows[0][5] == rows[1][5]}")
    print(f"\n| device map of {dm['modules']} modules | accelfn s | accelerate s |")
    print("|---|---|---|")
    print(f"| best of {args.rounds} | {dm['accelfn']:.3f} | {dm['accelerate']:.3f} |")


if __name__ == "__main__":
    main()
