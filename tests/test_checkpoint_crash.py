"""A save killed with SIGKILL at a random moment never damages the previous checkpoint."""

import os
import random
import signal
import time

import pytest
import torch

import accelfn as af


def state_at(i: int) -> af.TrainState:
    params = {f"layer{j}.weight": torch.full((128, 256), float(i)) for j in range(6)}
    opt = ({"mu": {k: torch.full_like(v, -float(i)) for k, v in params.items()}},)
    return af.TrainState(step=torch.tensor(i), params=params, buffers={}, opt_state=opt, rng=af.random.key(i))


def save_forever(root, current) -> None:
    i = 0
    while True:
        i += 1
        state = state_at(i)
        af.checkpoint.save(root / f"step-{i}", state, keep_last=2, max_shard_size="300KB")
        af.checkpoint.save(current, state, max_shard_size="300KB")


def check_consistent(path, like) -> int:
    state = af.checkpoint.load(path, like=like)
    i = int(state.step)
    assert all(torch.equal(p, torch.full_like(p, float(i))) for p in state.params.values()), path
    assert all(torch.equal(m, torch.full_like(m, -float(i))) for m in state.opt_state[0]["mu"].values()), path
    assert torch.equal(state.rng, af.random.key(i))
    return i


@pytest.mark.slow
def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    rng = random.Random(0)
    like = state_at(0)
    deadline = time.monotonic() + 20  # at least 20 trials; more while time allows
    trials = interrupted = 0
    while trials < 20 or (trials < 40 and time.monotonic() < deadline):
        root, current = tmp_path / f"run{trials}", tmp_path / f"current{trials}"
        pid = os.fork()
        if pid == 0:  # the child saves until it is killed
            try:
                save_forever(root, current)
            finally:
                os._exit(1)
        while not current.exists():  # the first pair of saves is committed
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        trials += 1
        leftovers = [p for p in [*root.iterdir(), *tmp_path.iterdir()] if p.name.startswith(".tmp-")]
        interrupted += any(p.name.startswith((".tmp-step-", f".tmp-{current.name}-")) for p in leftovers)

        newest = af.checkpoint.latest(root)
        assert newest is not None
        assert check_consistent(newest, like) >= 1
        for p in root.iterdir():  # every visible folder is a complete checkpoint
            if not p.name.startswith("."):
                check_consistent(p, like)
        check_consistent(current, like)
    assert trials >= 20
    print(f"{trials} trials, {interrupted} killed mid-save")
    assert interrupted >= trials // 4  # most kills land inside a save
