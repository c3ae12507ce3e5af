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
        try:  # a short last batch: refused on every rank before any stage sends or waits
            run(x[:2])
            raise AssertionError("a batch of another shape ran")
        except ValueError as e:
            assert (
                "run() got inputs of (shape, dtype) [((2, 16), 'torch.float32')], but the pipeline was traced"
                in str(e)
            ), e
        try:  # the same shape in another dtype: the stages' buffers were sized for float32
            run(x.double())
            raise AssertionError("a batch of another dtype ran")
        except ValueError as e:
            assert "[((8, 16), 'torch.float64')]" in str(e) and "float32" in str(e), e
        out = run(x)  # the pipeline still runs
        assert torch.allclose(out, expected, atol=1e-6), (out - expected).abs().max()
        run_last = af.pipeline(model, ["2"], mesh, example_args=(x,), microbatches=2, broadcast=False)
        out2 = run_last(x)
        if mesh.rank == 1:
            assert torch.allclose(out2, expected, atol=1e-6)
        else:
            assert out2 is None
        print(f"rank {mesh.rank}: PIPELINE OK max diff {(out - expected).abs().max().item():.2e}", flush=True)

        # a Hugging Face GPT-2 (its KV cache is switched off for tracing): logits equal the plain forward
        from tests.models import tiny_gpt2

        torch.manual_seed(0)
        lm = tiny_gpt2().eval()
        ids = torch.randint(0, 64, (4, 12))
        with torch.no_grad():
            want = lm(input_ids=ids).logits
        logits = af.pipeline(lm, ["transformer.h.1"], mesh, example_args=(ids,), microbatches=2)(ids)
        assert torch.allclose(logits, want, atol=1e-5), (logits - want).abs().max()
        assert lm.config.use_cache == tiny_gpt2().config.use_cache  # the user's model is left as it was
        print(
            f"rank {mesh.rank}: PIPELINE GPT-2 OK max diff {(logits - want).abs().max().item():.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
