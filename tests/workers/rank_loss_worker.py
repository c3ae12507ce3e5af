"""Worker: `metrics["rank_loss"]` is each rank's loss on its own rows, `metrics["loss"]` the global one, under ddp
and fsdp (run by tests/test_shard.py)."""

import copy

import torch

import accelfn as af


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}
    batch["y"][5:] = -100  # uneven valid counts: rank 1 has fewer labelled rows

    def loss_fn(m, b):
        return af.losses.cross_entropy(m(b["x"]), b["y"])

    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        n, r = mesh.data_size, mesh.data_rank
        rows = slice(r * 8 // n, (r + 1) * 8 // n)
        for strategy in ("ddp", "fsdp"):
            reference = copy.deepcopy(model)
            with torch.no_grad():
                mine = loss_fn(reference, {k: v[rows] for k, v in batch.items()})
                everyone = loss_fn(reference, batch)
            step = af.shard(
                af.train_step(loss_fn, af.optim.sgd(0.1)), mesh, strategy=strategy, inputs="global"
            )
            state = step.init(copy.deepcopy(model))
            state, metrics = step(state, batch)
            torch.testing.assert_close(metrics["rank_loss"], mine.total / mine.count)
            torch.testing.assert_close(metrics["loss"], everyone.total / everyone.count)
            print(f"rank {mesh.rank} {strategy}: RANK LOSS OK {metrics['rank_loss'].item():.4f}", flush=True)


if __name__ == "__main__":
    main()
