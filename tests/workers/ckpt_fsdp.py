"""2 ranks, FSDP2 (`fully_shard`): save a sharded TrainState, save_pretrained it, and load a 1-rank
checkpoint into a sharded `like`. Usage: ckpt_fsdp.py DIR (DIR/from1 was written by 1 process)."""

import sys

import torch

import accelfn as af


def expected_params(seed: int = 0) -> dict:
    from tests.models import tiny_gpt2

    torch.manual_seed(seed)
    return {k: v.detach() for k, v in tiny_gpt2(n_layer=1).named_parameters()}


def fill(state: af.TrainState, params: dict) -> af.TrainState:
    """Give the optimizer state recognisable values: mu = 2 p, nu = p * p (full or sharded alike)."""
    adam = state.opt_state[1]
    with torch.no_grad():
        for k, p in state.params.items():
            adam.mu[k].copy_(2 * p)
            adam.nu[k].copy_(p * p)
        adam.count.fill_(7)
    return state.replace(step=torch.tensor(7), rng=af.random.key(7), extra={"note": "fsdp"})


def make_state(params: dict) -> af.TrainState:
    opt = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-3))
    state = af.TrainState(step=torch.tensor(0), params=params, buffers={}, opt_state=opt.init(params),
                          rng=af.random.key(0), extra={"note": ""})  # fmt: skip
    return state


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.models import tiny_gpt2

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded_model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = tiny_gpt2(n_layer=1)
        fully_shard(model, mesh=mesh)
        return model

    # 2 ranks -> save (each rank writes its shards), and a consolidated Hugging Face export.
    model = sharded_model(0)
    params = dict(model.named_parameters())
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in params.values())
    state = fill(make_state(params), params)
    af.checkpoint.save(f"{out}/from2", state, max_shard_size="20KB")
    af.checkpoint.save(f"{out}/from2-async", state, async_save=True)
    af.checkpoint.wait()
    af.checkpoint.save_pretrained(f"{out}/hf2", state, config=model.config)
    af.checkpoint.save_pretrained(f"{out}/hf2-module", model)  # the FSDP2 module itself

    # 1 rank -> 2 ranks: load into a sharded `like` (other weights), compare with the expected full tensors.
    like = make_state(dict(sharded_model(1).named_parameters()))
    loaded = af.checkpoint.load(f"{out}/from1", like=like)
    ref = expected_params(0)
    for k, v in loaded.params.items():
        assert isinstance(v, torch.distributed.tensor.DTensor), k
        assert v is like.params[k]  # loaded in place into the module's parameters
        assert torch.equal(v.full_tensor(), ref[k]), k
        assert torch.equal(loaded.opt_state[1].mu[k].full_tensor(), 2 * ref[k]), k
        assert torch.equal(loaded.opt_state[1].nu[k].full_tensor(), ref[k] * ref[k]), k
    assert int(loaded.step) == 7 and int(loaded.opt_state[1].count) == 7 and loaded.extra["note"] == "fsdp"
    print(f"rank {rank} ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
