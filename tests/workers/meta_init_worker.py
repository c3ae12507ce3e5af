"""Models built on the meta device, sharded and materialised by `step.init` on 2 processes, against the same
model materialised in one process (for tests/test_materialize.py).

- `mlp fsdp` / `mlp tp` / `llama pp`: every parameter (gathered; a pipeline stage: its own) equals one process's
  `materialize` with the same seed, bitwise (the values do not depend on the parallelism), and the tied,
  replicated or sharded copies agree across the ranks;
- `llama load`: a tiny transformers Llama on the meta device under fsdp, filled with
  `af.checkpoint.load_pretrained(like=state.params)` from a host model's weights, trained 3 steps: the losses
  match one process training the host model on the global batch (fp32 round-off).

Each rank prints `rank R: OK <config>`.
"""

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import accelfn as af
from accelfn.materialize import materialize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_llama import build, loss_fn  # noqa: E402

rank = int(__import__("os").environ["RANK"])


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8)
    )


def mse(m: torch.nn.Module, b: torch.Tensor) -> af.Loss:
    return af.losses.mse(m(b), b[:, :8])


def sharded(mesh: af.Mesh, strategy: str, tp: bool) -> af.Step:
    step = af.train_step(mse, af.optim.adamw(1e-2))
    plan = {"0": "colwise", "2": "rowwise"} if tp else None
    return (
        af.shard(step, mesh, strategy=strategy, tp_plan=plan)
        if tp
        else af.shard(step, mesh, strategy=strategy)
    )


def one_process(build: object, seed: int) -> dict[str, torch.Tensor]:
    """The model materialised in this process alone (no sharding), from `seed`."""
    with af.init_empty():
        model = build()  # type: ignore[operator]
    materialize(model, torch.device("cpu"), seed)
    return {k: v.detach() for k, v in model.state_dict().items()}


def full(v: torch.Tensor) -> torch.Tensor:
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def check_mlp(axes: dict[str, int], strategy: str, tp: bool, name: str) -> None:
    mesh = af.Mesh(axes, device="cpu")
    with af.init_empty():
        meta = mlp()
    assert all(p.is_meta for p in meta.parameters())
    state = sharded(mesh, strategy, tp).init(meta, seed=3)
    want = one_process(mlp, 3)
    for k, v in state.params.items():
        assert torch.equal(full(v), want[k]), (name, k)
    mesh.close()
    print(f"rank {rank}: OK {name}", flush=True)


def check_llama_pp() -> None:
    mesh = af.Mesh({"pp": 2}, device="cpu")
    with af.init_empty():
        meta = build("tiny", 32)
    step = af.pipeline(af.train_step(loss_fn, af.optim.adamw(1e-3)), mesh, microbatches=2)
    state = step.init(meta, seed=5)
    want = one_process(lambda: build("tiny", 32), 5)
    assert state.params and len(state.params) < len(want)  # this stage's params only
    for k, v in state.params.items():
        assert torch.equal(v, want[k]), k
    state, m = step(state, torch.randint(0, 1024, (4, 33), generator=torch.Generator().manual_seed(0)))
    assert 6.0 < float(m["loss"]) < 8.0  # ln(1024) = 6.9 at a random init
    mesh.close()
    print(f"rank {rank}: OK llama pp", flush=True)


def check_llama_load() -> None:
    mesh = af.Mesh({"dp": -1}, device="cpu")
    torch.manual_seed(0)
    host = build("tiny", 32)
    folder = Path(tempfile.gettempdir()) / f"accelfn-meta-init-{__import__('os').environ['MASTER_PORT']}"
    if rank == 0:
        folder.mkdir(exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in host.state_dict().items() if "rotary" not in k},
            folder / "model.safetensors",
        )
    af.dist.barrier()
    with af.init_empty():
        meta = build("tiny", 32)
    step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-3)), mesh, strategy="fsdp")
    state = step.init(meta)
    state = state.replace(params=af.checkpoint.load_pretrained(folder, like=state.params, strict=False))
    ref_step = af.train_step(loss_fn, af.optim.adamw(1e-3))
    ref_state = ref_step.init(host)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 1024, (4, 33), generator=gen)  # the global batch; this rank trains its half
        state, m = step(state, ids[2 * rank : 2 * rank + 2])
        ref_state, m_ref = ref_step(ref_state, ids)
        torch.testing.assert_close(m["loss"], m_ref["loss"], rtol=1e-5, atol=1e-6)
    mesh.close()
    print(f"rank {rank}: OK llama load", flush=True)


for config in sys.argv[1].split(","):
    if config == "mlp fsdp":
        check_mlp({"dp": -1}, "fsdp", False, config)
    elif config == "mlp tp":
        check_mlp({"tp": -1}, "ddp", True, config)
    elif config == "llama pp":
        check_llama_pp()
    elif config == "llama load":
        check_llama_load()
    else:
        raise SystemExit(f"unknown config {config!r}")
