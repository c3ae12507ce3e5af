"""af.random: explicit keys (split, fold_in), the seeds and generators derived from them, and `seeded`."""

import pytest
import torch

import accelfn as af

R = af.random


def words(k: torch.Tensor) -> int:
    """A key as the 64-bit integer it encodes (high word, low word)."""
    hi, lo = k.tolist()
    return (hi << 32) | lo


def rows(keys: torch.Tensor) -> list[tuple[int, int]]:
    return [tuple(r) for r in keys.tolist()]


# ---- keys ----------------------------------------------------------------------------------------------------
def test_key_is_a_two_word_int64_cpu_tensor_and_deterministic():
    k = R.key(0)
    assert k.shape == (2,) and k.dtype == torch.int64 and k.device.type == "cpu"
    assert all(0 <= w < 2**32 for w in k.tolist())
    assert torch.equal(R.key(0), R.key(0))
    assert not torch.equal(R.key(0), R.key(1))


def test_key_is_the_splitmix64_hash_of_the_seed():
    """Pinned to the published splitmix64 sequence (Vigna's reference, seed 1234567), so that a key -- and
    with it every dropout mask of a run -- stays the same across accelfn versions."""
    assert words(R.key(1234567)) == 6457827717110365317
    assert words(R.key(0)) == 0xE220A8397B1DCDAF


def test_key_rejects_non_int_seeds():
    with pytest.raises(TypeError, match="seed must be an int"):
        R.key(1.0)
    with pytest.raises(TypeError, match="seed must be an int"):
        R.key(True)


@pytest.mark.parametrize("fn", [lambda k: R.split(k), lambda k: R.fold_in(k, 1), R.seed_of, R.generator])
def test_functions_taking_a_key_reject_something_else(fn):
    with pytest.raises(TypeError, match="expected an accelfn random key"):
        fn(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="expected an accelfn random key"):
        fn(torch.zeros(2))  # float, not int64


# ---- split ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_split_gives_n_distinct_keys_other_than_the_parent(n):
    k = R.key(42)
    keys = R.split(k, n)
    assert keys.shape == (n, 2) and keys.dtype == torch.int64
    got = rows(keys)
    assert len(set(got)) == n
    assert tuple(k.tolist()) not in got
    for sub in keys:  # each row is itself a valid key
        assert sub.shape == (2,) and all(0 <= w < 2**32 for w in sub.tolist())
        R.seed_of(sub)


def test_split_default_is_two_and_deterministic():
    k = R.key(3)
    assert R.split(k).shape == (2, 2)
    assert torch.equal(R.split(k), R.split(k, 2))
    assert torch.equal(R.split(k, 4), R.split(R.key(3), 4))  # same key -> same subkeys
    assert not set(rows(R.split(k, 4))) & set(rows(R.split(R.key(4), 4)))  # other key -> other subkeys


def test_split_does_not_modify_its_input():
    k = R.key(5)
    before = k.clone()
    R.split(k, 3)
    R.fold_in(k, 7)
    assert torch.equal(k, before)


def test_split_keys_split_again_without_collisions():
    seen = set()
    frontier = [R.key(0)]
    for _ in range(4):
        frontier = [sub for k in frontier for sub in R.split(k, 3)]
        seen.update(tuple(k.tolist()) for k in frontier)
    assert len(seen) == 3 + 9 + 27 + 81


# ---- fold_in -------------------------------------------------------------------------------------------------
def test_fold_in_is_deterministic_and_data_dependent():
    k = R.key(0)
    assert torch.equal(R.fold_in(k, 3), R.fold_in(k, 3))
    derived = [tuple(R.fold_in(k, d).tolist()) for d in range(100)]
    assert len(set(derived)) == 100  # different data -> different keys
    assert tuple(k.tolist()) not in derived
    assert R.fold_in(k, 3).shape == (2,) and R.fold_in(k, 3).dtype == torch.int64
    assert not torch.equal(R.fold_in(k, 3), R.fold_in(R.key(1), 3))  # different key, same data


def test_fold_in_never_returns_the_parent_and_keys_and_data_do_not_commute():
    """The documented per-rank pattern `fold_in(key(seed), rank)`: rank 0 of seed 0 must not reuse the
    parent's stream, and (seed a, rank b) must not collide with (seed b, rank a)."""
    for s in range(16):
        parent = tuple(R.key(s).tolist())
        assert all(tuple(R.fold_in(R.key(s), d).tolist()) != parent for d in range(16)), s
    all_keys = {tuple(R.fold_in(R.key(a), b).tolist()) for a in range(16) for b in range(16)}
    assert len(all_keys) == 16 * 16
    assert not all_keys & {tuple(R.key(s).tolist()) for s in range(256)}


def test_fold_in_accepts_large_and_tensor_data():
    k = R.key(0)
    assert torch.equal(R.fold_in(k, torch.tensor(7)), R.fold_in(k, 7))
    big = R.fold_in(k, 2**40 + 1)
    assert not torch.equal(big, R.fold_in(k, 1))
    assert not torch.equal(R.fold_in(k, -1), R.fold_in(k, 1))


# ---- seed_of / generator ----------------------------------------------------------------------------------------
def test_seed_of_is_a_63_bit_int_and_key_dependent():
    seeds = [R.seed_of(R.fold_in(R.key(0), i)) for i in range(50)]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 50
    assert R.seed_of(R.key(9)) == R.seed_of(R.key(9))


def test_generator_is_a_torch_generator_seeded_with_seed_of():
    k = R.fold_in(R.key(11), 2)
    g = R.generator(k)
    assert isinstance(g, torch.Generator) and g.device.type == "cpu"
    assert g.initial_seed() == R.seed_of(k)
    ref = torch.Generator().manual_seed(R.seed_of(k))  # independent reference
    assert torch.equal(torch.rand(100, generator=g), torch.rand(100, generator=ref))
    assert torch.equal(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=ref))


def test_generator_is_reproducible_and_independent_of_the_global_rng():
    k = R.key(7)
    torch.manual_seed(1)
    a = torch.rand(50, generator=R.generator(k))
    torch.manual_seed(2)
    torch.rand(1000)  # move the global generator along
    b = torch.rand(50, generator=R.generator(k))
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.rand(50, generator=R.generator(R.key(8))))
    # drawing from it leaves the global generator where it was
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    torch.rand(50, generator=R.generator(k))
    assert torch.equal(torch.rand(5), expected)


def test_generators_of_split_keys_draw_different_streams():
    a, b = R.split(R.key(0))
    assert not torch.equal(torch.rand(20, generator=R.generator(a)), torch.rand(20, generator=R.generator(b)))


# ---- seeded --------------------------------------------------------------------------------------------------
def test_seeded_makes_global_draws_reproducible_from_the_key():
    k = R.key(21)
    torch.manual_seed(100)
    with R.seeded(k):
        a = torch.rand(10)
        a_drop = torch.nn.functional.dropout(torch.ones(64), 0.5)
    torch.manual_seed(200)
    torch.rand(33)
    with R.seeded(k):
        b = torch.rand(10)
        b_drop = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(a, b) and torch.equal(a_drop, b_drop)
    # the global generator is seeded with seed_of(k): the same draws as the key's own generator
    assert torch.equal(a, torch.rand(10, generator=R.generator(k)))
    with R.seeded(R.key(22)):
        assert not torch.equal(torch.rand(10), a)


def test_seeded_restores_the_global_rng_state_afterwards():
    torch.manual_seed(5)
    expected = torch.rand(8)  # what the caller draws without the context
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    with R.seeded(R.key(0)):
        torch.rand(1000)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(torch.rand(8), expected)


def test_seeded_restores_the_global_rng_state_when_the_block_raises():
    torch.manual_seed(5)
    expected = torch.rand(8)
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match="boom"), R.seeded(R.key(0)):
        torch.rand(10)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(8), expected)


def test_seeded_nests():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with R.seeded(R.key(1)):
        outer = torch.rand(3)
        with R.seeded(R.key(2)):
            torch.rand(100)
        outer_next = torch.rand(3)
    assert torch.equal(torch.rand(4), expected)
    g = R.generator(R.key(1))
    assert torch.equal(outer, torch.rand(3, generator=g))
    assert torch.equal(outer_next, torch.rand(3, generator=g))  # the inner block did not disturb the outer


@pytest.mark.parametrize(
    "devices",
    [[], [torch.device("cpu")], [torch.device("cpu"), torch.device("meta")]],
    ids=["none", "cpu", "cpu+meta"],
)
def test_seeded_with_cpu_devices(devices):
    k = R.key(4)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with R.seeded(k, devices):
        a = torch.rand(6)
    assert torch.equal(torch.rand(4), expected)
    with R.seeded(k, devices=devices):
        b = torch.rand(6)
    assert torch.equal(a, b) and torch.equal(a, torch.rand(6, generator=R.generator(k)))


class RecordingPlatform:
    """Stands in for an accelerator's platform adapter: records what `seeded` does to its generators."""

    def __init__(self):
        self.calls = []

    def get_rng_state(self, device):
        self.calls.append(("get", device))
        return f"state-of-{device}"

    def manual_seed(self, seed):
        self.calls.append(("seed", seed))

    def set_rng_state(self, state, device):
        self.calls.append(("set", state, device))


@pytest.mark.parametrize("raises", [False, True], ids=["ok", "raises"])
def test_seeded_seeds_the_accelerators_among_devices_and_restores_them(monkeypatch, raises):
    fake = RecordingPlatform()
    kinds = []
    monkeypatch.setattr(af.platforms, "for_device", lambda device: kinds.append(device.type) or fake)
    k = R.key(6)
    devs = [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)]
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    try:
        with R.seeded(k, devs):
            assert fake.calls == [
                ("get", torch.device("cuda", 0)),
                ("get", torch.device("cuda", 1)),
                ("seed", R.seed_of(k)),
            ]
            if raises:
                raise KeyError("boom")
    except KeyError:
        assert raises
    assert kinds == ["cuda"]
    assert sorted(c for c in fake.calls if c[0] == "set") == [
        ("set", "state-of-cuda:0", torch.device("cuda", 0)),
        ("set", "state-of-cuda:1", torch.device("cuda", 1)),
    ]
    assert torch.equal(torch.rand(4), expected)  # the CPU generator is restored too


class BytePlatform:
    """An accelerator adapter whose generators are 16-byte states (as CUDA's Philox seed and offset)."""

    def __init__(self):
        self.states = {}

    def get_rng_state(self, device):
        return self.states.get(device, torch.zeros(16, dtype=torch.uint8))

    def set_rng_state(self, state, device):
        assert state.dtype == torch.uint8 and state.device.type == "cpu"
        self.states[device] = state


def test_generator_states_round_trip_the_cpu_and_accelerator_generators(monkeypatch):
    # what a pipeline stage sends the next one: later draws equal those of one process going on
    fake = BytePlatform()
    monkeypatch.setattr(af.platforms, "for_device", lambda device: fake)
    devs = [torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda", 0)]
    fake.states = {d: torch.full((16,), i + 1, dtype=torch.uint8) for i, d in enumerate(devs[1:])}
    torch.manual_seed(3)
    torch.rand(5)
    states = R.generator_states(devs)
    cpu = torch.random.default_generator.get_state()
    assert states.dtype == torch.uint8 and states.numel() == cpu.numel() + 32
    assert torch.equal(states[: cpu.numel()], cpu)  # the CPU's, then the accelerators' in device order
    assert states[cpu.numel() :].tolist() == [2] * 16 + [1] * 16
    going_on = torch.rand(7)
    torch.manual_seed(99)
    fake.states = {}
    R.set_generator_states(states, devs)
    assert torch.equal(torch.rand(7), going_on)
    assert fake.states[torch.device("cuda", 1)].tolist() == [1] * 16
    assert fake.states[torch.device("cuda", 0)].tolist() == [2] * 16
    with pytest.raises(
        ValueError, match=r"set_generator_states: 5056 torch.uint8 values for generators of \[5056, 16, 16\]"
    ):
        R.set_generator_states(cpu, devs)


def test_seeded_without_accelerators_does_not_touch_platforms(monkeypatch):
    monkeypatch.setattr(
        af.platforms, "for_device", lambda d: pytest.fail(f"platforms.for_device({d!r}) called")
    )
    with R.seeded(R.key(0), [torch.device("cpu"), torch.device("meta")]):
        torch.rand(1)
    with R.seeded(R.key(0)):
        torch.rand(1)


@pytest.mark.gpu
def test_seeded_seeds_and_restores_the_cuda_generator():
    dev = torch.device("cuda", torch.cuda.current_device())
    k = R.key(4)
    torch.cuda.manual_seed(5)
    expected = torch.rand(4, device=dev)
    torch.cuda.manual_seed(5)
    cpu_before = torch.random.get_rng_state()
    with R.seeded(k, [dev]):
        a = torch.rand(6, device=dev)
    assert torch.equal(torch.rand(4, device=dev), expected)  # CUDA state restored
    assert torch.equal(torch.random.get_rng_state(), cpu_before)  # and the CPU one
    torch.rand(7, device=dev)
    with R.seeded(k, [dev]):
        b = torch.rand(6, device=dev)
    assert torch.equal(a, b)
    assert torch.equal(a, torch.rand(6, device=dev, generator=R.generator(k, dev)))
    with R.seeded(k):  # without the device: the CUDA generator is not touched
        c = torch.rand(6, device=dev)
    assert not torch.equal(a, c)
