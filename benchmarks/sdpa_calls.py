"""What `F.scaled_dot_product_attention` receives in transformers' Llama, eager and under torch.compile (issue 30,
docs/dry_run.md "Predicted time against published runs", item 9: is the compiled step's attention masked?).

    python benchmarks/sdpa_calls.py --device cpu                        # tiny Llama, every mode, seconds per mode
    python benchmarks/sdpa_calls.py --device cuda --layers 2 --out runs/sdpa_calls.jsonl   # the 0.9B's shapes

Builds benchmarks/step_kernels.py's `LlamaForCausalLM` (tiny on the CPU; the 0.89B's sizes on cuda, `--layers`
fewer of the same shape), runs one forward and backward under bf16 autocast in each mode (`MODES`), and writes
one JSON line per SDPA call, then a summary line per mode. Two recorders:

- `wrapper`: `F.scaled_dot_product_attention` replaced by a `torch.compiler.disable`d function that records its
  arguments (the mask: None or shape, dtype, and whether it is exactly the causal pattern; `is_causal`,
  `enable_gqa`; q/k/v shapes, strides, contiguity) and calls the original. Under compile this is a graph break
  per call: the graph it records is not the one the step runs (the mask is an input of each piece).
- `graph` (compiled modes): no graph break. A dynamo backend that, for the forward and backward graphs AOT
  autograd hands inductor, records each aten SDPA op (`_scaled_dot_product_{flash,efficient,cudnn}_attention`,
  `_flash_attention_for_cpu`, their backwards, or none where SDPA was decomposed) with its mask argument's
  shape and dtype and `is_causal`, then compiles with inductor and keeps the lines of its output code that call
  an SDPA kernel.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

#: mode -> what it changes in transformers. "eager-mask" keeps the mask eagerly (SDPA as compile calls it);
#: "compile-skipmask-ignore" is the experiment of 2026-11-27 (only `_ignore_causal_mask_sdpa` answers True);
#: "compile-skipmask" also turns off the packed-sequence detection, which under torch.compile always builds a
#: mask; "compile-causal" registers an attention implementation with no mask function (`sdpa_causal`).
MODES = ("eager", "eager-mask", "compile", "compile-skipmask-ignore", "compile-skipmask", "compile-causal")

SDPA_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def llama_config(device: str, layers: int | None = None, attn_implementation: str = "sdpa") -> Any:
    """step_kernels.py's 0.89B Llama on cuda, the same structure (GQA 2:1, SwiGLU) tiny on the CPU."""
    from transformers import LlamaConfig

    if device == "cuda":
        sizes = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers or 16,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)  # fmt: skip
    else:
        sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers or 2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaConfig(**sizes, use_cache=False, attn_implementation=attn_implementation)


@contextlib.contextmanager
def transformers_mode(mode: str) -> Iterator[dict[str, Any]]:
    """Patch transformers for `mode` (one of `MODES`) and undo it after; yields the config's kwargs and call counts.

    >>> with transformers_mode("compile-causal") as m:
    ...     m["attn_implementation"]
    'sdpa_causal'
    """
    import transformers.masking_utils as masking
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    state: dict[str, Any] = {"attn_implementation": "sdpa", "calls": collections.Counter()}
    saved = {
        name: getattr(masking, name) for name in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    }

    def counted(name: str, answer: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            state["calls"][name] += 1  # counted while tracing: once per traced call site
            return answer(*args, **kwargs)

        return patched

    if mode == "eager-mask":
        masking._ignore_causal_mask_sdpa = counted("_ignore_causal_mask_sdpa", lambda *a, **k: False)
    if mode.startswith("compile-skipmask"):
        masking._ignore_causal_mask_sdpa = counted("_ignore_causal_mask_sdpa", lambda *a, **k: True)
    if mode == "compile-skipmask":
        masking.find_packed_sequence_indices = counted("find_packed_sequence_indices", lambda *a, **k: None)
    if mode == "compile-causal":
        # Not a mask function's name: create_causal_mask returns None (its early exit) and sdpa_attention_forward
        # passes is_causal=True with enable_gqa, as transformers does eagerly.
        AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
        state["attn_implementation"] = "sdpa_causal"
    try:
        yield state
    finally:
        for name, fn in saved.items():
            setattr(masking, name, fn)


def mask_facts(mask: torch.Tensor | None, q_len: int, k_len: int) -> dict[str, Any]:
    """The mask's shape and dtype, and whether it keeps exactly the keys at or before each query (causal).

    >>> mask_facts(torch.ones(3, 3, dtype=torch.bool).tril()[None, None], 3, 3)["causal"]
    True
    """
    if mask is None:
        return {"mask": None}
    out: dict[str, Any] = {
        "mask": list(mask.shape),
        "mask_dtype": str(mask.dtype),
        "mask_stride": list(mask.stride()),
    }
    keep = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool:
        out["mask_masked_value"] = float(mask.min())
    tril = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    out["causal"] = bool((keep == tril).all())
    return out


def tensor_facts(name: str, t: torch.Tensor) -> dict[str, Any]:
    return {
        f"{name}_shape": list(t.shape),
        f"{name}_stride": list(t.stride()),
        f"{name}_contiguous": t.is_contiguous(),
        f"{name}_dtype": str(t.dtype),
    }


@contextlib.contextmanager
def record_sdpa_calls(records: list[dict[str, Any]]) -> Iterator[None]:
    """Replace F.scaled_dot_product_attention by a recorder (a graph break under torch.compile)."""
    original = F.scaled_dot_product_attention

    @torch.compiler.disable
    def recorder(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        rec = {"is_causal": bool(is_causal), "enable_gqa": bool(enable_gqa), "dropout_p": dropout_p}
        rec.update(mask_facts(attn_mask, query.shape[-2], key.shape[-2]))
        for n, t in (("q", query), ("k", key), ("v", value)):
            rec.update(tensor_facts(n, t))
        records.append(rec)
        return original(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )

    F.scaled_dot_product_attention = recorder
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _describe(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return {"shape": list(val.shape), "dtype": str(val.dtype), "from": str(arg.target)}
        return str(arg.target)
    if isinstance(arg, (list, tuple)):
        return [_describe(a) for a in arg]
    return arg if isinstance(arg, (int, float, bool, str, type(None))) else str(arg)


def _calls_sdpa(line: str) -> bool:
    called = line.split("=", 1)[1] if "=" in line else ""
    return any(s in called for s in SDPA_OPS) and ("torch.ops." in called or "extern_kernels." in called)


def graph_recording_backend(records: list[dict[str, Any]]) -> Callable[..., Any]:
    """A torch.compile backend: inductor, recording the aten SDPA ops of each graph it compiles and its output code."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        phase = "backward" if kwargs.get("is_backward") else "forward"
        ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        for node in gm.graph.nodes:
            if node.op == "call_function" and any(s in str(node.target) for s in SDPA_OPS):
                schema = getattr(node.target, "_schema", None)
                names = [a.name for a in schema.arguments] if schema is not None else []
                args = {names[i] if i < len(names) else str(i): _describe(a) for i, a in enumerate(node.args)}
                args.update({k: _describe(v) for k, v in node.kwargs.items()})
                records.append({"recorder": "graph", "phase": phase, "op": str(node.target), "args": args})
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        code = getattr(compiled, "source_code", "") or ""
        calls = [ln.split("=", 1)[1].strip() for ln in code.splitlines() if _calls_sdpa(ln)]
        records.append({"recorder": "graph", "phase": phase, "inductor_calls": calls,
                        "softmax_like_ops": {k: v for k, v in ops.items() if "softmax" in k or "bmm" in k}})  # fmt: skip
        return compiled

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # no cache: a graph compiled before (another mode's) would skip `inner`
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def run(
    mode: str,
    device: str,
    recorder: str,
    layers: int | None,
    batch: int,
    seq: int,
    backend: str = "inductor",
    backward: bool = True,
) -> list[dict[str, Any]]:
    """One forward and backward of the Llama in `mode`; the SDPA calls `recorder` sees, one dict each.

    `backend` is the wrapper recorder's torch.compile backend ("eager": dynamo's graphs, no inductor; what
    transformers passes SDPA is decided while dynamo traces).
    """
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    records: list[dict[str, Any]] = []
    with transformers_mode(mode) as state:
        cfg = llama_config(device, layers, state["attn_implementation"])
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(
            device
        )
        if mode.startswith("compile"):
            compiler: Any = graph_recording_backend(records) if recorder == "graph" else backend
            forward = torch.compile(model, backend=compiler)
        else:
            forward = model
        with record_sdpa_calls(records) if recorder == "wrapper" else contextlib.nullcontext():
            with torch.autocast(
                device, dtype=torch.bfloat16, enabled=device == "cuda"
            ):  # the CPU's SDPA: fp32
                logits = forward(input_ids=ids).logits
            if backward:
                F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        patched = dict(state["calls"])
    for r in records:
        r.setdefault("recorder", recorder)
        r.update(mode=mode, device=device, patched_calls=patched)
    return records


def _graph_mask(args: dict[str, Any]) -> str:
    mask = args.get("attn_mask", args.get("attn_bias"))
    shown = f"{mask['shape']} {mask['dtype']}" if isinstance(mask, dict) else mask
    return f"mask={shown} is_causal={args.get('is_causal', False)}"


def summary(mode: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [r for r in records if r["recorder"] == "wrapper"]
    ops = [r for r in records if "op" in r]
    return {
        "summary": mode,
        "wrapper_calls": len(calls),
        "masked": sum(r["mask"] is not None for r in calls),
        "masks": sorted({f"{r['mask']} {r.get('mask_dtype')} causal={r.get('causal')}" for r in calls}),
        "is_causal": sum(r["is_causal"] for r in calls),
        "enable_gqa": sum(r["enable_gqa"] for r in calls),
        "graph_ops": dict(
            collections.Counter(f"{r['phase']} {r['op']} {_graph_mask(r['args'])}" for r in ops)
        ),
        "inductor_calls": sorted({c.split("(")[0] for r in records for c in r.get("inductor_calls", [])}),
        "patched_calls": {f"{r['recorder']}: {k}": v for r in records for k, v in r["patched_calls"].items()},
        "note": "wrapper under compile: a torch.compiler.disable'd recorder, one graph break per SDPA call"
        if calls and mode.startswith("compile")
        else "",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--recorders", default="wrapper,graph", help="wrapper, graph (compiled modes only), or both"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 16 on cuda, 2 on the CPU)"
    )
    p.add_argument("--batch", type=int, default=None, help="default: 8 on cuda, 2 on the CPU")
    p.add_argument("--seq", type=int, default=None, help="default: 2048 on cuda, 16 on the CPU")
    p.add_argument("--out", default=None, help="also write the JSON lines here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    batch, seq = args.batch or (8 if cuda else 2), args.seq or (2048 if cuda else 16)
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    import transformers

    head = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
            "batch": batch, "seq": seq}  # fmt: skip
    lines = [head]
    for mode in args.modes.split(","):
        records: list[dict[str, Any]] = []
        for rec in args.recorders.split(","):
            if rec == "graph" and not mode.startswith("compile"):
                continue
            records += run(mode, args.device, rec, args.layers, batch, seq)
        lines += [*records, summary(mode, records)]
        for line in lines:
            text = json.dumps(line)
            print(text, flush=True)
            if out:
                out.write(text + "\n")
        lines = []
    if out:
        out.close()


if __name__ == "__main__":
    sys.exit(main())
