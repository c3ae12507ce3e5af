"""Big-model inference: meta init, device maps, loading with CPU/disk offload, pipeline, estimate-memory."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from _launch import ROOT, output_of, run_workers
from models import tiny_gpt2, tiny_llama
from torch import nn

import accelfn as af
from accelfn.big.device_map import layout_of
from accelfn.big.dispatch import MissingWeightsError

RSS = """
import json, os
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
"""


def run_python(code: str, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", RSS + textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- init_empty ---------------------------------------------------------------------------------------------


def test_init_empty_builds_a_1_5b_gpt2_with_almost_no_memory():
    out = run_python("""
        import torch, accelfn as af
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=48, n_embd=1600, n_head=25)
        before = rss(); reset_peak()
        with af.init_empty():
            model = GPT2LMHeadModel(cfg)
        print(json.dumps({"grown": rss() - before, "peak": peak() - before,
                          "params": sum(p.numel() for p in model.parameters()),
                          "meta": all(p.is_meta for p in model.parameters())}))
    """)
    assert out["meta"] and out["params"] > 1.5e9
    assert out["grown"] < 50e6, out
    assert out["peak"] < 100e6, out


def test_init_empty_keeps_buffers_unless_asked():
    with af.init_empty():
        bn = nn.BatchNorm1d(4)
    assert bn.weight.is_meta and not bn.running_mean.is_meta
    with af.init_empty(include_buffers=True):
        bn = nn.BatchNorm1d(4)
    assert bn.running_mean.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is undone on exit


class Odd(nn.Module):
    """Parameters that are not plain trainable ones, and a non-persistent buffer."""

    class Tagged(nn.Parameter):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)
        self.sub = Odd.Tagged(torch.ones(2, 2))
        tagged = nn.Parameter(torch.ones(4))
        tagged.no_weight_decay = True  # a Python attribute on a parameter (Megatron, mamba, ... do this)
        self.register_parameter("tagged", tagged)
        self.register_buffer("scale", torch.arange(3.0))
        self.register_buffer("cache", torch.ones(2), persistent=False)
        self.plain = torch.ones(2)  # neither a parameter nor a buffer: created as usual


def test_init_on_device_puts_parameters_on_the_device_and_buffers_only_when_asked():
    with af.init_on_device("meta"):
        m = Odd()
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Embedding(5, 3))
    params = dict(m.named_parameters()) | dict(net.named_parameters())
    assert len(params) == 8 and all(p.is_meta and isinstance(p, nn.Parameter) for p in params.values()), {
        k: (type(p).__name__, p.device) for k, p in params.items()
    }
    assert [(p.shape, p.dtype) for p in net.parameters()] == [
        (p.shape, p.dtype)
        for p in nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Embedding(5, 3)).parameters()
    ]
    assert not m.frozen.requires_grad and m.tagged.requires_grad, "requires_grad is kept"
    assert type(m.sub) is Odd.Tagged and m.tagged.no_weight_decay is True, "the class and attributes are kept"
    # buffers (include_buffers=False) and other tensors stay real, with their values
    assert (
        m.scale.tolist() == [0.0, 1.0, 2.0]
        and m.cache.tolist() == [1.0, 1.0]
        and m.plain.device.type == "cpu"
    )
    assert net[1].running_var.tolist() == [1.0] * 4 and net[1].num_batches_tracked.device.type == "cpu"

    with af.init_on_device(torch.device("meta"), include_buffers=True):
        m = Odd()
        bn = nn.BatchNorm1d(4)
    assert all(b.is_meta for b in [*m.buffers(), *bn.buffers()]) and len(list(bn.buffers())) == 3
    assert m.frozen.is_meta and not m.plain.is_meta
    assert "cache" not in m.state_dict() and "scale" in m.state_dict(), "persistence is kept"


def test_init_on_device_undoes_its_patch_on_exit_even_after_an_error():
    with pytest.raises(RuntimeError, match="boom"), af.init_on_device("meta", include_buffers=True):
        nn.Linear(2, 2)
        raise RuntimeError("boom")
    bn = nn.BatchNorm1d(2)
    assert not bn.weight.is_meta and not bn.running_mean.is_meta
    with af.init_on_device("cpu"):  # the device it would be on anyway: nothing changes
        lin = nn.Linear(2, 2)
    assert lin.weight.device.type == "cpu" and type(lin.weight) is nn.Parameter


# ---- sizes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n",
    [
        ("0", 0),
        ("100", 100),
        ("100B", 100),
        ("1KB", 1000),
        ("1MB", 10**6),
        ("1.5GB", 1_500_000_000),
        ("2TB", 2 * 10**12),
        ("1KiB", 1024),
        ("2 MiB", 2 * 2**20),
        (" 1GiB ", 2**30),
        ("0.5GiB", 2**29),
        ("1TiB", 2**40),
        (".5KB", 500),
    ],
)
def test_parse_size_decimal_units_are_powers_of_1000_and_binary_of_1024(text, n):
    assert af.big.parse_size(text) == n


def test_parse_size_takes_ints_as_bytes():
    assert af.big.parse_size(0) == 0 and af.big.parse_size(12345) == 12345
    with pytest.raises(ValueError, match="size = -1 is negative"):
        af.big.parse_size(-1)
    for bad in (True, 1.5, None, b"1GB"):
        with pytest.raises(TypeError, match=f"got {type(bad).__name__}"):
            af.big.parse_size(bad)


@pytest.mark.parametrize("bad", ["", "GB", "ten MB", "1.5.2GB", "-1GB", "1e3MB", "10 GiBs", "5 PB", "1 KB B"])
def test_parse_size_of_a_bad_string_names_the_value_and_the_units(bad):
    with pytest.raises(ValueError) as err:
        af.big.parse_size(bad, "max_memory['cuda:0']")
    msg = str(err.value)
    assert f"max_memory['cuda:0'] = {bad!r} is not a size" in msg, msg
    assert "KB, MB, GB, TB (powers of 1000)" in msg and "KiB, MiB, GiB, TiB (powers of 1024)" in msg, msg


# ---- device maps ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)  # 288 B each

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    """embed 320 B, 4 blocks of 576 B, a head tied to embed (0 B of its own): 2624 B."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


MAX_MEMORY = {"cuda:0": 1500, "cuda:1": 1000, "cpu": 800}


def test_module_sizes_are_exact_and_count_tied_weights_once():
    layout = layout_of(Net())
    assert layout.size[""] == 2624 and layout.size["blocks.0"] == 576 and layout.size["head"] == 0
    assert layout.ties == [["embed.weight", "head.weight"]]
    assert layout_of(Net(), dtype=torch.float16).size[""] == 1312


def test_device_map_fills_devices_in_order_and_reserves_room_for_offloaded_layers():
    # cuda:0 keeps 576 B (the largest offloaded block) free: embed (320) + blocks.0 (576) fill it.
    got = af.infer_device_map(Net(), max_memory=MAX_MEMORY, no_split=["Block"])
    assert got == {"embed": "cuda:0", "head": "cuda:0", "blocks.0": "cuda:0", "blocks.1": "cuda:1",
                   "blocks.2": "cpu", "blocks.3": "disk"}  # fmt: skip


def test_device_map_splits_modules_not_listed_in_no_split():
    got = af.infer_device_map(Net(), max_memory=MAX_MEMORY, no_split=[])
    assert any(k.count(".") == 2 for k in got), got  # some block was split into its Linear layers
    placed = {k: v for k, v in got.items() if k.startswith("blocks.")}
    assert sum(layout_of(Net()).size[k] for k in placed if placed[k] in ("cuda:0", "cuda:1", "cpu")) > 3 * 576


def test_device_map_keeps_tied_weights_together():
    got = af.infer_device_map(Net(), max_memory={"cuda:0": 100, "cpu": 10_000}, no_split=["Block"])
    assert got["embed"] == got["head"] == "cpu"


def test_device_map_respects_a_disk_budget_and_says_when_nothing_is_left():
    # Net (2624 B, blocks of 576 B): with "disk": 0 the last block cannot go to disk
    assert (
        af.infer_device_map(Net(), max_memory=MAX_MEMORY, no_split=["Block"])["blocks.3"] == "disk"
    )  # no limit
    got = af.infer_device_map(Net(), max_memory={**MAX_MEMORY, "disk": 600}, no_split=["Block"])
    assert got["blocks.3"] == "disk"  # 576 B fit the 600 B of disk
    with pytest.raises(
        ValueError, match=r"'blocks.3' \(576 B\) fits in none of max_memory's devices .*disk: 0 B of 0 B"
    ):
        af.infer_device_map(Net(), max_memory={**MAX_MEMORY, "disk": 0}, no_split=["Block"])
    with pytest.raises(ValueError, match="fits in none"):
        af.infer_device_map(Net(), max_memory={**MAX_MEMORY, "disk": 500}, no_split=["Block"])


def test_device_map_puts_everything_on_one_device_when_it_fits():
    assert af.infer_device_map(Net(), max_memory={"cuda:0": 10**6, "cpu": 10**6}) == {"": "cuda:0"}


def test_balanced_strategy_spreads_over_accelerators():
    got = af.infer_device_map(Net(), max_memory={"cuda:0": 10**6, "cuda:1": 10**6, "cpu": 0}, no_split=["Block"],
                              strategy="balanced")  # fmt: skip
    assert set(got.values()) == {"cuda:0", "cuda:1"}
    assert got["blocks.3"] == "cuda:1" and got["blocks.0"] == "cuda:0"


def _bytes_per_tier(device_map, layout):
    tiers = {"accelerators": 0, "accelerators+cpu": 0}
    for name, device in device_map.items():
        size = layout.size.get(name, 0)
        if device not in ("cpu", "disk"):
            tiers["accelerators"] += size
        if device != "disk":
            tiers["accelerators+cpu"] += size
    return tiers


def _check_placement(model, device_map, max_memory):
    """Independently of `layout_of`: every weight is covered by exactly one entry of `device_map` (so every
    module is placed once, whole or through its parts), tied weights share a device, and each device's bytes
    (each tensor counted once, from the module's own parameters and buffers) stay within its `max_memory`."""
    keys = list(device_map)
    modules = dict(model.named_modules())
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    tensor_names = {n for n, _ in tensors}
    for k in keys:
        assert k in modules or k in tensor_names, f"{k!r} is no module or tensor of the model"
        assert not any(o != k and (o == "" or k.startswith(o + ".")) for o in keys), f"{k!r} is placed twice"

    def covering(name):
        return [k for k in keys if k == "" or name == k or name.startswith(k + ".")]

    device_of: dict[int, str] = {}
    for name, t in tensors:
        cover = covering(name)
        assert len(cover) == 1, f"{name!r} is placed by {cover}"
        device = device_map[cover[0]]
        assert device_of.setdefault(id(t), device) == device, f"tied {name!r} is split over two devices"
    used = dict.fromkeys(["cuda:0", "cuda:1", "cpu", "disk"], 0)
    for t in {id(t): t for _, t in tensors}.values():
        used[device_of[id(t)]] += t.numel() * t.element_size()
    for device, size in used.items():
        if device != "disk":
            assert size <= max_memory[device], (device, size, max_memory[device], device_map)
    return used


@pytest.mark.parametrize("no_split", [["Block"], []])
def test_device_map_places_at_least_as_much_as_accelerate(no_split):
    from accelerate import infer_auto_device_map

    ours = af.infer_device_map(Net(), max_memory=MAX_MEMORY, no_split=no_split)
    theirs = infer_auto_device_map(
        Net(), max_memory={0: 1500, 1: 1000, "cpu": 800}, no_split_module_classes=no_split
    )
    theirs = {k: f"cuda:{v}" if isinstance(v, int) else v for k, v in theirs.items()}
    layout = layout_of(Net())
    mine, acc = _bytes_per_tier(ours, layout), _bytes_per_tier(theirs, layout)
    assert mine["accelerators"] >= acc["accelerators"] and mine["accelerators+cpu"] >= acc["accelerators+cpu"], (
        ours, theirs)  # fmt: skip
    assert ours["embed"] == ours["head"]
    used = _check_placement(Net(), ours, MAX_MEMORY)
    assert used["cuda:0"] + used["cuda:1"] == mine["accelerators"]  # layout_of agrees with the count here


def test_device_map_of_a_gpt2_places_at_least_as_much_as_accelerate():
    from accelerate import infer_auto_device_map

    with af.init_empty():
        model = tiny_gpt2(n_layer=6)
    block = layout_of(model).size["transformer.h.0"]
    limits = [3 * block, 2 * block, 2 * block]
    ours = af.infer_device_map(model, max_memory=dict(zip(["cuda:0", "cuda:1", "cpu"], limits)))
    theirs = infer_auto_device_map(
        model, max_memory=dict(zip([0, 1, "cpu"], limits)), no_split_module_classes=["GPT2Block"]
    )
    theirs = {k: f"cuda:{v}" if isinstance(v, int) else v for k, v in theirs.items()}
    layout = layout_of(model)
    mine, acc = _bytes_per_tier(ours, layout), _bytes_per_tier(theirs, layout)
    assert mine["accelerators"] >= acc["accelerators"] and mine["accelerators+cpu"] >= acc["accelerators+cpu"]
    assert ours["lm_head"] == ours["transformer.wte"] and not any(k.count(".") > 2 for k in ours)
    used = _check_placement(model, ours, dict(zip(["cuda:0", "cuda:1", "cpu"], limits)))
    assert used["cuda:0"] + used["cuda:1"] == mine["accelerators"]


def test_device_map_must_place_every_weight():
    with pytest.raises(ValueError, match="'blocks.0.a.weight'"):
        af.dispatch(Net(), {"embed": "cpu", "head": "cpu"})


def test_device_map_of_10k_modules_takes_under_a_second():
    with af.init_empty():
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64))
                                for _ in range(2000)])  # fmt: skip
    assert sum(1 for _ in model.modules()) > 10_000
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        got = af.infer_device_map(model, max_memory={"cuda:0": "10MB", "cuda:1": "10MB", "cpu": "20MB"})
        best = min(best, time.perf_counter() - t0)
    assert set(got.values()) == {"cuda:0", "cuda:1", "cpu", "disk"}
    # not quadratic in the modules (well under 1 s alone; CI runs two test files at once)
    assert best < 2.5, best


@pytest.mark.parametrize("bad", ["10 gigs", "GB", "1.5.2GB", "-1GB", "10 GiBs"])
def test_max_memory_strings_that_do_not_parse_are_named(bad):
    with pytest.raises(ValueError, match=f"max_memory\\['cpu'\\] = '{bad}'"):
        af.infer_device_map(Net(), max_memory={"cpu": bad})


def test_max_memory_sizes_parse_in_both_unit_systems():
    from accelfn.big import parse_max_memory

    assert parse_max_memory({"cpu": "1KB", "cuda:0": "1KiB", "disk": 5}) == {
        "cuda:0": 1024,
        "cpu": 1000,
        "disk": 5,
    }
    with pytest.raises(ValueError, match="'gpu0'"):
        parse_max_memory({"gpu0": 10})


# ---- load_and_dispatch ------------------------------------------------------------------------------------


def _save_sharded(model, folder: Path, shards: int = 3) -> None:
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    size = total // shards + 1
    while True:
        model.save_pretrained(folder, max_shard_size=size)
        n = len(list(folder.glob("model-*.safetensors")))
        if n >= shards:
            break
        for f in folder.glob("model*"):
            f.unlink()
        size = int(size * 0.9)
    assert (folder / "model.safetensors.index.json").exists()


def _skeleton(model):
    with af.init_empty():
        return type(model)(model.config)


@pytest.mark.parametrize("make", [lambda: tiny_gpt2(n_layer=4), tiny_llama], ids=["gpt2", "llama"])
def test_load_and_dispatch_with_cpu_and_disk_offload_gives_identical_logits(make, tmp_path):
    torch.manual_seed(0)
    model = make().eval()
    _save_sharded(model, tmp_path / "ckpt")
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    total = layout_of(model).size[""]
    big = _skeleton(model).eval()
    big = af.load_and_dispatch(big, tmp_path / "ckpt", max_memory={"cpu": total // 2})
    device_map = af.infer_device_map(_skeleton(model), max_memory={"cpu": total // 2})
    assert set(device_map.values()) == {"cpu", "disk"}
    with torch.no_grad():
        got = big(ids).logits
    assert torch.equal(got, expected)
    on_disk = [n for n, p in big.named_parameters(remove_duplicate=False)
               if af.big.device_map.resolve_device(device_map, n) == "disk"]  # fmt: skip
    assert on_disk and all(big.get_parameter(n).is_meta for n in on_disk)  # back on meta between forwards
    with torch.no_grad():
        assert torch.equal(big(ids).logits, expected)


def test_tied_weights_are_loaded_once_and_tied(tmp_path):
    model = tiny_gpt2().eval()
    model.save_pretrained(tmp_path)
    big = af.load_and_dispatch(_skeleton(model), tmp_path, {"": "cpu"})
    assert big.lm_head.weight is big.transformer.wte.weight and not big.lm_head.weight.is_meta


def test_an_accelfn_training_checkpoint_loads_for_inference(tmp_path):
    model = tiny_gpt2().eval()
    state = af.train_step(lambda m, b: m(b).logits.sum(), af.optim.adamw(1e-3)).init(model)
    af.checkpoint.save(
        tmp_path / "step-1", state, max_shard_size="20KB"
    )  # params sharded beside optimizer files
    big = af.load_and_dispatch(_skeleton(model), tmp_path / "step-1", {"": "disk"})
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(big(ids).logits, model(ids).logits)


def test_disk_weights_in_another_dtype_go_to_the_offload_folder(tmp_path):
    model = tiny_gpt2().eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = model.double()(ids).logits
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "disk",
                  "transformer.ln_f": "disk", "lm_head": "cpu"}  # fmt: skip
    with pytest.raises(ValueError, match="offload_folder"):
        af.load_and_dispatch(_skeleton(model), tmp_path / "ckpt", device_map, dtype=torch.float64)
    big = af.load_and_dispatch(_skeleton(model), tmp_path / "ckpt", device_map, dtype=torch.float64,
                               offload_folder=tmp_path / "off")  # fmt: skip
    assert list((tmp_path / "off").glob("*.safetensors"))
    with torch.no_grad():
        assert torch.equal(big(ids).logits, expected)
    # the dtype's name, as transformers' torch_dtype and Accelerate take it
    named = af.load_and_dispatch(_skeleton(model), tmp_path / "ckpt", device_map, dtype="torch.float64",
                                 offload_folder=tmp_path / "off2")  # fmt: skip
    with torch.no_grad():
        assert torch.equal(named(ids).logits, expected)
    assert af.infer_device_map(_skeleton(model), max_memory={"cpu": "1GiB"}, dtype="bf16") == af.infer_device_map(
        _skeleton(model), max_memory={"cpu": "1GiB"}, dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="dtype='bfloat61' is not a torch dtype name"):
        af.infer_device_map(_skeleton(model), dtype="bfloat61")


def test_peak_host_memory_stays_within_cpu_share_plus_one_shard(tmp_path):
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1000, n_positions=64, n_embd=256, n_layer=12, n_head=4)
    model = GPT2LMHeadModel(cfg).eval()  # ~39 MB; built here so that the loading process starts clean
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="8MB")
    ids = torch.randint(0, 1000, (1, 16))
    with torch.no_grad():
        save_file({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.safetensors")
    out = run_python(f"""
        import torch, accelfn as af
        from safetensors.torch import load_file
        from transformers import GPT2Config, GPT2LMHeadModel
        expected = load_file({str(tmp_path / "expected.safetensors")!r})
        tiny = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=64, n_embd=8, n_layer=1, n_head=2)).eval()
        with torch.no_grad():  # torch's and transformers' one-off allocations of a first forward, not weights
            tiny(expected["ids"] % 8)
        with af.init_empty():
            big = GPT2LMHeadModel(GPT2Config.from_pretrained({str(tmp_path / "ckpt")!r})).eval()
        before = rss(); reset_peak()
        big = af.load_and_dispatch(big, {str(tmp_path / "ckpt")!r}, max_memory={{"cpu": "20MB"}})
        with torch.no_grad():
            got = big(expected["ids"]).logits
        on_cpu = sum(p.numel() * p.element_size() for p in big.parameters() if not p.is_meta)
        print(json.dumps({{"peak": peak() - before, "on_cpu": on_cpu, "diff": (got - expected["logits"]).abs().max().item()}}))
    """)
    size = sum(p.numel() * 4 for p in model.parameters())
    shards = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))
    largest_shard = max(f.stat().st_size for f in shards)
    # computed in two processes: the same weights to fp32 round-off (kernels may differ by machine and thread count)
    assert len(shards) >= 3 and out["diff"] < 1e-4 and out["on_cpu"] > 10e6, out
    budget = out["on_cpu"] + largest_shard  # what is placed on the CPU plus one shard
    print(f"peak RSS growth {out['peak'] / 1e6:.1f} MB, on cpu {out['on_cpu'] / 1e6:.1f} MB, "
          f"budget {budget / 1e6:.1f} MB, model {size / 1e6:.1f} MB")  # fmt: skip
    assert out["peak"] < budget < size, (out, budget)


def test_checkpoint_missing_a_key_is_named(tmp_path):
    from safetensors.torch import save_file

    state = {k: v for k, v in Net().state_dict().items() if k not in ("blocks.2.a.bias", "head.weight")}
    save_file(state, tmp_path / "model.safetensors")
    with af.init_empty():
        net = Net()
    with pytest.raises(MissingWeightsError, match="blocks.2.a.bias"):
        af.load_and_dispatch(net, tmp_path, {"": "cpu"})


def test_device_map_naming_an_unknown_device_is_an_error(tmp_path):
    from safetensors.torch import save_file

    state = dict(Net().state_dict())
    state.pop("head.weight")
    save_file(state, tmp_path / "model.safetensors")
    for bad in ("cuda:7", "gpu", 3):
        with af.init_empty():
            net = Net()
        with pytest.raises(ValueError, match="not a device of this process"):
            af.load_and_dispatch(net, tmp_path, {"embed": "cpu", "blocks": bad, "head": "cpu"})
    with pytest.raises(ValueError, match="'blocks.9'"):
        af.dispatch(Net(), {"blocks.9": "cpu", "": "cpu"})


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        af.load_and_dispatch(Net(), tmp_path / "nothing-here", {"": "cpu"})


# ---- dispatch / cpu_offload of loaded models --------------------------------------------------------------


def test_dispatch_of_a_loaded_model_offloads_to_disk(tmp_path):
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 10, (3, 5))
    expected = model(ids)
    model = af.dispatch(model, {"embed": "cpu", "head": "cpu", "blocks.0": "cpu", "blocks": "disk"},
                        offload_folder=tmp_path)  # fmt: skip
    assert model.blocks[1].a.weight.is_meta and not model.blocks[0].a.weight.is_meta
    assert torch.equal(model(ids), expected)
    assert model.blocks[3].b.weight.is_meta


def test_two_models_offloaded_to_one_folder_keep_their_own_weights(tmp_path):
    # both dispatches write a file to the same offload folder: the second must not replace the first's (the
    # first model then silently computed with the second one's weights)
    def mk(seed, out):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, out)).eval()

    x = torch.randn(3, 8)
    a, b = mk(0, 2), mk(1, 4)
    expected_a, expected_b = a(x).detach(), b(x).detach()
    a = af.dispatch(a, {"0": "cpu", "2": "disk"}, offload_folder=tmp_path)
    b = af.dispatch(b, {"0": "cpu", "2": "disk"}, offload_folder=tmp_path)
    assert len(list(tmp_path.glob("offload-*.safetensors"))) == 2
    assert a.hf_device_map == {"0": "cpu", "2": "disk"}  # as Accelerate's dispatch_model records it
    with torch.no_grad():
        assert torch.equal(a(x), expected_a) and torch.equal(b(x), expected_b)
    # the files a dispatch wrote go with its model (a re-run notebook cell filled the disk): remove_hooks
    # without restoring deletes them, and so does freeing the model
    af.big.remove_hooks(a, restore=False)
    assert len(list(tmp_path.glob("offload-*.safetensors"))) == 1
    del b
    import gc

    gc.collect()
    assert not list(tmp_path.glob("offload-*.safetensors"))
    c = af.dispatch(mk(2, 3), {"0": "cpu", "2": "disk"}, offload_folder=tmp_path)
    af.big.remove_hooks(c)  # restored from its file, which stays while the model uses it
    assert len(list(tmp_path.glob("offload-*.safetensors"))) == 1 and c[2].weight.shape == (3, 8)


def test_load_and_dispatch_warns_of_unused_tensors_and_checks_max_memory_devices(tmp_path):
    torch.manual_seed(0)
    bigger = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    safetensors.torch.save_file(bigger.state_dict(), str(tmp_path / "model.safetensors"))
    with af.init_empty():
        smaller = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
    with pytest.warns(
        UserWarning, match=r"has 2 tensors the model has no place for: '2.bias', '2.weight'"
    ) as rec:
        af.load_and_dispatch(smaller, tmp_path, {"": "cpu"})
    assert rec[0].filename == __file__  # points at the caller
    with af.init_empty():
        smaller = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
    with pytest.raises(
        ValueError, match=r"max_memory\['cuda:0'\] = 'cuda:0' is not a device of this process"
    ):
        af.load_and_dispatch(smaller, tmp_path, max_memory={"cuda:0": "500KB", "cpu": "1MB"})


def _hook_counts(model):
    return {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}


def test_cpu_offload_brings_weights_in_only_while_a_layer_runs(monkeypatch):
    # With no accelerator, `cpu_offload(model, "cpu")` rightly offloads nothing: the weights already are where
    # the model runs. "cpu:0" stands in for an accelerator here: an execution device other than host memory,
    # so the real offload path runs (host copy, meta placeholders, fetch/release hooks) on any machine.
    monkeypatch.setattr(sys.modules["accelfn.big.dispatch"], "_device_name", lambda value, where: "cpu:0")
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 10, (3, 5))
    expected = model(ids)
    original = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    mine = model.blocks[0].a.register_forward_pre_hook(lambda m, args: None)  # a user's hook: must survive
    before = _hook_counts(model)

    assert af.cpu_offload(model, "cpu:0") is model
    holders = {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    hooked = {n for n, counts in _hook_counts(model).items() if counts != before[n]}
    assert hooked == holders == {"embed", "head"} | {f"blocks.{i}.{ab}" for i in range(4) for ab in "ab"}
    assert all(p.is_meta for p in model.parameters())  # between calls: placeholders, the data is on the host

    seen = {}  # what each layer holds while it runs (these hooks run after cpu_offload's)

    def record(prefix):
        def hook(module, args):
            for local, p in module.named_parameters(recurse=False):
                seen[f"{prefix}.{local}"] = p.detach().clone()

        return hook

    for name in holders:
        model.get_submodule(name).register_forward_pre_hook(record(name))
    for _ in range(2):
        seen.clear()
        assert torch.equal(model(ids), expected)
        assert seen.keys() == original.keys()
        for n, p in seen.items():
            assert p.device.type == "cpu" and torch.equal(p, original[n]), n  # on the execution device
        assert all(p.is_meta for p in model.parameters())  # dropped again after each layer ran

    af.big.remove_hooks(model)  # cpu_offload's hooks go; the user's (`mine`, `record`) stay
    assert _hook_counts(model) == {n: (pre + (n in holders), post) for n, (pre, post) in before.items()}
    assert mine.id in model.blocks[0].a._forward_pre_hooks
    assert not any("_accelfn_big_hooks" in m.__dict__ for m in model.modules())
    # the weights come back from where they were kept, so the model runs on its own again
    assert not any(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight  # tied weights stay tied
    seen.clear()
    assert torch.equal(model(ids), expected) and seen.keys() == original.keys()


def test_remove_hooks_without_restore_leaves_placeholders(monkeypatch):
    monkeypatch.setattr(sys.modules["accelfn.big.dispatch"], "_device_name", lambda value, where: "cpu:0")
    model = af.cpu_offload(Net(), "cpu:0")
    af.big.remove_hooks(model, restore=False)
    assert all(p.is_meta for p in model.parameters()) and model(torch.randint(0, 10, (3, 5))).is_meta


def test_cpu_offload_onto_the_host_keeps_the_weights_where_they_run():
    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 10, (3, 5))
    expected = model(ids)
    model = af.cpu_offload(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert all(counts == (0, 0) for counts in _hook_counts(model).values())
    assert torch.equal(model(ids), expected)


# ---- pipeline and distributed inference ---------------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_on_two_ranks_equals_one_process():
    proc = run_workers("pipeline_worker.py", 2, timeout=180)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PIPELINE OK") == 2, output_of(proc)
    assert proc.stdout.count("PIPELINE GPT-2 OK") == 2, output_of(proc)


def test_pipeline_rejects_a_wrong_number_of_split_points():
    with af.Mesh.from_env() as mesh, pytest.raises(ValueError, match="2 split points make 3 stages"):
        af.pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["0", "1"], mesh, example_args=(torch.ones(4, 2),),
                    axis="dp")  # fmt: skip


# ---- estimate-memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_folder", [False, True], ids=["file", "folder"])
def test_estimate_memory_from_a_config(tmp_path, capsys, as_folder):
    from accelfn.cli.main import main

    model = tiny_gpt2()
    model.config.to_json_file(tmp_path / "config.json")
    path = tmp_path if as_folder else tmp_path / "config.json"
    assert main(["estimate-memory", str(path), "--dtypes", "float32", "bfloat16"]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in model.parameters())
    expected = af.big.format_size(n * 4 + sum(b.numel() * b.element_size() for b in model.buffers()))
    assert f"| float32 | {expected} |" in out
    assert f"| bfloat16 | {af.big.format_size(n * 2)} |" in out
    assert f"| {af.big.format_size(n * (4 + 4 + 8))} |" in out  # fp32 training: weights, grads, 2 moments


def test_estimate_memory_builds_the_class_architectures_names(tmp_path, capsys):
    # as from_pretrained would (a T5 seq2seq model is not a causal LM: this printed the bare T5Model)
    from transformers import T5Config, T5ForConditionalGeneration

    from accelfn.cli.main import main

    config = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=96)
    config.architectures = ["T5ForConditionalGeneration"]
    config.to_json_file(tmp_path / "config.json")
    assert main(["estimate-memory", str(tmp_path), "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    model = T5ForConditionalGeneration(config)
    n = sum(p.numel() for p in model.parameters())
    assert "T5ForConditionalGeneration" in out and f"{n / 1e6:,.2f}M parameters" in out, out


_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _assert_printed_size(printed: str, expected: float) -> None:
    """`printed` (as `format_size` writes it: 0 decimals in B, else 2) is `expected` bytes up to its rounding."""
    number, unit = printed.split()
    decimals = 0 if unit == "B" else 2
    tolerance = 0.5 * 10**-decimals * _UNIT[unit]
    assert abs(float(number) * _UNIT[unit] - expected) <= tolerance + 1e-9, (printed, expected)


def test_estimate_memory_from_a_factory(capsys, monkeypatch):
    from accelfn.cli.main import main

    monkeypatch.chdir(ROOT)
    dtypes = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.5}
    assert main(["estimate-memory", "tests.models:tiny_llama", "--dtypes", *dtypes]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out

    model = tiny_llama()  # the same model, built for real, counted here without layout_of or the CLI's code
    unique = list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    n = sum(t.numel() for t in unique if t.is_floating_point())  # weights (and float buffers) take the dtype
    other = sum(t.numel() * t.element_size() for t in unique if not t.is_floating_point())
    assert n > 20_000 and f"{n / 1e6:,.2f}M parameters" in out
    # the largest piece that runs at once: a decoder layer (no_split), the embedding or the head
    pieces = [*model.model.layers, model.model.embed_tokens, model.lm_head]
    largest = max(sum(p.numel() for p in piece.parameters()) for piece in pieces)
    assert largest == sum(p.numel() for p in model.model.layers[0].parameters())
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:5]] for r in out.splitlines()
            if r.startswith("| ") and r.split("|")[1].strip() in dtypes}  # fmt: skip
    assert rows.keys() == dtypes.keys(), out
    for dtype, b in dtypes.items():
        total, layer, training = rows[dtype]
        _assert_printed_size(total, n * b + other)
        _assert_printed_size(layer, largest * b)
        # AdamW: weights and grads in the dtype, two fp32 moments, an fp32 master copy below fp32
        _assert_printed_size(training, n * (2 * b + 8 + (4 if b < 4 else 0)) + other)


def test_no_split_takes_one_class_name_as_a_string_and_refuses_names_of_no_module():
    # Accelerate takes a single class name; iterating the string letter by letter split every block
    with af.init_empty():
        model = Net()
    budget = {"cpu": "1KiB", "disk": "1GiB"}
    as_list = af.infer_device_map(model, max_memory=budget, no_split=[type(model.blocks[0]).__name__])
    assert as_list != af.infer_device_map(model, max_memory=budget, no_split=[])  # (what "B", "l", ... gave)
    assert af.infer_device_map(model, max_memory=budget, no_split=type(model.blocks[0]).__name__) == as_list
    with pytest.raises(ValueError, match=r"no_split=\['Blokc'\] names no class of this model's modules"):
        af.infer_device_map(model, max_memory=budget, no_split=["Blokc"])


def test_load_and_dispatch_with_no_disk_budget_never_offloads_to_disk(tmp_path):
    # max_memory={"disk": 0}: nothing goes to disk; a model that does not fit elsewhere is an error naming
    # max_memory (Accelerate ignores the value of its "disk" key and offloads to disk anyway)
    from accelerate import infer_auto_device_map

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=4).eval()
    _save_sharded(model, tmp_path / "ckpt")
    total = layout_of(model).size[""]
    tight = {"cpu": total // 2, "disk": 0}
    with pytest.raises(ValueError, match=r"fits in none of max_memory's devices .*disk: 0 B of 0 B.*'disk'"):
        af.load_and_dispatch(_skeleton(model), tmp_path / "ckpt", max_memory=tight)
    assert "disk" in infer_auto_device_map(_skeleton(model), max_memory=tight).values()  # Accelerate's
    big = af.load_and_dispatch(
        _skeleton(model).eval(), tmp_path / "ckpt", max_memory={"cpu": 2 * total, "disk": 0}
    )
    assert "disk" not in big.hf_device_map.values()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(big(ids).logits, model(ids).logits)
    roomy = af.infer_device_map(_skeleton(model), max_memory={"cpu": total + total // 4, "disk": 0})
    assert set(roomy.values()) == {"cpu"}  # no room kept for offloaded layers when nothing can be offloaded
