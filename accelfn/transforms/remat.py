"""`af.remat`: activation checkpointing per block — keep less of the forward, recompute it in the backward.

Each checkpointed block (a decoder layer) keeps only its inputs during the forward; its backward runs
the block's forward again (`torch.utils.checkpoint`, non-reentrant). Policies, as in torchtitan:

- `"full"`: recompute everything inside the block;
- `"selective"`: torchtitan's op-level selective checkpointing (`selective_ac_option="op"`, the policy of its
  published Llama 3.1 runs, torchtitan of 2024-12): save the outputs of the ops in `SELECTIVE_SAVE` (`mm`,
  the attention kernels, `reduce_scatter_tensor`, and `max` for fp8's scales) *except every second `mm`* of
  each call of a block (counted apart in the forward and in the recomputation), so a Llama layer's
  k, o and up projections (2nd, 4th and 6th of its 7 matmuls) run again in the backward, and everything else
  (norms, activations, element-wise) is recomputed. As in torchtitan, only `aten.mm` is saved and counted:
  `addmm` (a linear with a bias), `bmm` and a direct `_scaled_mm` are recomputed; under fp8 (torchao's
  float8 linears) the checkpoint sees the `mm` of the float8 tensors, not the `_scaled_mm` inside them, so
  fp8 recomputes the same projections. torchtitan's list then also had `abs` (the `abs` of `max(abs(x))`): in
  an eager block that keeps a full-size copy of every tensor cast to fp8 (+38 GiB on Table 1's 8B); compiled,
  as its fp8 runs were, the partitioner keeps only what the backward reads (the `max`), and torchtitan took
  `abs` out in 2025-02 (pytorch/torchtitan#820, for that memory): accelfn leaves it out;
- a callable `policy(op) -> bool` (save this op's output?) or returning a `torch.utils.checkpoint.CheckpointPolicy`;
  `save_matmuls` is accelfn's "selective" before 2026-11-27 (every matmul, attention and collective saved);
- `every=n`: only every n-th block (blocks n, 2n, ...), trading memory for speed;
- `memory_budget=f` (0 < f <= 1) under `af.compile`: torch's partitioner chooses what to recompute so that
  at most that fraction of the activations is kept (`torch._functorch.config.activation_memory_budget`, set
  around this step's forward and backward only).

Blocks are whole decoder layers, never children of a layer (wrapping the children keeps every layer's
inputs alive *and* the children's, which used more memory than no checkpointing in Accelerate's FSDP2 path):
the modules whose class is named in `blocks`; for a Hugging Face model, its `_no_split_modules` classes
(`LlamaDecoderLayer`) where they are items of a layer stack (`accelfn.blocks`: BERT's `BertEmbeddings` is not a
block); otherwise the items of the largest `nn.ModuleList` / `nn.Sequential`. The block is
changed in place (its `forward`), so parameter names, checkpoints and FSDP's per-block units stay as they
were. Dropout inside a recomputed block draws the same numbers again (the step's RNG state is replayed), so
remat changes memory and time, never results.

Example:
    >>> import torch, accelfn as af
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(4)])
    >>> step = af.remat(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), "selective", every=2)
    >>> state = step.init(net)
    >>> step
    Step(train_step(<lambda>) -> remat('selective', every=2)  [remat('selective') on 2 of 4 blocks (Sequential)])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from .._typecheck import checked
from ..blocks import no_split_blocks, outermost
from ..step import Step
from ._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform

__all__ = [
    "remat",
    "find_remat_blocks",
    "compile_inside",
    "SELECTIVE_SAVE",
    "MATMUL_SAVE",
    "save_matmuls",
    "selective_policy",
    "policy_contexts",
]

POLICIES = ("full", "selective")


def _ops(*names: str) -> frozenset[Any]:
    """The aten / collective overloads that exist in this torch build, by name."""
    found = []
    for name in names:
        ns, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, ns, None), op, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


# the ops whose outputs torchtitan's "op" selective checkpointing saves (torchtitan/parallelisms/
# parallelize_llama.py `_save_list`, 2024-12: the torchtitan of its published Llama 3.1 runs), but every second
# `mm` of a block (`selective_policy`). Its list names CUDA's flash and memory-efficient attention; the other
# backends' SDPA kernels (cuDNN's, the CPU's flash) stand for them on their devices. Its `abs` is left out (the
# module docs say why).
SELECTIVE_SAVE = _ops(
    "aten.mm",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",  # low precision: a tensor's amax, its fp8 scale, is cheap to keep
)
_MM = torch.ops.aten.mm.default

# accelfn's "selective" before 2026-11-27 (`save_matmuls`): every matmul, attention kernel and collective
MATMUL_SAVE = _ops(
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_mm",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_reduce",
    "_c10d_functional.all_gather_into_tensor",
)


def save_matmuls(op: Any) -> bool:
    """A `remat` policy that saves the output of every matmul, attention kernel and collective (`MATMUL_SAVE`)
    and recomputes the rest: accelfn's "selective" before 2026-11-27, more memory and less recomputation than
    torchtitan's.

    Example:
        >>> import accelfn as af
        >>> af.remat(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), save_matmuls)
        Step(train_step(<lambda>) -> remat(save_matmuls))
    """
    return op in MATMUL_SAVE


def selective_policy() -> Callable[..., Any]:
    """A fresh `"selective"` policy for one call of a checkpointed block (for
    `torch.utils.checkpoint.create_selective_checkpoint_contexts`): torchtitan's, saving the outputs of
    `SELECTIVE_SAVE` but every second `mm` of the call, counted apart in the forward and the recomputation.

    Example:
        >>> from torch.utils.checkpoint import create_selective_checkpoint_contexts
        >>> forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(selective_policy())
    """
    from torch.utils.checkpoint import CheckpointPolicy

    mms = {False: 0, True: 0}  # in the forward, in the recomputation

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == _MM:
            mms[ctx.is_recompute] += 1
        save = op in SELECTIVE_SAVE and not (op == _MM and mms[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def find_remat_blocks(module: nn.Module, classes: Sequence[str] | None = None) -> tuple[str, list[nn.Module]]:
    """The blocks to checkpoint: `(what they are, [blocks in forward order])`; outermost matches only.

    Example:
        >>> from torch import nn
        >>> what, blocks = find_remat_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
        >>> what, len(blocks)
        ('Sequential', 3)
    """
    found = [m for _, m in (outermost(module, set(classes)) if classes else no_split_blocks(module))]
    if found:
        return "/".join(sorted({type(b).__name__ for b in found})), found
    if classes:
        names = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"remat: no module of class {list(classes)} in the model; its classes are {names}")
    from .compile import find_blocks

    try:
        name, blocks = find_blocks(module)
    except ValueError:
        raise ValueError(
            "remat: the model has no repeated blocks (no nn.ModuleList/nn.Sequential of layers, and no "
            "Hugging Face `_no_split_modules`): name the block class with remat(..., blocks=['MyLayer'])"
        ) from None
    return name if name else type(blocks).__name__, list(blocks)


def _policy_fn(policy: str | Callable[..., Any]) -> Callable[..., Any] | None:
    from torch.utils.checkpoint import CheckpointPolicy

    if policy == "full":
        return None
    assert callable(policy)
    chooser = policy

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        choice = chooser(op)
        if isinstance(choice, CheckpointPolicy):
            return choice
        return CheckpointPolicy.MUST_SAVE if choice else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")


def _cache_dropper(
    forward: Callable[..., Any],
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """For a Hugging Face layer: a function that removes its key/value cache from a call's arguments (passed
    by name or by position). The recomputation would append the keys and values to the cache a second time and
    attend over both (transformers turns `use_cache` off under gradient checkpointing for the same reason); in
    a training forward the cache starts empty, so results are unchanged. None for layers without a cache."""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    names = [n for n in sig.parameters if n in _CACHE_ARGS or n == "use_cache"]
    if not names:
        return None

    def drop(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = sig.bind_partial(*args, **kwargs)
        for n in names:
            if n in bound.arguments and bound.arguments[n] is not None:
                bound.arguments[n] = False if n == "use_cache" else None
        return bound.args, bound.kwargs

    return drop


def _function_modes() -> list[Any]:
    """The torch function modes active now (context parallel's attention), but torch's DeviceContext, which
    torch's checkpoint already re-enters."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]


def _recompute_under(modes: list[Any], inner: Callable[[], Any] | None) -> tuple[Any, Any]:
    """Checkpoint contexts that run the recomputation under the function modes of the original forward: torch
    recomputes in the backward, where they are no longer active, and the recomputation must do what the forward
    did (context parallel's attention over all-gathered keys, not this rank's alone)."""
    fwd, rec = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with rec, contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            yield

    return fwd, recompute()


def policy_contexts(policy: str | Callable[..., Any], *, always: bool = False) -> Callable[[], Any] | None:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for a `remat` policy: None for "full" (recompute
    everything), or with `always=True` a context that marks every op to recompute (what Dynamo gives a plain
    checkpoint in a compiled region); "selective" makes a fresh policy (its own `mm` counter) per call.

    Example:
        >>> forward_ctx, recompute_ctx = policy_contexts("selective")()
        >>> policy_contexts("full") is None
        True
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if policy == "selective":  # a counter per call of the block: a fresh policy each time
        return lambda: create_selective_checkpoint_contexts(selective_policy())
    decide = _policy_fn(policy)
    if decide is None and always:
        decide = lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
    return functools.partial(create_selective_checkpoint_contexts, decide) if decide else None


def checkpoint_in_place(block: nn.Module, policy: str | Callable[..., Any]) -> None:
    """Make `block`'s forward checkpointed (only while gradients are recorded), keeping the module as it is."""
    from torch.utils.checkpoint import checkpoint

    if getattr(block, "_accelfn_remat", None) is not None:
        return  # lowered again (a second init): already checkpointed
    original = block.forward
    drop_cache = _cache_dropper(original)
    context_fn = policy_contexts(policy)

    inner = [original]  # what the checkpoint runs: the block's own forward, or it compiled (compile_inside)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner[0](*args, **kwargs)
        modes = _function_modes()
        fn = functools.partial(_recompute_under, modes, context_fn) if modes else context_fn
        extra: dict[str, Any] = {"context_fn": fn} if fn is not None else {}
        if drop_cache is not None:
            args, kwargs = drop_cache(args, kwargs)
        return checkpoint(inner[0], *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    object.__setattr__(block, "forward", forward)
    object.__setattr__(block, "_accelfn_remat", policy)
    object.__setattr__(block, "_accelfn_remat_inner", inner)


def compile_inside(block: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Run `wrap(forward)` (a compiled forward) inside a block's checkpoint: the compiled region is the block's
    own forward and the checkpoint stays eager around it, recomputing the compiled forward in the backward.

    Example:
        >>> import torch
        >>> block = torch.nn.Linear(2, 2)
        >>> checkpoint_in_place(block, "full")
        >>> compile_inside(block, lambda f: f)
    """
    inner = getattr(block, "_accelfn_remat_inner", None)
    if inner is None:
        raise ValueError(f"compile_inside: {type(block).__name__} is not checkpointed by af.remat")
    inner[0] = wrap(inner[0])


@attrs.frozen(eq=False)
class Remat(TransformBase):
    policy: str | Callable[..., Any] = "full"
    every: int = 1
    blocks: tuple[str, ...] | None = None
    memory_budget: float | None = None
    kind: str = "activation_checkpointing"

    def _policy_name(self) -> str:
        return (
            repr(self.policy)
            if isinstance(self.policy, str)
            else getattr(self.policy, "__name__", "callable")
        )

    def describe(self) -> str:
        if self.memory_budget is not None:
            return f"remat(memory_budget={self.memory_budget})"
        args = [self._policy_name()]
        if self.every != 1:
            args.append(f"every={self.every}")
        if self.blocks:
            args.append(f"blocks={list(self.blocks)}")
        return f"remat({', '.join(args)})"

    def check(self, others: Sequence[Transform]) -> None:
        if self.memory_budget is not None and find(others, "compile") is None:
            raise conflict_without_compile(self)
        shard = find(others, "shard")
        if (
            shard is not None
            and getattr(shard, "backend", "torch") == "deepspeed"
            and self.memory_budget is not None
        ):
            raise conflict(self, shard, "DeepSpeed runs the step eagerly; a memory budget needs af.compile")

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            return
        if self.memory_budget is not None:
            import torch._functorch.config as functorch_config

            # torch's partitioner reads a process-global setting when it compiles (during this step's first
            # forward): set it around this step's own forward and backward only, so that no other compile in the
            # process inherits the budget
            budget = functools.partial(functorch_config.patch, activation_memory_budget=self.memory_budget)
            plan.forward_contexts.append(budget)
            plan.backward_contexts.append(budget)
            plan.notes.append(
                f"activation memory budget {self.memory_budget} (the compiler chooses what to save)"
            )
            return
        what, blocks = find_remat_blocks(plan.module, self.blocks)
        chosen = [b for i, b in enumerate(blocks) if (i + 1) % self.every == 0]
        for block in chosen:
            checkpoint_in_place(block, self.policy)
        plan.notes.append(f"remat({self._policy_name()}) on {len(chosen)} of {len(blocks)} blocks ({what})")


def conflict_without_compile(r: Remat) -> ValueError:
    from ..lowering import CompositionError

    return CompositionError(
        f"{r.describe()} needs af.compile: the memory budget is applied by torch.compile's partitioner "
        "(use policy='full'/'selective' to checkpoint an eager step)"
    )


@checked
def remat(
    step: Step,
    policy: str | Callable[..., Any] = "full",
    *,
    every: int = 1,
    blocks: Sequence[str] | None = None,
    memory_budget: float | None = None,
) -> Step:
    """Activation checkpointing per block: `policy` "full", "selective" or `callable(op) -> bool`; see the
    module docs.

    Example:
        >>> import accelfn as af
        >>> af.remat(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), "full")
        Step(train_step(<lambda>) -> remat('full'))
    """
    if isinstance(policy, str) and policy not in POLICIES:
        raise ValueError(f"remat: policy must be one of {POLICIES} or a callable(op) -> bool, got {policy!r}")
    if every < 1:
        raise ValueError(f"remat: every must be >= 1 (checkpoint every n-th block), got {every}")
    if memory_budget is not None:
        if not 0 < memory_budget <= 1:
            raise ValueError(
                f"remat: memory_budget must be in (0, 1] (a fraction of the activations), got {memory_budget}"
            )
        if policy != "full" or every != 1 or blocks:
            raise ValueError(
                "remat: memory_budget lets the compiler choose what to save; do not also pass policy, every or blocks"
            )
    if isinstance(blocks, str):
        blocks = [blocks]
    return step.with_transform(Remat(policy, every, tuple(blocks) if blocks else None, memory_budget))
