"""Per-block activation checkpointing as a launch knob (`remat: selective:2`, `af.remat(step, "selective",
every=2)`), searched by `accelfn plan`: its syntax and errors, its memory order, a plan of a small model where it
is the best that fits (checked against the exhaustive search), the written config, and the step it builds.

The planned script is tests/workers/plan_worker.py (a tiny Llama) with 4 blocks of 128 tokens, one process, all
but remat fixed: none holds 14.1 MiB at its peak, selective:2 11.4 MiB, selective 8.0 MiB, full 5.8 MiB; in the
time model none < selective:2 < selective < full (the recomputation counted).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

import accelfn as af
from accelfn import launch_env
from accelfn.launch.config import Config, ConfigError, load
from accelfn.planner import Candidate, Space, enumerate_candidates
from accelfn.planner.candidates import REMATS
from accelfn.planner.memory import frugality, needs_more_memory, remat_needs_more
from tests._launch import WORKERS

SCRIPT = str(WORKERS / "plan_worker.py")
ARGS = ["--strategy", "ddp", "--accumulate", "1", "--offload", "none", "--compile", "none"]
ARGS += ["--global-batch-size", "4", "--layers", "4", "--seq-len", "128"]  # the grid: remat alone
MEMORY_GIB = 12.5 / 1024  # usable: 12.5 MiB, between selective:2's peak and none's


# ---- the knob's syntax ------------------------------------------------------------------------------------------


def test_the_remat_knob_takes_a_policy_on_every_nth_block() -> None:
    assert [launch_env.parse_knob("remat", v) for v in ("full:2", "Selective:3", "full:1", "none")] == [
        "full:2",
        "selective:3",
        "full",  # every block: the plain policy
        "none",
    ]
    assert launch_env.knob("remat", "auto", "none", environ={"ACCELFN_REMAT": "full:2"}) == "full:2"
    assert launch_env.remat_args("full:2") == {"policy": "full", "every": 2}
    assert launch_env.remat_args("selective") == {"policy": "selective", "every": 1}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("full:0", "ACCELFN_REMAT='full:0': the block interval '0' must be an integer >= 1"),
        ("full:two", "ACCELFN_REMAT='full:two': the block interval 'two' must be an integer >= 1"),
        ("none:2", "ACCELFN_REMAT='none:2': 'none' checkpoints no block"),
        ("partial:2", "ACCELFN_REMAT='partial:2' is not one of none, selective, full, or POLICY:N"),
    ],
)
def test_a_bad_remat_value_names_the_variable(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        launch_env.knob("remat", "auto", environ={"ACCELFN_REMAT": value})


def test_a_bad_remat_value_in_a_config_or_a_flag_names_it() -> None:
    with pytest.raises(ConfigError, match=re.escape("config key 'plan.remat'='full:0': the block interval")):
        Config.from_dict({"plan": {"remat": "full:0"}})
    p = argparse.ArgumentParser()
    p.add_argument("--remat", type=launch_env.remat_flag, default="auto")
    assert p.parse_args([]).remat == "auto" and p.parse_args(["--remat", "FULL:2"]).remat == "full:2"
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape("--remat='full:0': the block interval")):
        launch_env.remat_flag("full:0")
    with pytest.raises(ValueError, match=re.escape("remat_args('none')")):
        launch_env.remat_args("none")


# ---- the memory order ------------------------------------------------------------------------------------------


def _kept(value: str, blocks: int) -> list[int]:
    """What each of `blocks` blocks keeps under `value`, the reference of the order: 2 everything (none, or a
    block af.remat leaves alone), 1 selective's saved ops, 0 only its inputs (full); af.remat(every=n)
    checkpoints blocks n, 2n, ... (1-based), as torchtitan's layer counter (`count % n == 0`) does."""
    policy, _, every = value.partition(":")
    level = {"none": 2, "selective": 1, "full": 0}[policy]
    n = int(every or 1)
    return [level if i % n == 0 else 2 for i in range(1, blocks + 1)]


def test_per_block_remat_needs_memory_between_none_and_every_block() -> None:
    """`remat_needs_more` against a block-by-block reference over 60 blocks (every interval up to 6 divides
    60: every value `--remats` may mix, full:3 with selective:4 and none): a needs at least b's memory exactly
    where each block of a keeps at least what that block of b keeps; and the frugal order never puts a value
    needing more memory ahead of one needing less."""
    intervals = ("", ":2", ":3", ":4", ":5", ":6")
    values = ["none", *[f"{p}{s}" for p in ("selective", "full") for s in intervals]]
    for a, b in itertools.product(values, repeat=2):
        want = all(x >= y for x, y in zip(_kept(a, 60), _kept(b, 60), strict=True))
        assert remat_needs_more(a, b) == want, (a, b)
        ca, cb = Candidate({"dp": 2}, "ddp", a, 1), Candidate({"dp": 2}, "ddp", b, 1)
        assert needs_more_memory(ca, cb) == want, (a, b)
        if want and a != b:
            assert frugality(ca) < frugality(cb), (a, b)
    assert remat_needs_more("full:2", "full") and not remat_needs_more("full", "full:2")
    assert not remat_needs_more("selective", "full:2") and not remat_needs_more("full:2", "selective")
    assert not remat_needs_more(None, "full") and not remat_needs_more("full:2", None)


def test_the_searched_remats_are_each_policy_and_selective_on_every_second_block() -> None:
    space = Space(world=2, nproc_per_node=2, open=frozenset({"mesh", "remat"}), axes=("dp",))
    want = ["none", "selective:2", "selective", "full"]
    assert [c.remat for c in enumerate_candidates(space)] == list(REMATS) == want


# ---- the plan: selective:2 is the best that fits -----------------------------------------------------------------


@pytest.fixture(scope="module")
def plans() -> tuple[af.planner.Plan, af.planner.Plan]:
    kw = dict(nproc_per_node=1, axes=("dp",), workers=1, memory_gib=MEMORY_GIB)
    return af.plan(SCRIPT, ARGS, **kw), af.plan(SCRIPT, ARGS, prune=False, **kw)  # type: ignore[arg-type]


def test_per_block_remat_is_chosen_where_none_does_not_fit_and_it_is_the_fastest_that_does(plans) -> None:
    pruned, exhaustive = plans
    assert pruned.open_knobs == ["mesh", "remat"]
    assert exhaustive.dry_runs == exhaustive.candidates == len(REMATS)
    assert [r.candidate.remat for r in exhaustive.unfit] == ["none"]
    by = {r.candidate.remat: r for r in exhaustive.rows}
    assert set(by) == {"selective:2", "selective", "full"}
    # selective:2 keeps less than none and more than selective, and recomputes less than selective
    peaks = [by[r].peak for r in ("full", "selective", "selective:2")]
    assert peaks == sorted(peaks) and peaks[-1] <= exhaustive.capacity_bytes < exhaustive.unfit[0].peak
    assert by["selective:2"].step_time_s < by["selective"].step_time_s < by["full"].step_time_s
    best = max(exhaustive.rows, key=lambda r: r.tokens_per_s_per_gpu or 0.0)
    assert best.candidate.remat == "selective:2"
    assert pruned.best is not None and pruned.best.candidate.key == best.candidate.key
    assert pruned.best.peak == best.peak and pruned.best.step_time_s == best.step_time_s
    text = pruned.table()
    assert "remat=selective:2" in text
    assert "note: remat=selective:2 and the like: that policy on every n-th block" in text


def test_the_written_per_block_config_is_what_launch_and_dry_run_apply(plans, tmp_path: Path) -> None:
    from accelfn.cli.main import main
    from accelfn.launch.launcher import LaunchOptions, resolve

    pruned, _ = plans
    best = pruned.best
    assert best is not None
    path = pruned.write_config(tmp_path / "plan.yaml")
    assert load(path).plan.remat == "selective:2"
    # accelfn launch --config: the script's knob reads selective:2, af.remat's arguments every 2nd block
    env = resolve(LaunchOptions(script=SCRIPT, config_file=str(path), cpu=True), environ={}).env
    assert env["ACCELFN_REMAT"] == "selective:2"
    assert launch_env.remat_args(launch_env.knob("remat", "auto", "none", environ=env)) == {
        "policy": "selective",
        "every": 2,
    }
    # accelfn dry-run --config: the plan's figures
    out = tmp_path / "report.json"
    code = main(["dry-run", "--config", str(path), "--no-search", "--json", str(out), SCRIPT, *ARGS])
    report = json.loads(out.read_text())
    assert report["per_rank"]["peak"] == best.peak
    assert math.isclose(report["predicted"]["step_time_s"], best.step_time_s, rel_tol=1e-9)
    assert code == 0


# ---- the remat values the user asks for: --remats, af.plan(remats=...) ------------------------------------------

# full:4 is measured before none and selective:4, which need at least its memory: its not fitting prunes both
USER_REMATS = "full:4,none,full:3,selective:4,full:2,FULL:4"  # (a duplicate, not canonical: dropped)
USER = ("full:4", "none", "full:3", "selective:4", "full:2")
# at 12.5 MiB usable: full:2 (10.6 MiB) and full:3 (11.8) fit, full:4 (13.0), selective:4 (13.1) and none (14.1)
# do not; full:3 recomputes one block, full:2 two: full:3 is the fastest that fits


def test_the_remats_searched_are_checked_by_the_knobs_parser_and_name_the_option(capsys) -> None:
    from accelfn.cli.main import main
    from accelfn.planner.candidates import parse_remats

    assert parse_remats(USER_REMATS.split(","), source="--remats") == USER
    assert parse_remats(["full:1", "selective:01", "full"], source="r") == ("full", "selective")
    space = Space(world=1, nproc_per_node=1, open=frozenset({"mesh", "remat"}), axes=("dp",), remats=USER)
    assert [c.remat for c in enumerate_candidates(space)] == list(USER)
    for bad, why in (("full:0", "the block interval '0' must be an integer >= 1"),
                     ("partial", "is not one of none, selective, full, or POLICY:N"),
                     ("none:2", "'none' checkpoints no block")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(f"af.plan: remats={bad!r}") + ".*" + re.escape(why)):
            af.plan(SCRIPT, ARGS, remats=("none", bad))
        assert main(["plan", "--remats", f"none,{bad}", "--no-progress", SCRIPT, *ARGS]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"accelfn plan: --remats={bad!r}") and why in err, err
    with pytest.raises(ValueError, match=re.escape("af.plan: remats must be a list of remat values")):
        af.plan(SCRIPT, ARGS, remats="full:2")
    with pytest.raises(ValueError, match=re.escape("af.plan: remats is empty")):
        af.plan(SCRIPT, ARGS, remats=())
    assert main(["plan", "--remats", ",", SCRIPT]) == 2
    assert "accelfn plan: --remats is empty" in capsys.readouterr().err


@pytest.fixture(scope="module")
def user_plans(tmp_path_factory) -> tuple[Path, dict, af.planner.Plan]:
    """`accelfn plan --remats USER_REMATS` (pruned; its JSON and its written config), and the exhaustive
    `af.plan(remats=USER, prune=False)`: one process, everything but remat fixed."""
    from accelfn.cli.main import main

    folder = tmp_path_factory.mktemp("remats")
    path, js = folder / "plan.yaml", folder / "plan.json"
    opts = ["--nproc-per-node", "1", "--axes", "dp", "--workers", "1", "--memory-gib", str(MEMORY_GIB),
            "--calibration", "none", "--no-progress", "--json", str(js), "--write", str(path)]  # fmt: skip
    assert main(["plan", "--remats", USER_REMATS, *opts, SCRIPT, *ARGS]) == 0
    kw = dict(nproc_per_node=1, axes=("dp",), workers=1, memory_gib=MEMORY_GIB)
    exhaustive = af.plan(SCRIPT, ARGS, remats=USER, prune=False, **kw)  # type: ignore[arg-type]
    return path, json.loads(js.read_text()), exhaustive


def test_the_pruned_plan_over_the_users_remats_is_the_exhaustive_one(user_plans) -> None:
    _, pruned, exhaustive = user_plans
    assert pruned["open_knobs"] == ["mesh", "remat"] and pruned["candidates"] == len(USER)
    assert exhaustive.dry_runs == exhaustive.candidates == len(USER)
    measured = {r.candidate.remat: r for r in [*exhaustive.rows, *exhaustive.unfit]}
    assert set(measured) == set(USER)
    assert {r.candidate.remat for r in exhaustive.unfit} == {"none", "selective:4", "full:4"}
    best = max(exhaustive.rows, key=lambda r: r.tokens_per_s_per_gpu or 0.0)
    assert best.candidate.remat == "full:3"
    chosen = pruned["chosen"]
    assert chosen["candidate"]["remat"] == "full:3" and chosen["candidate"]["label"] == best.candidate.label
    assert chosen["peak"] == best.peak and chosen["step_time_s"] == best.step_time_s
    # the pruning did prune: none and selective:4 need at least full:4's memory, measured not to fit
    dominated = {f["label"] for f in pruned["fallen"] if f["tier"] == "dominated"}
    assert dominated == {"dp=1 remat=none", "dp=1 remat=selective:4"}, pruned["fallen"]
    assert pruned["dry_runs"] == len(USER) - 2


def test_the_written_config_of_a_users_remat_is_what_dry_run_applies(user_plans, tmp_path: Path) -> None:
    from accelfn.cli.main import main

    path, pruned, _ = user_plans
    assert load(path).plan.remat == "full:3"
    out = tmp_path / "report.json"
    code = main(["dry-run", "--config", str(path), "--no-search", "--json", str(out), SCRIPT, *ARGS])
    report = json.loads(out.read_text())
    assert report["per_rank"]["peak"] == pruned["chosen"]["peak"]
    assert math.isclose(report["predicted"]["step_time_s"], pruned["chosen"]["step_time_s"], rel_tol=1e-9)
    assert code == 0


def test_remats_and_strategies_are_not_searched_where_the_script_fixes_them_and_the_plan_says_so(
    capsys, tmp_path: Path
) -> None:
    from accelfn.cli.main import main

    fixed = [*ARGS, "--remat", "full"]  # the script fixes strategy (ddp) and remat
    opts = [
        "--nproc-per-node",
        "1",
        "--axes",
        "dp",
        "--workers",
        "1",
        "--calibration",
        "none",
        "--no-progress",
    ]
    js = tmp_path / "plan.json"
    args = ["--remats", "none,full:2", "--strategies", "fsdp", "--json", str(js)]
    assert main(["plan", *opts, *args, SCRIPT, *fixed]) == 0
    out = capsys.readouterr().out
    assert "note: remats=none,full:2 not searched: the script fixes its remat (kept as it is)" in out, out
    assert "note: strategies=fsdp not searched: the script fixes its strategy (kept as it is)" in out, out
    plan = json.loads(js.read_text())
    assert plan["candidates"] == 1 and plan["open_knobs"] == ["mesh"] and "remat" in plan["fixed_knobs"]
    assert "remat" not in plan["chosen"]["candidate"]  # the script's own: full


# ---- the step the knob builds ----------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         use_cache=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(2)]


def test_a_step_from_the_knob_is_the_step_by_hand_and_changes_no_result() -> None:
    """af.remat(**remat_args(knob)) with ACCELFN_REMAT=selective:2 is af.remat("selective", every=2): blocks 2
    and 4 of 4 checkpointed; two AdamW steps of each give plain PyTorch's losses and parameters (one process, real
    tensors; remat recomputes, never changes a result)."""

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> af.Loss:
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    def train(step: af.Step) -> tuple[list[float], list[int], dict[str, torch.Tensor]]:
        model = _model()
        state = step.init(model)
        losses = []
        for ids in _batches():
            state, metrics = step(state, ids)
            losses.append(metrics["loss"].item())
        checkpointed = [i + 1 for i, b in enumerate(model.model.layers) if getattr(b, "_accelfn_remat", None)]
        return losses, checkpointed, {k: v.detach().clone() for k, v in state.params.items()}

    base = af.train_step(loss_fn, af.optim.adamw(1e-3, weight_decay=0.0))
    value = launch_env.knob("remat", "auto", "none", environ={"ACCELFN_REMAT": "selective:2"})
    knob_losses, knob_blocks, knob_params = train(af.remat(base, **launch_env.remat_args(value)))
    hand_losses, hand_blocks, hand_params = train(af.remat(base, "selective", every=2))
    assert knob_blocks == hand_blocks == [2, 4]

    model = _model()  # the reference: plain PyTorch, no checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    ref_losses = []
    for ids in _batches():
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert knob_losses == pytest.approx(ref_losses, abs=1e-6)
    assert hand_losses == pytest.approx(ref_losses, abs=1e-6)
    ref_params = dict(model.named_parameters())
    for name, p in knob_params.items():
        torch.testing.assert_close(p, hand_params[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=1e-5, atol=1e-6)


def test_the_llama_example_takes_a_per_block_remat_flag() -> None:
    """examples/train_llama.py --remat full:2 (one fake rank, 4 tiny blocks): its peak is between --remat none's
    and --remat full's, as the planner's memory order has it."""
    args = ["--model", "tiny", "--layers", "4", "--strategy", "ddp", "--compile", "none", "--accumulate", "1"]
    peak = {
        r: af.dry_run(
            "examples/train_llama.py", [*args, "--remat", r], nproc_per_node=1, search=False
        ).per_rank["peak"]
        for r in ("none", "full:2", "full")
    }
    assert peak["full"] < peak["full:2"] < peak["none"], peak
