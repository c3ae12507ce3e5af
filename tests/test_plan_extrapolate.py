"""The planner's layer extrapolation for models whose blocks alternate (issue 30): the blocks' period after their
leading unlike ones (parameters and the per-layer compute a model declares), the cut to whole periods, and the
line in periods against the full dry run of the same candidate (the reference).

Tiny Qwen3 / Qwen3-MoE models (tests/workers/plan_alternating.py) at 8 fake ranks: seconds each.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import accelfn as af
from accelfn import launch_env
from accelfn.planner.extrapolate import Layout, keep_blocks, layout, period, signatures

ALTERNATING = str(Path(__file__).parent / "workers" / "plan_alternating.py")
KNOBS = dict(remat="none", offload="none", compile="none")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in {**KNOBS, **knobs}.items())


def _linear(n_in: int, n_out: int, **attributes: Any) -> nn.Linear:
    block = nn.Linear(n_in, n_out)
    for k, v in attributes.items():
        setattr(block, k, v)
    return block


# ---- the period of a ModuleList --------------------------------------------------------------------------------


def test_alike_blocks_have_a_period_of_one_after_their_leading_unlike_ones() -> None:
    alike = nn.ModuleList(_linear(4, 4, layer_idx=i) for i in range(8))  # the index differs: not compute
    assert layout(alike) == Layout(8, 0, 1)
    dense_then_moe = nn.ModuleList([*(_linear(4, 8) for _ in range(3)), *(_linear(4, 4) for _ in range(7))])
    assert layout(dense_then_moe) == Layout(10, 3, 1)  # DeepSeek-V3: 3 dense layers kept whole


def test_blocks_alternating_in_shapes_repeat_every_two() -> None:
    """Dense and MoE every other layer (Llama-4's interleave step 2): period 2; after 2 dense ones (Qwen3-MoE's
    `mlp_only_layers=[1]` with an MoE layer every 2nd: D D D M D M ...): lead 2."""
    dm = nn.ModuleList(_linear(4, 8 if i % 2 else 4) for i in range(10))
    assert layout(dm) == Layout(10, 0, 2)
    shapes = [4, 4, 4, 8, 4, 8, 4, 8, 4, 8]
    assert layout(nn.ModuleList(_linear(4, s) for s in shapes)) == Layout(10, 2, 2)


def test_blocks_of_equal_shapes_unlike_in_their_attention_are_not_alike() -> None:
    """gpt-oss / Gemma: sliding and full attention, the same parameters; the block's `sliding_window`,
    `is_sliding` or `layer_type` says which. A float attribute (a value, not compute) does not count."""
    sf = nn.ModuleList(_linear(4, 4, sliding_window=128 if i % 2 == 0 else None) for i in range(10))
    assert layout(sf) == Layout(10, 0, 2)
    nested = nn.ModuleList(nn.Sequential(_linear(4, 4, is_sliding=i % 4 != 3)) for i in range(18))
    assert layout(nested) == Layout(18, 0, 4)  # Qwen3-Next's 3 then 1, 18 = 4 x 4 + 2
    assert Layout(18, 0, 4).remainder == 2
    floats = nn.ModuleList(_linear(4, 4, scale=1.0 / (i + 1)) for i in range(8))
    assert layout(floats) == Layout(8, 0, 1)


def test_per_layer_lists_of_the_config_make_blocks_unlike() -> None:
    """`config.layer_types[i]` (what the model's forward picks a layer's mask by) enters block i's signature;
    lists of floats and the list of all block indices (Llama-4's `moe_layers` with every layer MoE) do not."""
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
    cfg = SimpleNamespace(layer_types=["sliding_attention", "full_attention"] * 4)
    assert layout(blocks, cfg) == Layout(8, 0, 2)
    ignored = SimpleNamespace(rope_theta=[1e4, 1e6] * 4, moe_layers=list(range(8)), hidden_size=4)
    assert len(set(signatures(blocks, ignored))) == 1


def test_configs_that_are_mappings_or_have_no_dict_are_read_or_skipped() -> None:
    """A model's `config` may be a dict (read as the namespace is) or a slotted object (no per-layer lists)."""
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
    assert layout(blocks, {"layer_types": ["sliding_attention", "full_attention"] * 4}) == Layout(8, 0, 2)

    class Slotted:
        __slots__ = ("n_layer",)

        def __init__(self) -> None:
            self.n_layer = 8

    assert layout(blocks, Slotted()) == Layout(8, 0, 1)


def test_remat_every_is_read_past_a_policy_with_angle_brackets_or_parentheses() -> None:
    from accelfn.planner.extrapolate import remat_every

    assert remat_every("Step(train_step(f) -> remat(<lambda>, every=2) -> shard(fsdp, dp=8))") == 2
    assert remat_every("Step(train_step(f) -> remat(partial(g, a=1), every=3))") == 3
    assert remat_every("Step(train_step(f) -> remat('full') -> shard(fsdp, dp=8))") == 1


def test_no_period_of_at_most_a_quarter_of_the_blocks_leaves_the_model_whole() -> None:
    assert period("abcab") == (0, None)
    assert period("sfsfsfs") == (0, None)  # period 2, but fewer than 4 periods
    seen: dict[str, Any] = {}
    model = nn.ModuleDict({"blocks": nn.ModuleList(_linear(4, 4, kind=k) for k in "sfsfsfs")})
    keep_blocks(2, seen)(model)
    assert len(model["blocks"]) == 7 and seen["period"] is None and "no period" in seen["whole"]


def test_the_cheapest_cut_is_chosen_not_a_period_of_one_after_nearly_all_blocks() -> None:
    """65 blocks of 5 sliding then 1 full end in 5 sliding ones: alike after a lead of 60 (cuts of 62 and 63
    blocks), or a period of 6 from the first with a remainder of 5 (cuts of 17 and 23): the second."""
    assert period(("sssssf" * 11)[:65]) == (0, 6)
    assert Layout(65, 0, 6).keep(2) == 17


# ---- the cut ---------------------------------------------------------------------------------------------------


def _qwen3(pattern: str, layers: int) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    types = {"s": "sliding_attention", "f": "full_attention"}
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                      sliding_window=8, layer_types=[types[pattern[i % len(pattern)]] for i in range(layers)])  # fmt: skip
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize(
    "pattern, layers, kept",
    [("sf", 10, {2: "sfsf", 3: "sfsfsf"}), ("sssf", 18, {2: "sssfsssfss", 3: "sssf" * 3 + "ss"})],
)
def test_a_sliding_and_full_model_is_never_cut_as_if_alike(
    pattern: str, layers: int, kept: dict[int, str]
) -> None:
    """A transformers Qwen3 whose layers alternate sliding and full attention (the same parameter shapes): cut to
    2 and 3 whole periods, and the remainder of the last, partial period kept (the cut ends as the whole model
    does), never to 2 and 3 blocks as if alike (a line through "sf" and "sfs")."""
    for k, want in kept.items():
        model, seen = _qwen3(pattern, layers), {}
        keep_blocks(k, seen)(model)
        got = "".join("s" if b.self_attn.sliding_window else "f" for b in model.model.layers)
        assert got == want and seen["kept"] == len(want)
        assert seen["period"] == len(pattern) and "whole" not in seen


def test_transformers_models_that_alternate_have_their_period() -> None:
    """What transformers 5.x declares per layer: gpt-oss's `layer_types` (sliding / full), Llama-4's chunked /
    full attention and no-RoPE layers every 4th with MoE every 2nd, Qwen3-Next's linear-attention layers; plain
    Llama alike."""
    import transformers as T

    small = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        models = {
            "llama": (T.LlamaForCausalLM(T.LlamaConfig(**small, intermediate_size=64, num_hidden_layers=8)), (0, 1)),
            "gpt-oss": (T.GptOssForCausalLM(T.GptOssConfig(**small, intermediate_size=32, num_hidden_layers=12,
                                                           num_local_experts=4, num_experts_per_tok=2)), (0, 2)),
            "llama4": (T.Llama4ForCausalLM(T.Llama4TextConfig(**small, intermediate_size=64, intermediate_size_mlp=64,
                       num_hidden_layers=18, num_local_experts=4, interleave_moe_layer_step=2)), (0, 4)),
            "qwen3-next": (T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**small, intermediate_size=64,
                           moe_intermediate_size=16, shared_expert_intermediate_size=16, num_hidden_layers=16,
                           num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8)), (0, 4)),
        }  # fmt: skip
    for name, (model, want) in models.items():
        seen: dict[str, Any] = {}
        keep_blocks(None, seen)(model)
        assert (seen.get("lead", 0), seen["period"]) == want, name


# ---- the line in periods against the full dry run --------------------------------------------------------------


@pytest.mark.parametrize(
    "args, mesh, knobs, at",
    [
        (("--model", "sliding", "--pattern", "sf", "--layers", "10"), "dp=8",
         dict(strategy="fsdp", accumulate=1, global_batch_size=8), (4, 6)),
        (("--model", "sliding", "--pattern", "ssf", "--layers", "14"), "dp=8",
         dict(strategy="fsdp", accumulate=2, global_batch_size=16), (8, 11)),
        (("--model", "moe", "--mlp-only", "1", "--layers", "10"), "dp=8",
         dict(strategy="ddp", accumulate=1, global_batch_size=8), (6, 8)),
    ],
)  # fmt: skip
def test_an_alternating_model_cut_to_2_and_3_periods_extrapolates_to_its_full_dry_run(
    args: tuple[str, ...], mesh: str, knobs: dict[str, object], at: tuple[int, int]
) -> None:
    """Sliding / full every other layer (period 2), 2 sliding then 1 full over 14 layers (period 3, a remainder of
    2 kept in the cut: 8 and 11 blocks), dense / MoE every other layer after 2 dense (lead 2, period 2; the old
    lead kept 9 of its 10 blocks): the line through the two cut runs gives the full dry run's states exactly,
    its peak to 0.5%, its step time, compute and tokens/s to 1% (measured: all equal to fp64 round-off)."""
    from accelfn.planner.search import Job, run_job
    from accelfn.planner.tiers import _extrapolated

    job = Job(ALTERNATING, args, 8, 1, mesh=mesh, env=_env(**knobs), gpu="h100-sxm")
    cut = run_job(attrs.evolve(job, blocks=(2, 3)))
    assert "reports" in cut, cut.get("error") or cut.get("whole")
    assert (cut["reports"][2][0]["at"], cut["reports"][3][0]["at"]) == at
    full = run_job(job)
    assert "report" in full, full.get("error")
    assert full["period"] == cut["period"] > 1 and cut["reports"][2][0]["full"] == full["blocks"]
    ex, ref = _extrapolated(cut), full["report"]
    for k in ("params", "grads", "optimizer"):
        assert ex["per_rank"][k] == ref["per_rank"][k], k
    assert math.isclose(ex["per_rank"]["peak"], ref["per_rank"]["peak"], rel_tol=5e-3)
    for k in ("step_time_s", "compute_s", "tokens_per_s"):
        assert math.isclose(ex["predicted"][k], ref["predicted"][k], rel_tol=1e-2), k
    assert math.isclose(ex["flops_per_step"], ref["flops_per_step"], rel_tol=1e-9)


PLAN_WORKER = str(Path(__file__).parent / "workers" / "plan_worker.py")


@pytest.mark.parametrize(
    "remat, layers, fixed, at",
    [("full:2", 10, False, (4, 6)), ("selective:3", 12, True, (6, 9))],
)
def test_alike_blocks_of_which_every_nth_is_checkpointed_are_cut_to_whole_periods_of_n(
    remat: str, layers: int, fixed: bool, at: tuple[int, int]
) -> None:
    """`af.remat(every=n)` checkpoints blocks n, 2n, ...: a Llama's alike blocks then repeat every n. Cut to 2 and
    3 blocks (before: one checkpointed block in each, the line through a block that keeps its activations) the
    extrapolated peak was 30% above the full dry run's and the step time 9.5% below (full:2), +10% and +11%
    (selective:3). Cut to 2 and 3 periods of n, from the knob's value or, where the script fixes its remat, from
    the step's own (the cut run again): states exact, peak 0.5%, step time 1% (measured: fp64 round-off)."""
    from accelfn.planner.search import Job, run_job
    from accelfn.planner.tiers import _extrapolated

    knobs = dict(strategy="fsdp", accumulate=1, global_batch_size=8, offload="none", compile="none")
    env = tuple(
        (launch_env.KNOBS[k][0], str(v)) for k, v in {**knobs, **({} if fixed else {"remat": remat})}.items()
    )
    args = ("--layers", str(layers), *(("--remat", remat) if fixed else ()))
    job = Job(PLAN_WORKER, args, 8, 1, mesh="dp=8", env=env, gpu="h100-sxm")
    cut = run_job(attrs.evolve(job, blocks=(2, 3)))
    assert "reports" in cut, cut.get("error") or cut.get("whole")
    assert (cut["reports"][2][0]["at"], cut["reports"][3][0]["at"]) == at
    ex, ref = _extrapolated(cut), run_job(job)["report"]
    for k in ("params", "grads", "optimizer"):
        assert ex["per_rank"][k] == ref["per_rank"][k], k
    assert math.isclose(ex["per_rank"]["peak"], ref["per_rank"]["peak"], rel_tol=5e-3)
    for k in ("step_time_s", "compute_s", "tokens_per_s"):
        assert math.isclose(ex["predicted"][k], ref["predicted"][k], rel_tol=1e-2), k


def test_a_pipeline_of_alternating_blocks_is_not_cut_and_is_its_full_dry_run() -> None:
    """A period of 2 under 2 pipeline stages (the balanced split does not follow periods): the job asked for the
    cut runs is the full dry run (once per rank: the run the hook left whole is kept), and says why."""
    from accelfn.planner.search import Job, run_job

    args = ("--model", "sliding", "--pattern", "sf", "--layers", "10")
    job = Job(ALTERNATING, args, 8, 1, mesh="dp=8", env=_env(strategy="ddp", accumulate=1, global_batch_size=8),
              gpu="h100-sxm")  # fmt: skip
    cut = run_job(attrs.evolve(job, blocks=(2, 3), stages=2))
    assert "report" in cut and "pipeline" in cut["whole"] and cut["period"] == 2
    assert cut["report"]["per_rank"] == run_job(job)["report"]["per_rank"]


def test_the_plan_extrapolates_an_alternating_model_in_periods_and_says_so() -> None:
    """af.plan on the sliding / full model (10 blocks, period 2, 5 periods >= extrapolate_min_blocks=4): its rows
    are measured on 2 and 3 periods and the plan's notes name the period; the chosen row is a full dry run."""
    args = ["--model", "sliding", "--pattern", "sf", "--layers", "10", *(f"--{k}={v}" for k, v in KNOBS.items())]  # fmt: skip
    p = af.plan(ALTERNATING, args, nproc_per_node=2, global_batch_size=4, axes=("dp",), strategies=("ddp", "fsdp"),
                workers=1, confirm=1, extrapolate_min_blocks=4)  # fmt: skip
    assert p.extrapolated >= 2 and p.best is not None and not p.best.extrapolated
    assert any("alternate every 2 blocks" in n and "extrapolated over periods" in n for n in p.notes), p.notes


def test_the_notes_say_where_the_blocks_are_not_extrapolated() -> None:
    from accelfn.planner.tiers import _layout_notes

    (none,) = _layout_notes({"blocks": 10, "lead": 0, "period": None}, 8)
    assert "no period" in none and "full dry run" in none
    (two,) = _layout_notes({"blocks": 10, "lead": 0, "period": 2}, 8)
    assert "5 periods, fewer than 8" in two and "pipeline are full dry runs" in two
    assert _layout_notes({"blocks": 10, "lead": 3, "period": 1}, 8) == []
    assert _layout_notes({"blocks": 4, "lead": 0, "period": None}, 8) == []
