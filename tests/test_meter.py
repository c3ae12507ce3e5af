"""`af.Meter`: counted FLOPs, throughput against a fake clock, MFU, and global figures over two processes."""

from __future__ import annotations

import json

import pytest
import torch
from _launch import output_of, run_workers
from torch._dynamo.utils import counters

import accelfn as af
from accelfn.meter import Meter
from accelfn.platforms.cuda import peak_tflops_of

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, INTER, BATCH, SEQ = 256, 64, 2, 128, 2, 32


class FakeClock:
    """A clock that moves only when told to (the step and the data loop advance it)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tiny_llama(attention: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation=attention,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return af.losses.cross_entropy(logits[:, :-1], batch["input_ids"][:, 1:])


def expected_llama_flops(model: torch.nn.Module, attention_per_token: int) -> int:
    """6 * N * tokens for the matmul weights (every 2-D weight but the embedding lookup; a tied head counts
    once more) plus the attention term per token: scores and values are 2 matmuls of 2*seq*hidden FLOPs per
    token and layer forward (4*s*h, all positions: torch counts attention as if not causal), twice that
    backward (12*s*h in all); torch's fused attention backward recomputes the scores (2*s*h more: 14*s*h)."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in name)
    if model.config.tie_word_embeddings:
        n += VOCAB * HIDDEN
    tokens = BATCH * SEQ
    return 6 * n * tokens + attention_per_token * LAYERS * SEQ * HIDDEN * tokens


def llama_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}


@pytest.mark.parametrize(("attention", "per_token"), [("eager", 12), ("sdpa", 14)])
def test_counted_flops_of_a_llama_step_are_6_n_tokens_plus_attention(attention, per_token):
    model = tiny_llama(attention)
    expected = expected_llama_flops(model, per_token)
    meter = Meter(af.train_step(lm_loss, af.optim.sgd(0.1)))
    state = meter.step.init(model)
    meter(state, llama_batch())
    assert meter.flops == expected


def test_counted_flops_are_the_same_under_accumulate():
    model = tiny_llama("eager")
    expected = expected_llama_flops(model, 12)
    meter = Meter(af.accumulate(af.train_step(lm_loss, af.optim.sgd(0.1)), 2))
    state = meter.step.init(model)
    meter(state, llama_batch())
    assert meter.flops == expected


def test_counted_flops_are_the_same_under_compile_and_the_step_still_compiles():
    # Dynamo skips a frame first run under a dispatch mode, and then never compiles it: the meter counts its
    # first step eagerly (torch.compiler.set_stance("force_eager")), and the second call compiles.
    model = tiny_llama("eager")
    expected = expected_llama_flops(model, 12)
    meter = Meter(af.compile(af.train_step(lm_loss, af.optim.sgd(0.1)), backend="aot_eager"))
    state = meter.step.init(model)
    counters.clear()
    state, _ = meter(state, llama_batch())
    assert meter.flops == expected
    assert counters["stats"]["unique_graphs"] == 0
    state, _ = meter(state, llama_batch())
    assert counters["stats"]["unique_graphs"] >= 1


def ticking_step(
    clock: FakeClock, seconds: float, model: torch.nn.Module, **kw
) -> tuple[Meter, af.TrainState]:
    def loss_fn(m, batch):
        clock.t += seconds  # the step "takes" `seconds`
        return af.losses.mse(m(batch["x"]), batch["y"])

    meter = Meter(af.train_step(loss_fn, af.optim.sgd(0.01)), clock=clock, **kw)
    return meter, meter.step.init(model)


def test_tokens_per_s_is_tokens_over_wall_time_after_the_counted_step():
    clock = FakeClock()
    meter, state = ticking_step(clock, 0.25, torch.nn.Linear(8, 1), tokens=lambda b: 7 * len(b["x"]))
    rows = [4, 4, 6, 2, 4]
    for i, n in enumerate(rows):
        clock.t += 0.1 * i  # the loop spends 0, 0.1, 0.2, ... s getting each batch
        state, _ = meter(state, {"x": torch.randn(n, 8), "y": torch.randn(n, 1)})
    figures = meter.figures()
    # steps 2..5 are timed: 4 steps of 0.25 s and the waits before them
    wall = 4 * 0.25 + (0.1 + 0.2 + 0.3 + 0.4)
    assert figures["steps"] == 4
    assert figures["tokens_per_s"] == pytest.approx(7 * sum(rows[1:]) / wall, rel=1e-12)
    assert figures["samples_per_s"] == pytest.approx(sum(rows[1:]) / wall, rel=1e-12)
    assert figures["step_time"] == pytest.approx(0.25)
    assert figures["data_wait"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)


def test_figures_cover_the_steps_since_the_last_call():
    clock = FakeClock()
    meter, state = ticking_step(clock, 0.5, torch.nn.Linear(8, 1))
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 1)}
    for _ in range(3):
        state, _ = meter(state, batch)
    meter.figures()
    clock.t += 1.0  # time spent logging counts in the next interval
    state, _ = meter(state, batch)
    figures = meter.figures()
    assert figures["steps"] == 1
    assert figures["samples_per_s"] == pytest.approx(4 / 1.5)


def test_tokens_default_to_the_first_integer_tensor_and_samples_to_the_first_leaf_rows():
    clock = FakeClock()
    meter, state = ticking_step(clock, 1.0, torch.nn.Linear(8, 1))
    batch = {"ids": torch.zeros(3, 5, dtype=torch.long), "x": torch.randn(3, 8), "y": torch.randn(3, 1)}
    for _ in range(2):
        state, _ = meter(state, batch)
    figures = meter.figures()
    assert figures["tokens_per_s"] == pytest.approx(15.0)
    assert figures["samples_per_s"] == pytest.approx(3.0)


def test_mfu_matches_a_hand_computation_with_an_overridden_peak():
    clock = FakeClock()
    d_in, d_out, rows = 64, 32, 16
    meter, state = ticking_step(clock, 0.002, torch.nn.Linear(d_in, d_out), peak_tflops=2e-3)
    batch = {"x": torch.randn(rows, d_in), "y": torch.randn(rows, d_out)}
    for _ in range(4):
        state, _ = meter(state, batch)
    figures = meter.figures()
    flops = 2 * rows * d_in * d_out * 2  # forward and weight gradient (the input needs no gradient)
    assert meter.flops == flops
    assert figures["tflops"] == pytest.approx(flops / 0.002 / 1e12, rel=1e-9)
    assert figures["mfu"] == pytest.approx(flops / 0.002 / 1e12 / 2e-3, rel=0.05)
    assert {"step", "samples/s", "mfu"} <= set(meter.postfix())


def test_mfu_is_left_out_when_the_peak_is_not_known():
    meter, state = ticking_step(FakeClock(), 0.1, torch.nn.Linear(8, 1))
    for _ in range(3):
        state, _ = meter(state, {"x": torch.randn(4, 8), "y": torch.randn(4, 1)})
    figures = meter.figures()
    assert af.platforms.get("cpu").peak_tflops(torch.bfloat16) is None
    assert "tflops" in figures and "mfu" not in figures and "mfu" not in meter.postfix()
    assert figures["host_rss"] > 0


def test_cuda_peak_table_reads_device_names():
    assert peak_tflops_of("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.0
    assert peak_tflops_of("NVIDIA H100 PCIe", torch.bfloat16) == 756.0
    assert peak_tflops_of("NVIDIA H200", torch.float16) == 989.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert peak_tflops_of("NVIDIA L40S", torch.bfloat16) == 362.0
    assert peak_tflops_of("NVIDIA L4", torch.bfloat16) == 121.0
    assert peak_tflops_of("NVIDIA A10G", torch.bfloat16) == 125.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None  # no fp8 on Ampere
    assert peak_tflops_of("NVIDIA GeForce GT 710", torch.bfloat16) is None


def test_cuda_peak_for_float32_follows_torchs_matmul_precision():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_tflops_of("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5
        torch.set_float32_matmul_precision("high")
        assert peak_tflops_of("NVIDIA A100-SXM4-80GB", torch.float32) == 156.0
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_global_tokens_per_s_sums_both_ranks_with_one_collective():
    proc = run_workers("meter_worker.py", 2)
    out = output_of(proc)
    assert proc.returncode == 0, out
    lines = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("FIGURES ")
    ]
    assert len(lines) == 2, out
    # rank r's step takes 0.1 * (r + 1) s on a batch of 4 x 16 ids: 640 + 320 tokens/s
    for figures in lines:
        assert figures["tokens_per_s"] == pytest.approx(64 / 0.1 + 64 / 0.2), out
        assert figures["samples_per_s"] == pytest.approx(4 / 0.1 + 4 / 0.2), out
        assert figures["step_time"] == pytest.approx(0.2), out  # the slowest rank's
        assert figures["collectives"] == 1, out
