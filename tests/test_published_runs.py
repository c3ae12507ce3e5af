"""The dry run's predicted throughput held to published runs (issue 30 item 3): each row of
accelfn/dryrun/published_runs.json that CI can afford is dry-run with its own command, and its predicted
tokens/s per GPU compared with the published figure; the order between rows (compile faster than eager, fp8
faster than bf16) is checked against the published order.

The goal is within 15% of every row. Rows the model does not reach yet are strict xfails (an improvement that
brings one within 15% fails them: record its new ratio in `RATIO`, which `WITHIN` reads), and every row is held
to the ratio measured when this file was written (`RATIO`, within 5%), so that the model cannot drift unnoticed.
docs/dry_run.md ("Predicted time against published runs") has the table and says what carries the result.

Dry-run time of each row on this project's 2-core machine (shared with other sessions): Table 1 at 8 ranks 8-14 s, Table 3 at 128
ranks 9-22 s, the 0.9B rows 2 s, the held-out rows in CI 11-16 s (the file: about 125 s). Table 5 (405B, 512 ranks,
pp=8) takes 50-80 s per row, the other held-out rows 15-42 s: not here (benchmarks/published_runs.py runs them).
"""

from __future__ import annotations

import pytest

from tests._published import ROOT, ROWS, dry_run_kwargs, outcome

# predicted / published tokens/s per GPU, measured with this commit's model (default assumptions). Until
# 2026-11-27: 1.34 / 1.62 / 1.52, 1.29 / 1.40 / 1.27, 1.40 / 1.10; then a compiled step's update and FSDP's no-grad
# copies stay eager, attention runs at FlashAttention-2's measured speed per direction and length, and the 500 W
# h100-96gb row's peaks sit between the H100 SXM's and NVL's ratings (1.24 / 1.42 / 1.35, 1.19 / 1.32 / 1.21,
# 1.35 / 1.09); since, the fused AdamW update is timed (28 bytes per parameter: 1.24 / 1.41 / 1.34,
# 1.19 / 1.32 / 1.21, 1.29 / 1.06) and remat("selective") is torchtitan's policy, recomputing every second mm of a
# layer (1.18 / 1.30 / 1.26, 1.14 / 1.23 / 1.18), and the 8B rows run torchtitan 9dec370's own loss (`--loss plain`:
# F.cross_entropy on the fp32 logits, not compiled) in place of the chunked one (1.18 / 1.31 / 1.27, 1.14 / 1.24 /
# 1.18); then FSDP2's copy-in wrapper moves nothing itself (its `_foreach_copy_` is counted), FSDP2's copies never
# fuse, and a step compiled per block fuses only its blocks' ops (the loss, head and embedding eager), while the
# dry run traces torchao's float8 blocks as torch.compile does (8df4dd1, the fp8 rows' move) (1.20 / 1.28 / 1.30,
# 1.15 / 1.21 / 1.20, 1.29 / 1.06); then causal attention runs at FlashAttention-2's measured causal speed
# (1.18 / 1.25 / 1.26, 1.13 / 1.18 / 1.18, 1.25 / 1.04), and a compiled run with a reduction moves its bytes at
# torch.compile's measured bandwidth (1.18 / 1.23 / 1.24, 1.13 / 1.17 / 1.16, 1.21 / 1.04); then attention is charged
# as the SDPA backend each row's torch picks (`--torch-version`: FlashAttention-2 for torchtitan's nightly of
# 2024-12-23, unchanged; cuDNN's kernels for the 0.9B rows' torch 2.11: 1.29 / 1.08), and eager ATen memory-bound
# kernels move their bytes at Liger-Kernel's measured 84% of the bandwidth (1.15 / 1.23 / 1.23, 1.11 / 1.16 / 1.16,
# 1.28 / 1.04), and a step compiled as one graph (the 0.9B's) runs transformers' causal mask, which it builds
# whenever torch.compile traces it, as a full attention (benchmarks/sdpa_calls.py: 0.9B compiled 1.21); then
# tensor parallel's fp8 all-gathers count their 1-byte data (they were counted at the bf16 they stand for), and
# small collectives take NCCL's LL / LL128 protocols (docs/dry_run.md item 13: the fp8 TP rows 1.04-1.15 to 1.11-1.21,
# Table 5 added here at 1.21 / 1.21; the rest within 1%); then memory-bound ops on float8 tensors move their 1-byte
# data too (`timing._bytes_of`: the fp8 TP rows 1.11-1.14 to 1.14-1.18, Table 5 1.23 / 1.24; the rest unchanged);
# then fp8 GEMMs on a 700 W H100 SXM or H200 reach their measured fp8 ceiling (`timing.MAMF_FP8`: Trainy's H200 rows
# 1.026 to 1.019; the 500 W `h100-96gb` rows unchanged); then the 500 W `h100-96gb`'s GEMMs run at their measured
# ceiling (`timing.MAMF`: 585 TFLOP/s bf16, pytorch/FBGEMM#2546, where 0.8 of the interpolated peak gave 709): every
# torchtitan row 2-11% slower (1.05 / 1.10 / 1.14, 1.02 / 1.05 / 1.08, Table 5 1.12 / 1.13; the rowwise rows 0.95 /
# 0.94 to 0.91 / 0.92), the 700 W rows unchanged; then a compiled run ends after a whole-tensor reduction (torchao's
# tensorwise amax) and moves what it reads from outside and writes for later, its ops fusing past a matmul that does
# not need them (docs/dry_run.md item 15, benchmarks/fp8_fusion.py: inductor's kernels): 1.05 / 1.07 / 1.08,
# 1.02 / 1.03 / 1.03, Table 5 1.14 / 1.15, 0.9B 1.09 / 1.04, the TP fp8 rows faster (the rowwise ones 1.16 / 1.14)
# (docs/dry_run.md says what each did); then item 15's reviews (25d2b10, 1bc12da: a compiled backward's
# AccumulateGrad copies move nothing): the 0.9B compiled row 1.094 -> 1.104, Table 1 compile / fp8 1.075 / 1.085,
# Table 3 1.031 / 1.027, the rest within 0.1%
RATIO = {
    "torchtitan-t1-8b-8-eager": 1.049,
    "torchtitan-t1-8b-8-compile": 1.075,
    "torchtitan-t1-8b-8-fp8": 1.085,
    "torchtitan-t3-8b-128-eager": 1.020,
    "torchtitan-t3-8b-128-compile": 1.031,
    "torchtitan-t3-8b-128-fp8": 1.027,
    "accelfn-h100-0.9b-compile": 1.104,
    "accelfn-h100-0.9b-eager": 1.042,
    # Table 5 (50-75 s dry runs, not in CI: benchmarks/published_runs.py holds them)
    "torchtitan-t5-405b-512-1f1b": 1.138,
    "torchtitan-t5-405b-512-interleaved": 1.145,
    # held out (`"held_out": true`): encoded on 2026-11-28, after the model was built, and measured once with it
    # unchanged (nothing was changed after seeing them; the fp8 TP rows moved with item 13, a fix of the tracker's
    # bytes). Those not in CI_ROWS (dry runs over 20 s here, or 15-17 s for little more coverage) are held to these
    # ratios by benchmarks/published_runs.py, which reads this table.
    "torchtitan-t2-8b-8-cp1-32k": 1.157,
    "torchtitan-t4-70b-256-2d": 1.092,
    "torchtitan-t6-405b-512-cp1-32k": 1.129,
    "torchtitan-asynctp-70b-256-bf16": 1.051,
    "torchtitan-asynctp-70b-256-fp8": 1.118,
    "torchtitan-asynctp-8b-64-bf16": 1.012,
    "torchtitan-asynctp-8b-64-fp8": 1.155,
    "trainy-h200-8b-32-fp8": 1.012,
    "trainy-h200-8b-64-fp8": 1.012,
    # held out too, encoded once train_llama.py had --fp8-recipe (2026-11-28): the async TP benchmark's float8
    # rowwise rows, vanilla TP (the first rows predicted too slow; 19 and 42 s dry runs, not in CI)
    "torchtitan-asynctp-70b-256-fp8-rowwise": 1.156,
    "torchtitan-asynctp-8b-64-fp8-rowwise": 1.144,
}
# rows the model predicts within 15% (all but Table 2's 32k row, 1.157, and the 70B's rowwise row, 1.156, since
# item 15; the 0.9B compiled row, 1.206 before it, is now within)
WITHIN = {rid for rid in RATIO if abs(RATIO[rid] - 1) <= 0.15}
CI_ROWS = [
    "torchtitan-t1-8b-8-eager",
    "torchtitan-t1-8b-8-compile",
    "torchtitan-t1-8b-8-fp8",
    "torchtitan-t3-8b-128-eager",
    "torchtitan-t3-8b-128-compile",
    "torchtitan-t3-8b-128-fp8",
    "accelfn-h100-0.9b-compile",
    "accelfn-h100-0.9b-eager",
    # held out, 11-16 s each: vanilla TP over a node (torchtitan's async TP benchmark, bf16 and fp8) and H200s
    "torchtitan-asynctp-8b-64-bf16",
    "torchtitan-asynctp-8b-64-fp8",
    "trainy-h200-8b-32-fp8",
]


def predicted(row_id: str) -> float:
    """The dry run's predicted tokens/s per GPU for a row (each row dry-run once per session)."""
    return outcome(row_id).tokens_per_s_per_gpu


def _ratio(row_id: str) -> float:
    return predicted(row_id) / ROWS[row_id]["published"]["tokens_per_s_per_gpu"]


def test_every_row_has_its_source_command_and_published_figures() -> None:
    for rid, row in ROWS.items():
        assert row["source"]["url"] and row["source"]["table"], rid
        script, _, kwargs = dry_run_kwargs(row["command"])
        assert (ROOT / script).exists() and kwargs["nproc_per_node"] * kwargs.get("nnodes", 1) == row[
            "config"
        ]["gpus"]
        memory = row["published"]["memory_gib"]  # None: not published (torchtitan's async TP benchmark)
        assert row["published"]["tokens_per_s_per_gpu"] > 0 and (memory is None or memory > 0), rid
        assert row["published"]["memory_kind"] in ("reserved", "allocated"), rid
        assert isinstance(row.get("held_out", False), bool), rid


def test_every_row_declares_its_torch_and_is_timed_with_the_sdpa_kernel_that_torch_ran() -> None:
    from accelfn.dryrun.attention_speeds import sdpa_backend

    for rid, row in ROWS.items():
        torch_version = row["config"]["torch"]
        assert f"--torch-version {torch_version} " in row["command"], rid
        _, _, kwargs = dry_run_kwargs(row["command"])
        assert kwargs["assumptions"].timing.torch_version == torch_version
        # torchtitan's nightlies of 2024-12-23 (torch 1963fc8) and 2025-06-14 (38410cf9), and NGC 25.05's torch 2.8
        # of 2025-05 (Trainy's H200 rows): FlashAttention-2 (cuDNN opt-in from pytorch#138522 to #162073); the 0.9B
        # rows' torch 2.11: cuDNN's kernels, as the H100 profile of the row showed
        expected = "cudnn" if rid.startswith("accelfn-") else "flash2"
        assert sdpa_backend(torch_version, row["command"].split("--gpu ")[1].split()[0]) == expected, rid


def test_every_held_out_row_is_marked_and_its_ratio_recorded() -> None:
    held_out = {rid for rid, row in ROWS.items() if row.get("held_out")}
    assert len(held_out) >= 11
    for rid in held_out:
        assert ROWS[rid]["held_out_note"].startswith("held out"), rid
        assert rid in RATIO, (
            f"{rid}: record its measured ratio in RATIO (benchmarks/published_runs.py measures it)"
        )
    assert set(CI_ROWS) <= set(RATIO)
    assert WITHIN.issubset(RATIO)


@pytest.mark.slow
@pytest.mark.parametrize("row_id", CI_ROWS)
def test_the_prediction_stays_where_it_was_measured(row_id: str) -> None:
    assert _ratio(row_id) == pytest.approx(RATIO[row_id], rel=0.05), predicted(row_id)


@pytest.mark.slow
@pytest.mark.parametrize(
    "row_id",
    [
        pytest.param(
            r,
            marks=[] if r in WITHIN else pytest.mark.xfail(strict=True, reason=f"predicted at {RATIO[r]}x"),
        )
        for r in CI_ROWS
    ],
)
def test_the_prediction_is_within_15_percent_of_the_published_run(row_id: str) -> None:
    assert _ratio(row_id) == pytest.approx(1.0, rel=0.15), predicted(row_id)


@pytest.mark.slow
@pytest.mark.parametrize(
    "slower, faster",
    [
        ("torchtitan-t1-8b-8-eager", "torchtitan-t1-8b-8-compile"),  # compile faster than eager
        ("torchtitan-t1-8b-8-compile", "torchtitan-t1-8b-8-fp8"),  # fp8 faster than bf16
        ("torchtitan-t3-8b-128-eager", "torchtitan-t3-8b-128-compile"),
        ("torchtitan-t3-8b-128-compile", "torchtitan-t3-8b-128-fp8"),
        ("torchtitan-t3-8b-128-eager", "torchtitan-t1-8b-8-eager"),  # 8 GPUs faster per GPU than 128
        ("torchtitan-t3-8b-128-fp8", "torchtitan-t1-8b-8-fp8"),
        ("accelfn-h100-0.9b-eager", "accelfn-h100-0.9b-compile"),
        ("torchtitan-asynctp-8b-64-bf16", "torchtitan-asynctp-8b-64-fp8"),  # held out: fp8 faster, under TP
    ],
)
def test_the_rows_come_in_the_published_order(slower: str, faster: str) -> None:
    published = {r: ROWS[r]["published"]["tokens_per_s_per_gpu"] for r in (slower, faster)}
    assert published[slower] < published[faster]
    assert predicted(slower) < predicted(faster), (predicted(slower), predicted(faster))


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True, reason="the goal: predicted 1.32x (the 70B's 1.44x against 1.36x: 6% over; item 15)"
)
def test_fp8_s_gain_over_bf16_under_tensor_parallel_is_the_published_one_within_5_percent() -> None:
    """torchtitan's async TP benchmark, vanilla TP over a node (8B, FSDP 8 x TP 8): fp8 tensorwise over bf16 is
    published at 1.16x. Its all-gathers of activations and gradients carry float8 (torchao's float8 styles): counted
    at the bf16 they stand for, the predicted gain was 1.10x; with their bytes and the memory-bound ops' on float8
    tensors counted as the 1-byte data they are, 1.25x (docs/dry_run.md item 13): over-predicted now, not under."""
    bf16, fp8 = "torchtitan-asynctp-8b-64-bf16", "torchtitan-asynctp-8b-64-fp8"
    published = (
        ROWS[fp8]["published"]["tokens_per_s_per_gpu"] / ROWS[bf16]["published"]["tokens_per_s_per_gpu"]
    )
    assert predicted(fp8) / predicted(bf16) == pytest.approx(published, rel=0.05)
