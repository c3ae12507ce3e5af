"""Checkpoints of FSDP2-sharded states on 2 processes, loaded on 1, and the reverse."""

import json
import math
import re

import pytest
import torch
from _launch import output_of, run_workers
from safetensors.torch import load_file

import accelfn as af
from tests.workers.ckpt_fsdp import expected_params, fill, make_state

RANK_FILE = re.compile(r"(model|optimizer)-rank(\d{5})(?:-(\d{5})-of-(\d{5}))?\.safetensors")


def check_each_rank_wrote_its_own_shards(folder, ref, max_shard_size):
    """docs/checkpoints.md, "Distributed": each rank writes its local shard of every sharded DTensor into its
    own `model-rankR*` / `optimizer-rankR*` files (split `-0000i-of-0000N` past `max_shard_size`), plain
    tensors are written by rank 0, nothing is gathered, and no Hugging Face `model.safetensors` is written."""
    meta = json.loads((folder / "state.json").read_text())
    assert meta["sharded"] is True and meta["world_size"] == 2, meta
    assert sorted(p.name for p in folder.iterdir()) == sorted([*meta["files"], "state.json"]), (
        "exactly the recorded files: no model.safetensors, no index, no leftovers"
    )
    groups: dict[tuple[str, int], list[re.Match]] = {}
    for name in meta["files"]:
        m = RANK_FILE.fullmatch(name)
        assert m is not None, f"{name} is not a per-rank file name"
        groups.setdefault((m[1], int(m[2])), []).append(m)
    assert sorted(groups) == [("model", 0), ("model", 1), ("optimizer", 0), ("optimizer", 1)], sorted(groups)
    for (base, rank), ms in groups.items():
        if max_shard_size is None:
            assert [m[0] for m in ms] == [f"{base}-rank{rank:05d}.safetensors"], ms
        else:
            count = {m[4] for m in ms}
            assert len(count) == 1 and None not in count, [m[0] for m in ms]
            assert sorted(int(m[3]) for m in ms) == list(range(1, int(count.pop()) + 1)), [m[0] for m in ms]
    files = {name: load_file(folder / name) for name in meta["files"]}
    if max_shard_size is not None:
        for name, tensors in files.items():
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            assert size <= max_shard_size or len(tensors) == 1, (name, size)

    adam = make_state({k: v.clone() for k, v in ref.items()}).opt_state[1]
    plain = {"opt_state.1.count": torch.tensor(7), "opt_state.1.lr": adam.lr}  # not DTensors
    stored = set()
    for path, leaf in meta["leaves"].items():
        if leaf["kind"] != "tensor":
            continue
        field, _, rest = path.partition(".")
        if path in plain:  # a plain tensor: written once, by rank 0
            assert len(leaf["pieces"]) == 1, (path, leaf["pieces"], "a plain tensor is written once")
            piece = leaf["pieces"][0]
            assert RANK_FILE.fullmatch(piece["file"]).group(1, 2) == ("optimizer", "00000"), piece
            assert torch.equal(files[piece["file"]][piece["key"]], plain.pop(path)), piece
            stored.add((piece["file"], piece["key"]))
            continue
        if field == "params":
            base, full = "model", ref[rest]
        else:
            moment, name = rest.removeprefix("1.").split(".", 1)
            base, full = "optimizer", {"mu": 2 * ref[name], "nu": ref[name] * ref[name]}[moment]
        # FSDP2 shards dim 0 like torch.chunk: rank r holds rows [r * chunk, (r + 1) * chunk)
        chunk = math.ceil(full.shape[0] / 2)
        want = [(r, r * chunk, min(chunk, full.shape[0] - r * chunk)) for r in range(2)]
        want = [w for w in want if w[2] > 0]
        pieces = sorted(leaf["pieces"], key=lambda pc: pc["offset"])
        assert len(pieces) == len(want), (path, pieces)
        for piece, (rank, start, rows) in zip(pieces, want):
            m = RANK_FILE.fullmatch(piece["file"])
            assert (m[1], int(m[2])) == (base, rank), (path, piece, "in the file of the rank that owns it")
            assert piece["offset"] == [start] + [0] * (full.ndim - 1), (path, piece)
            assert piece["shape"] == [rows, *full.shape[1:]], (path, piece)
            assert torch.equal(files[piece["file"]][piece["key"]], full[start : start + rows]), (path, piece)
            stored.add((piece["file"], piece["key"]))
    assert not plain, f"not in the checkpoint: {sorted(plain)}"
    everything = {(name, key) for name, tensors in files.items() for key in tensors}
    assert stored == everything, ("tensors in the files that no leaf points to", everything - stored)


@pytest.mark.slow
def test_fsdp2_checkpoints_reshard_between_two_ranks_and_one(tmp_path):
    ref = expected_params(0)
    af.checkpoint.save(tmp_path / "from1", fill(make_state({k: v.clone() for k, v in ref.items()}), ref))

    proc = run_workers("ckpt_fsdp.py", 2, str(tmp_path), timeout=240)
    assert proc.returncode == 0, output_of(proc)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, output_of(proc)

    check_each_rank_wrote_its_own_shards(tmp_path / "from2", ref, max_shard_size=20_000)
    check_each_rank_wrote_its_own_shards(tmp_path / "from2-async", ref, max_shard_size=None)
    for name in ["from2", "from2-async"]:
        like = make_state({k: torch.zeros_like(v) for k, v in ref.items()})
        loaded = af.checkpoint.load(tmp_path / name, like=like)
        for k, v in ref.items():
            assert torch.equal(loaded.params[k], v), k
            assert torch.equal(loaded.opt_state[1].mu[k], 2 * v) and torch.equal(
                loaded.opt_state[1].nu[k], v * v
            ), k
        assert int(loaded.step) == 7 and loaded.extra["note"] == "fsdp"

    from transformers import AutoModelForCausalLM

    for name in ["hf2", "hf2-module"]:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        got = dict(hf.named_parameters())
        for k, v in ref.items():
            assert torch.equal(got[k], v), (name, k)
        assert hf.lm_head.weight is hf.transformer.wte.weight


@pytest.mark.slow
@pytest.mark.parametrize("which, caller", [("save", 0), ("save_pretrained", 0), ("save", 1)])
def test_a_save_called_on_one_rank_only_is_a_clear_error_not_a_hang(tmp_path, which, caller):
    proc = run_workers(
        "save_main_only_worker.py", 2, str(tmp_path), which, str(caller), timeout=120,
        env={"ACCELFN_COLLECTIVE_TIMEOUT": "3"},
    )  # fmt: skip
    out = output_of(proc)
    assert proc.returncode == 0, out
    found = re.search(rf"rank {caller}: OK af\.checkpoint\.{which} refused after ([0-9.]+) s", out)
    assert found, out
    # refused once ACCELFN_COLLECTIVE_TIMEOUT (3 s) ran out, not at once and not after a hang (the job's own
    # timeout is 120 s); the upper bound leaves room for a loaded 2-core CI machine
    assert 3.0 <= float(found.group(1)) < 30.0, out


@pytest.mark.slow
def test_under_debug_a_save_beside_a_training_step_is_named_on_every_rank(tmp_path):
    # rank 1 ran out of data and saves while rank 0 trains on: ACCELFN_DEBUG=1 names both, on both
    proc = run_workers("save_main_only_worker.py", 2, str(tmp_path), "save", "1", "debug", timeout=120,
                       env={"ACCELFN_DEBUG": "1"})  # fmt: skip
    out = output_of(proc)
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: OK debug names af.checkpoint.save and the training step" in out, out


@pytest.mark.slow
def test_under_debug_an_eval_of_a_sharded_model_on_rank_0_only_is_named_not_a_hang():
    proc = run_workers("eval_main_only_worker.py", 2, timeout=120, env={"ACCELFN_DEBUG": "1"})
    out = output_of(proc)
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: OK debug names the eval step and the barrier" in out, out


@pytest.mark.slow
def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    proc = run_workers("load_agree_worker.py", 2, str(tmp_path), timeout=120)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: OK every rank fell back to step 2" in out, out
