"""The dry run's model of `af.compile`'s memory: each compiled block's forward and backward as the compiler splits them.

A compiled region saves for its backward what torch's min-cut partitioner chooses (the tensors AOTAutograd's
joint graph cuts at: it recomputes cheap pointwise ops in the backward instead of saving their outputs), not
what eager autograd saves. The dry run cannot run Inductor on fake tensors, but it can trace: `partition_block`
replaces a block's forward by `aot_function(forward, partition_fn=min_cut_rematerialization_partition)` whose
forward and backward graphs run op by op on the dry run's fake tensors. The tracker then sees the partitioner's
saved tensors as the block's activations (exact for the partitioner torch ships), and the graphs' other tensors
as temporaries. Inductor also fuses chains of pointwise ops, whose intermediates never exist: here they do,
one op at a time, so a compiled step's transient peak is an estimate from above (as eager's).

Identical blocks (same class, parameter shapes, arguments, remat) share one traced graph, as Inductor's cache does.
Under `af.remat` the block's checkpoint goes inside the traced region, as `torch.compile` of a checkpointed block
puts it (the real engine compiles the block with its checkpoint; torchtitan compiles the checkpoint-wrapped
block): the policy tags each op of the joint graph, the partitioner recomputes what is tagged to recompute and
saves a must-save output only where the backward reads it. Eager SAC keeps every must-save output: under
torchtitan's policy a Llama layer's down projection (128 MiB a layer on Table 1's 8B, 4 GiB in all), which the
dry run held while it kept the eager checkpoint around the partitioned graphs.

Example:
    >>> import torch
    >>> from accelfn.dryrun.compiled import partition_block
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    >>> partition_block(block)
    True
    >>> block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> block[0].weight.grad.shape
    torch.Size([4, 4])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _python_dispatch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .timing import compiled_region

__all__ = ["partition_block", "saved_bytes"]

_Key = tuple[Any, ...]
# each graph with the world whose process groups its collectives name (None: it holds none, any world runs it)
_GRAPHS: dict[_Key, tuple[Callable[..., Any], Any]] = {}
_ORDERS: dict[_Key, list[str]] = {}  # the state's names in the order the block's forward first uses them


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (type(t), tuple(t.shape), t.dtype, t.requires_grad)


def _kind(block: nn.Module) -> _Key:
    """What the traced graph of a block depends on besides its inputs: its modules' classes (a layer whose linears
    torchao made float8 has the same parameters as a plain one) and settings, and its `af.remat` policy (every=n:
    checkpointed blocks beside plain ones)."""
    modules = tuple((type(m), repr(getattr(m, "config", None))) for m in block.modules())
    return modules, repr(getattr(block, "_accelfn_remat", None))


def _key(kind: _Key, names: list[str], tensors: list[torch.Tensor], spec: Any, consts: list[Any]) -> _Key:
    return (
        kind,
        tuple(names),
        tuple(_meta(t) for t in tensors),
        str(spec),
        tuple(repr(c) for c in consts),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


def _run_and_save_rng_state(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """torch's `run_and_save_rng_state` for a graph run op by op: the op, and the generator's state for the
    recomputation (the CPU generator's, 5,056 bytes; CUDA's philox seed and offset, 16), as an empty tensor of its
    size (a higher-order op would reach the dry run's dispatch modes as such)."""
    out = op(*args, **kwargs)
    device = next(t.device for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    size = torch.get_rng_state().numel() if device.type == "cpu" else 16
    return torch.empty(size, dtype=torch.uint8, device=device), out


def _run_with_rng_state(rng_state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's `run_with_rng_state` for a graph run op by op: the op (fake tensors draw no numbers)."""
    return op(*args, **kwargs)


def _eager(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """The "compiler" of the partitioned graphs: runs them op by op (on fake tensors in a dry run). A random op
    the partitioner recomputes (attention under "full" remat) comes wrapped in torch's RNG higher-order ops;
    they run as the op itself."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    plain = {run_and_save_rng_state: _run_and_save_rng_state, run_with_rng_state: _run_with_rng_state}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in plain:
            node.target = plain[node.target]
    gm.recompile()
    return make_boxed_func(gm)


def _checkpointed(forward: Callable[..., Any], policy: Any) -> Callable[..., Any]:
    """`forward` under `af.remat`'s checkpoint as Dynamo hands it to AOTAutograd in a compiled region (torch's
    `tag_activation_checkpoint`): traced, the checkpoint's policy tags each op of the joint graph (`recompute`,
    "full" preferring to recompute them all) and the partitioner honours the tags, saving a `MUST_SAVE` output
    only where the backward reads it. Eager, the checkpoint keeps every `MUST_SAVE` output, read or not."""
    from torch.utils.checkpoint import checkpoint

    from ..transforms.remat import _cache_dropper, policy_contexts

    contexts = policy_contexts(policy, always=True)
    assert contexts is not None
    drop_cache = _cache_dropper(forward)

    def with_graph_id() -> Any:  # the partitioner tells consecutive checkpoints apart by it
        forward_ctx, recompute_ctx = contexts()
        forward_ctx.ac_graph_id = 1
        return forward_ctx, recompute_ctx

    def run(*args: Any, **kwargs: Any) -> Any:
        if drop_cache is not None:
            args, kwargs = drop_cache(args, kwargs)
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=False,  # as Dynamo's: the traced graph's RNG ops are functionalized instead
            context_fn=with_graph_id,
            early_stop=False,
            **kwargs,
        )

    return run


def _use_order(
    forward: Callable[..., Any], state: dict[str, torch.Tensor], args: Any, kwargs: Any
) -> list[str]:
    """The names of `state` in the order `forward` first passes them to a torch function (those it never uses
    last): the order in which Dynamo makes a compiled block's params inputs of its graph, after the call's
    tensors. The autograd engine runs the gradient accumulations a compiled backward makes ready at once in an
    order set by its inputs' order (its ready queue ties them), so DDP's and ZeRO's gradient hooks fire in it."""
    from torch.overrides import TorchFunctionMode

    names = {id(t): n for n, t in state.items()}
    used: dict[str, None] = {}

    class FirstUse(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, a: Any = (), kw: Any = None) -> Any:
            for t in tree_flatten((a, kw or {}))[0]:
                if id(t) in names:
                    used.setdefault(names[id(t)])
            return func(*a, **(kw or {}))

    with _unwatched(), torch.no_grad(), FirstUse():
        forward(*args, **kwargs)
    return [*used, *(n for n in state if n not in used)]


def _trace(
    block: nn.Module,
    forward: Callable[..., Any],
    names: list[str],
    n_tensors: int,
    spec: Any,
    consts: list[Any],
) -> tuple[Any, list[Any]]:
    """`forward` as AOTAutograd's partitioned graphs over (the call's `n_tensors` tensors, then the state in
    `names`' order): the order of Dynamo's graph's inputs; and, once it is traced, the world its collectives
    belong to (in a list: empty where it holds none)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.nn.utils.stateless import _reparametrize_module

    def fn(*flat: torch.Tensor) -> Any:
        tensors = iter(flat[:n_tensors])
        args, kwargs = tree_unflatten([next(tensors) if c is _TENSOR else c for c in consts], spec)
        with _reparametrize_module(block, dict(zip(names, flat[n_tensors:], strict=True))):
            return forward(*args, **kwargs)

    worlds: list[Any] = []  # the world whose groups the forward's collectives name (cp's all-gathers), if any

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if _holds_collectives(gm):
            worlds.append(_world())
        return _eager(gm, example_inputs)

    graph = aot_function(
        fn, fw_compiler=fw_compiler, bw_compiler=_eager, partition_fn=min_cut_rematerialization_partition
    )
    return graph, worlds


def _holds_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls functional collectives, which name their process group (by a name of its world)."""
    return any(
        n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
        for n in gm.graph.nodes
    )


def _world() -> Any:
    """The default process group (a dry run's fake world; None without one)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()


def _traceable(t: Any) -> bool:
    """Plain (or fake) tensors, and torchao's float8 tensors (its weights under FSDP's fp8 all-gather), which
    AOTAutograd traces through as torch.compile does: their `_scaled_mm`s and casts land in the graph."""
    if type(t) in (torch.Tensor, nn.Parameter) or type(t).__name__ == "FakeTensor":
        return True
    return type(t).__module__.startswith("torchao.float8")


def _holds_untraced_modules(block: nn.Module) -> bool:
    """Transformer Engine's modules: graph breaks under torch.compile (their blocks stay eager there)."""
    return any(type(m).__module__.startswith("transformer_engine") for m in block.modules())


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    """No dispatch modes (the tracker, FLOP counting) but the run's fake mode, no global module hooks (FLOP
    counting's module tracker puts gradient hooks on module outputs, which AOTAutograd's `autograd.grad` over the
    joint graph refuses), and no saved-tensor hooks (an enclosing checkpoint's). The fake mode stays: without it
    a factory call (`torch.arange`, context parallel's positions) made a real tensor of the job's size."""
    from torch.nn.modules import module as m

    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    saved = [(d, dict(d)) for d in (m._global_forward_pre_hooks, m._global_forward_hooks)]
    for d, _ in saved:
        d.clear()
    try:
        # identity hooks: an enclosing checkpoint's must not see the trace's saved tensors
        with (
            _python_dispatch._disable_current_modes(),
            fake if fake is not None else contextlib.nullcontext(),
            torch.autograd.graph.saved_tensors_hooks(_same, _same),
        ):
            yield
    finally:
        for d, items in saved:
            d.update(items)


def partition_block(block: nn.Module) -> bool:
    """Run `block`'s forward (and its backward) as the partitioned graphs of a compiled region; True if done.

    False (the block stays eager) where its parameters are tensor subclasses other than torchao's float8 ones
    (DTensor under tensor parallel) or it holds Transformer Engine's modules. torchao's float8 linears are traced
    through, as torch.compile traces them (checked against Inductor on CPU with `emulate=True`). A checkpoint `af.remat` put on the block is traced with it (`_checkpointed`); calls that
    cannot be traced (no gradients, tensor subclasses as inputs) run the eager checkpoint.
    """
    if getattr(block, "_accelfn_partitioned", False):
        return True
    state0 = dict(block.named_parameters()) | dict(block.named_buffers())
    if not all(_traceable(t) for t in state0.values()) or _holds_untraced_modules(block):
        if not getattr(block, "_accelfn_region", False):  # still compiled: its ops fuse in the time model
            object.__setattr__(block, "forward", _in_region(block.forward))
            object.__setattr__(block, "_accelfn_region", True)
        return False
    remat = getattr(block, "_accelfn_remat", None)
    eager = block.forward  # af.remat's eager checkpoint, if any: for calls that cannot be traced
    # the checkpoint goes inside the traced region, as torch.compile of a checkpointed block puts it
    inner: list[Callable[..., Any]] | None = getattr(block, "_accelfn_remat_inner", None)
    forward = eager if remat is None or inner is None else _checkpointed(inner[0], remat)

    kind = _kind(block)

    def partitioned(*args: Any, **kwargs: Any) -> Any:
        state = dict(block.named_parameters()) | dict(block.named_buffers())
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not torch.is_grad_enabled() or not all(_traceable(t) for t in [*state.values(), *tensors]):
            with compiled_region():
                return eager(*args, **kwargs)
        consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        key = _key(kind, list(state), [*state.values(), *tensors], spec, consts)
        names = _ORDERS.get(key)
        if names is None:
            names = _ORDERS[key] = _use_order(eager, state, args, kwargs)
        flat = [*tensors, *(state[n] for n in names)]  # as Dynamo orders its graph's inputs
        graph, world = _GRAPHS.get(key, (None, None))
        if graph is None or (
            world is not None and world is not _world()
        ):  # a graph of another dry run's groups
            graph, worlds = _trace(block, forward, names, len(tensors), spec, consts)
            with _unwatched():  # tracing is not this step's memory or FLOPs
                graph(*[t.detach().requires_grad_(t.requires_grad) for t in flat])
            _GRAPHS[key] = graph, (worlds[0] if worlds else None)
        with compiled_region():
            return graph(*flat)

    object.__setattr__(block, "forward", partitioned)
    object.__setattr__(block, "_accelfn_partitioned", True)
    return True


def _in_region(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run inside `compiled_region` (a compiled block the dry run cannot partition: its time still
    counts as compiled)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with compiled_region():
            return forward(*args, **kwargs)

    return run


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `fn()` runs (`fn`'s forward).

    Example:
        >>> import torch
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> saved_bytes(lambda: (torch.randn(2, 4) @ w).relu())
        64
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
