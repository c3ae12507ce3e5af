"""2-stage pipeline inference over gloo equals the single-process forward (run by tests/test_big.py)."""

import torch
from torch import nn

import accelfn as af


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 3)
    ).eval()
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = model(x)
    with af.Mesh({"pp": 2}) as mesh:
        run = af.pipeline(model, ["2"], mesh, example_args=(x,), microbatches=4)
        out = run(x)
        assert torch.allclose(out, expected, atol=1e-6), (out - expected).abs().max()
        run_last = af.pipeline(model, ["2"], mesh, example_args=(x,), microbatches=2, broadcast=False)
        out2 = run_last(x)
        if mesh.rank == 1:
            assert torch.allclose(out2, expected, atol=1e-6)
        else:
            assert out2 is None
        print(f"rank {mesh.rank}: PIPELINE OK max diff {(out - expected).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
