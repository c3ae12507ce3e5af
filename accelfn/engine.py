"""The run-time of a lowered step: one training step as a fixed pipeline over a `Plan`.

    bind params -> for each micro-batch: forward (autocast, seeded RNG) + backward
    -> gradient sync (shard) -> normalise by the global count, unscale (fp16), skip on inf
    -> clip -> optimizer update (fused, in place; offloaded if asked) -> new state

Combinators set fields of the `Plan` at lowering time (`accelfn.lowering`); this file decides when each
runs. What they plug in runs at fixed places of this pipeline: `grad_sync` (shard), `updater` (offload),
`after_update` hooks (e.g. torchao's fp8 scale refresh under FSDP), forward contexts (autocast, fp8), and
`train_override`, with which a backend that owns the whole step (DeepSpeed) replaces `_train`.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import optree
import torch
from torch import nn

from . import random as _random
from . import tree as _tree
from .losses import Loss
from .module import Slots, bind, read_buffers, slots_of
from .optim import GradientTransformation, apply_gradients, learning_rate
from .optim.base import apply_gradients_on_shards, is_dtensor
from .optim.clip import clip_, global_norm
from .state import TrainState

__all__ = [
    "Plan", "GradSync", "Updater", "LossScaleConfig", "run_train", "run_eval", "check_batch", "loss_parts", "place_batch",
]

LossFn = Callable[[nn.Module, Any], Any]


class GradSync(Protocol):
    """How gradients meet across data-parallel ranks (set by `af.shard`)."""

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum `grads` in place, and `loss_sum` and `count`, over the data-parallel ranks."""
        ...

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of (possibly sharded) gradients."""
        ...

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Average metric scalars over the data-parallel ranks."""
        ...

    # Optional: `any_rank(flag) -> flag`, the maximum of a 0-d flag over the ranks (sharded gradients);
    # `max_over_ranks(x) -> x`, the maximum of a 0-d tensor over the data-parallel ranks;
    # `record_unused(names, missing)` before `reduce`, which then raises when the ranks left different params
    # without a gradient;
    # `microbatch(last) -> context manager`; `prepare(params)` before the backward passes.


class Updater(Protocol):
    """Runs the optimizer update (set by `af.offload`; the default applies in place on the params).

    Returns the new optimizer state and the new `state.extra` (where an updater keeps its own state, e.g.
    host master params, so that it is checkpointed and never outlives the state it belongs to).
    """

    def __call__(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
        extra: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]: ...

    # Optional: `overlapped(tx, state) -> context manager`, entered around the whole step (the delayed update of
    # `af.offload` runs during the forward and backward; it completes into `state` if the step fails or skips).


@attrs.frozen
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (same defaults as `torch.amp.GradScaler`).

    Example:
        >>> import torch, accelfn as af
        >>> cfg = af.LossScaleConfig(init_scale=1024.0, growth_interval=100)
        >>> base = af.train_step(lambda m, b: m(b).float().sum(), af.optim.sgd(0.1))
        >>> af.autocast(base, "fp16", loss_scale=cfg).init(torch.nn.Linear(2, 1)).extra["loss_scale"]["scale"].item()
        1024.0
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@attrs.define(eq=False)  # identity semantics: plans are tracked in a WeakSet
class Plan:
    """Everything a lowered step needs at run time. Built by `Step.init`, filled in by the combinators."""

    module: nn.Module
    kind: str
    fn: LossFn
    optimizer: GradientTransformation | None = None
    clip_grad_norm: float | None = None
    donate: bool = True
    microbatches: int = 1
    uneven: bool = False
    autocast_dtype: torch.dtype | None = None
    autocast_device_type: str = "cpu"
    loss_scale: LossScaleConfig | None = None
    forward_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = attrs.Factory(list)
    # entered around each backward too (tensor parallel's loss_parallel: the loss's backward on vocabulary shards)
    backward_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = attrs.Factory(list)
    grad_sync: GradSync | None = None
    loss_call: LossFn | None = None
    updater: Updater | None = None
    after_update: list[Callable[[nn.Module], None]] = attrs.Factory(list)
    batch_transform: Callable[[Any], Any] | None = None
    rank_key: int | None = None
    notes: list[str] = attrs.Factory(list)
    transforms: list[Any] = attrs.Factory(list)
    train_override: Callable[[Plan, TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]] | None = None
    opt_state_init: Callable[[dict[str, torch.Tensor]], Any] | None = None  # a backend's own optimizer state
    backend: Any = None  # the handle of a backend that owns the step (e.g. the DeepSpeed engine's run)
    slots: Slots | None = None
    devices: list[torch.device] = attrs.Factory(list)
    opt_state_type: type | None = None  # what `init` built: a state from another step is refused
    # Where the model computes once lowered: the mesh's device under `af.shard` (a model built on the host is
    # moved there at lowering), else the model's own device. Known *before* the transforms lower, so that every
    # device-dependent decision (fp8 support, TE, autocast's device type, pinning) sees the device the model will
    # run on, not the host it was built on.
    device: torch.device = attrs.Factory(lambda: torch.device("cpu"))
    input_device: torch.device | None = None  # where host batch tensors are moved (None: left where they are)
    fp8_skipped: dict[str, str] = attrs.Factory(dict)  # Linear layers autocast_fp8 kept in high precision, and why
    # trainable params mixing DTensors with plain tensors (tensor parallel): the update runs on local shards
    update_on_shards: bool = False

    @property
    def platform(self) -> Any:
        """The `af.platforms.Platform` of `device`."""
        from . import platforms

        try:
            return platforms.for_device(self.device)
        except ValueError:
            return platforms.get("cpu")

    def finalize(self) -> None:
        """Record where the (possibly rewritten) module's tensors live. Called after lowering."""
        self.slots = slots_of(self.module)
        named = dict(self.module.named_parameters())
        self.update_on_shards = len({is_dtensor(named[n]) for n in self.slots.trainable if n in named}) == 2
        tensors = [*self.module.parameters(), *self.module.buffers()]
        self.devices = sorted({t.device for t in tensors}, key=str)
        computing = [d for d in self.devices if d.type != "meta"]
        # one device holds the whole model: batches go there (a model spread over devices by a device map moves
        # its inputs itself, through its hooks)
        self.input_device = computing[0] if len(computing) == 1 else None
        if self.autocast_dtype is not None:  # autocast where the (lowered, possibly moved) model computes
            kinds = {d.type for d in computing} - {"cpu"}
            self.autocast_device_type = (
                kinds.pop() if len(kinds) == 1 else self.platform.autocast_device_type if not kinds else "cpu"
            )
        if self.loss_call is None:
            self.loss_call = self.fn
        if self.kind == "train":
            _TRAINING.add(self)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.autocast_device_type, dtype=self.autocast_dtype))
            for make in self.forward_contexts:
                stack.enter_context(make())
            yield


# ---- several models ---------------------------------------------------------------------------------------
_TRAINING: weakref.WeakSet[Plan] = weakref.WeakSet()  # the lowered training steps of this process


@contextlib.contextmanager
def exclusive(plan: Plan, state: TrainState | None = None) -> Iterator[None]:
    """While `plan` runs, the trainable params of the process's *other* training steps stop requiring grad.

    A loss may use another step's model (a GAN's discriminator, a teacher): its parameters then get no
    gradient and fire none of their hooks (DDP buckets, DeepSpeed ZeRO reductions), while gradients still
    flow through it to this step's params. Free when there is only one training step. A `state` whose params
    are another step's (its `init` made it) is refused: this step would train that step's model.
    """
    if len(_TRAINING) < 2:
        yield
        return
    own = {id(p) for p in plan.module.parameters()}
    frozen = [
        p for other in list(_TRAINING) if other is not plan
        for p in other.module.parameters() if p.requires_grad and id(p) not in own
    ]
    if state is not None and frozen:
        theirs = {id(p) for p in frozen}
        foreign = [n for n, t in state.params.items() if id(t) in theirs]
        if foreign:
            raise ValueError(
                f"this state belongs to another training step: its params {foreign[:3]} are that step's model's "
                "(the step whose init made the state). Pass this step's own state (from its init), or a copy of "
                "the other (`af.tree.map(torch.clone, state)`) to start from its values"
            )
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


# ---- the training step --------------------------------------------------------------------------------------
def run_train(plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
    with exclusive(plan, state):
        if plan.train_override is not None:  # a backend that owns the whole step (DeepSpeed)
            return plan.train_override(plan, state, batch)
        if not plan.donate:
            state = _tree.map(_clone, state)
        overlapped = getattr(plan.updater, "overlapped", None)
        if overlapped is None:
            return _train(plan, state, batch)
        assert plan.optimizer is not None
        with overlapped(plan.optimizer, state):  # an update running during this step's forward and backward
            return _train(plan, state, batch)


def _train(plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
    assert plan.optimizer is not None and plan.slots is not None and plan.loss_call is not None
    module, slots = plan.module, plan.slots
    if plan.opt_state_type is not None and type(state.opt_state) is not plan.opt_state_type:
        raise ValueError(
            f"state.opt_state is a {type(state.opt_state).__name__}, but this step's optimizer keeps a "
            f"{plan.opt_state_type.__name__}: pass the state returned by this step's init() or its last call "
            "(not one from another step, e.g. an eval_step)"
        )
    if plan.batch_transform is not None:
        batch = plan.batch_transform(batch)
    batch = place_batch(batch, plan.input_device)
    params = bind(module, state.params, state.buffers, slots)
    _check_trainable(params, slots.trainable)
    prepare = getattr(plan.grad_sync, "prepare", None)
    if prepare is not None:
        prepare(params)
    if not module.training:
        module.train()
    keys = _random.split_list(state.rng, 2)
    step_key = keys[1] if plan.rank_key is None else _random.fold_in(keys[1], plan.rank_key)
    micro = [batch] if plan.microbatches == 1 else split_batch(batch, plan.microbatches, plan.uneven)
    for n in slots.trainable:  # drop gradients another step's backward may have left (e.g. a GAN's other half)
        params[n].grad = None
    scaler = state.extra.get("loss_scale") if plan.loss_scale is not None else None
    exact = len(micro) == 1 and plan.grad_sync is None  # count known locally: divide before backward

    loss_sum: torch.Tensor | None = None
    count_sum: torch.Tensor | None = None
    aux_sum: dict[str, Any] = {}
    # fp16 without a local count to divide by (sums of micro-batches / ranks): the backward runs on
    # `total * scale / norm`, with `norm` the first micro-batch's count times the number of micro-batches,
    # agreed over the ranks (the same constant everywhere): the effective scale of each micro-batch's mean is
    # about `scale / n_micro`, as with torch's GradScaler and a loss divided by the accumulation steps, and
    # unscaling stays exact
    norm: torch.Tensor | None = None
    for i, mb in enumerate(micro):
        key = step_key if len(micro) == 1 else _random.fold_in(step_key, i)
        with _random.seeded(key, plan.devices), plan.forward_context():
            out = plan.loss_call(module, mb)
        total, count, aux = loss_parts(out)
        if not total.requires_grad:
            raise ValueError(
                "the loss does not depend on any trainable parameter: loss_fn must compute it from `model`, "
                "the module it receives (not another copy of the network)"
            )
        if exact:
            objective = total / count.clamp_min(1) if count is not None else total  # no valid element: 0
            loss_sum, count_sum = _local(objective.detach()), None  # a loss-parallel loss: replicated
        else:
            if count is None:  # a mean over this micro-batch: weight it by its size
                count = torch.tensor(float(_rows(mb)), device=total.device)
                total = total * count
            objective = total
            value = _local(total.detach())  # a loss-parallel loss is a replicated DTensor: its value
            loss_sum = value if loss_sum is None else loss_sum + value
            count_sum = count.detach() if count_sum is None else count_sum + count.detach()
        if scaler is not None:
            if not exact and norm is None:
                assert count is not None
                norm = count.detach().float().clamp_min(1).reshape(()) * len(micro)
                agree = getattr(plan.grad_sync, "max_over_ranks", None)
                norm = agree(norm) if agree is not None else norm
            scale = scaler["scale"].to(objective.device)
            objective = objective * (scale / norm.to(objective.device) if norm is not None else scale)
        microbatch = getattr(plan.grad_sync, "microbatch", None)
        with contextlib.ExitStack() as stack:
            if microbatch is not None:
                stack.enter_context(microbatch(i == len(micro) - 1))
            for make in plan.backward_contexts:
                stack.enter_context(make())
            objective.backward()
        for k, v in aux.items():
            aux_sum[k] = v.detach() if k not in aux_sum else aux_sum[k] + v.detach()

    names = slots.trainable
    record_unused = getattr(plan.grad_sync, "record_unused", None)
    if record_unused is not None:  # sharded gradients: every rank must have produced the same ones
        record_unused(names, {n for n in names if params[n].grad is None})
    grads: dict[str, torch.Tensor] = {}
    for n in names:
        p = params[n]
        g = p.grad
        if g is not None and getattr(g, "placements", None) != getattr(p, "placements", None):
            # DTensor autograd may leave a gradient laid out otherwise than its param (a tensor-parallel
            # embedding's is replicated): lay it out like the param, as the optimizer works shard by shard
            g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
        grads[n] = torch.zeros_like(p) if g is None else g
        p.grad = None
    g_leaves = list(grads.values())
    assert loss_sum is not None

    inv: torch.Tensor | None = None
    if not exact:
        assert count_sum is not None
        if plan.grad_sync is not None:
            loss_sum, count_sum = plan.grad_sync.reduce(g_leaves, loss_sum, count_sum)
        inv = 1.0 / count_sum.clamp_min(1)
        loss_value = loss_sum / count_sum.clamp_min(1)
    else:
        loss_value = loss_sum
    metrics: dict[str, torch.Tensor] = {"loss": loss_value}

    skipped = None
    if scaler is not None:
        inv_scale = (1.0 / scaler["scale"]).to(g_leaves[0].device, torch.float32)
        if inv is not None:
            assert norm is not None
            inv_scale = inv_scale * (inv * norm.to(inv)).to(inv_scale)
        found_inf = torch.zeros((), device=g_leaves[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_([_local(g) for g in g_leaves], found_inf, inv_scale)
        any_rank = getattr(plan.grad_sync, "any_rank", None)
        if any_rank is not None:  # sharded gradients: a shard with inf on one rank skips the step everywhere
            found_inf = any_rank(found_inf)
        skipped = bool(found_inf.item())
        metrics["skipped"] = found_inf
        metrics["loss_scale"] = scaler["scale"]
    elif inv is not None:
        local = [_local(g) for g in g_leaves]  # elementwise: act on shards, skipping DTensor dispatch
        torch._foreach_mul_(local, inv.to(local[0].device, local[0].dtype))

    if plan.clip_grad_norm is not None and not skipped:
        norm = plan.grad_sync.norm(g_leaves) if plan.grad_sync is not None else global_norm(g_leaves)
        clip_([_local(g) for g in g_leaves], norm, plan.clip_grad_norm)
        metrics["grad_norm"] = norm

    opt_state, extra = state.opt_state, state.extra
    trainable = params if len(names) == len(params) else {n: params[n] for n in names}
    if not skipped:
        if plan.updater is None:
            update = apply_gradients_on_shards if plan.update_on_shards else apply_gradients
            opt_state = update(plan.optimizer, grads, opt_state, trainable)
        else:
            opt_state, extra = plan.updater(plan.optimizer, grads, opt_state, trainable, extra)
        for hook in plan.after_update:
            hook(module)
    lr = learning_rate(opt_state)
    if lr is not None:
        metrics["lr"] = lr
    n_micro = len(micro)
    aux_mean = {k: v / n_micro if n_micro > 1 else v for k, v in aux_sum.items() if isinstance(v, torch.Tensor)}
    if plan.grad_sync is not None:
        aux_mean = plan.grad_sync.reduce_metrics(aux_mean)
    metrics.update(aux_mean)

    if scaler is not None:
        assert plan.loss_scale is not None
        extra = {**extra, "loss_scale": _next_scale(scaler, bool(skipped), plan.loss_scale)}
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        buffers=read_buffers(slots),
        opt_state=opt_state,
        rng=keys[0],
        extra=extra,
    )
    return new_state, metrics


def _next_scale(scaler: dict[str, torch.Tensor], found_inf: bool, cfg: LossScaleConfig) -> dict[str, torch.Tensor]:
    scale, good = scaler["scale"], scaler["good_steps"]
    if found_inf:
        return {"scale": scale * cfg.backoff_factor, "good_steps": torch.zeros_like(good)}
    good = good + 1
    if int(good) >= cfg.growth_interval:
        return {"scale": scale * cfg.growth_factor, "good_steps": torch.zeros_like(good)}
    return {"scale": scale, "good_steps": good}


def init_loss_scale(cfg: LossScaleConfig) -> dict[str, torch.Tensor]:
    return {"scale": torch.tensor(cfg.init_scale, dtype=torch.float32), "good_steps": torch.zeros((), dtype=torch.int64)}


# ---- evaluation -----------------------------------------------------------------------------------------------
def run_eval(plan: Plan, state: TrainState, batch: Any) -> Any:
    assert plan.loss_call is not None
    module = plan.module
    if plan.batch_transform is not None:
        batch = plan.batch_transform(batch)
    batch = place_batch(batch, plan.input_device)
    if getattr(module, "_accelfn_fsdp", False):  # FSDP2 computes with its own params: others would be ignored
        own = dict(module.named_parameters())
        foreign = [n for n, p in state.params.items() if own.get(n) is not p]
        if foreign:
            raise ValueError(
                f"eval_step: params {foreign[:3]} are not the FSDP-sharded model's own parameters; FSDP2 would "
                "silently evaluate its own instead. Evaluate the training state, or load the other weights into it "
                "(af.checkpoint.load(path, like=state))"
            )
    bind(module, state.params, state.buffers, plan.slots)
    was_training = module.training
    if was_training:
        module.eval()
    try:
        with torch.no_grad(), _random.seeded(state.rng, plan.devices), plan.forward_context():
            return plan.loss_call(module, batch)
    finally:
        if was_training:
            module.train()


# ---- helpers --------------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), or the tensor itself."""
    return getattr(t, "_local_tensor", t)


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _rows(batch: Any) -> int:
    leaves = _tree.leaves(batch)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 1


def split_batch(batch: Any, parts: int, uneven: bool = False) -> list[Any]:
    """Split every tensor leaf of `batch` along dim 0 into `parts` micro-batches."""
    paths, leaves, spec = optree.tree_flatten_with_path(batch, namespace=_tree.NAMESPACE)
    if not leaves:
        raise ValueError("cannot split an empty batch into micro-batches")
    rows = None
    for path, leaf in zip(paths, leaves):
        where = "batch" + "".join(f"[{p!r}]" for p in path)
        n = leaf.shape[0] if leaf.dim() > 0 else None
        if n is None:
            raise ValueError(f"accumulate({parts}): {where} is a 0-d tensor; every leaf needs a batch dimension 0")
        if rows is not None and n != rows:
            raise ValueError(f"accumulate({parts}): {where} has {n} rows along dim 0 but other leaves have {rows}")
        rows = n
        if n % parts and not uneven:
            raise ValueError(
                f"accumulate({parts}): {where} has {n} rows along dim 0, not divisible by {parts} micro-batches "
                f"(use a batch size divisible by {parts}, or accumulate(..., uneven=True))"
            )
        if n < parts:
            raise ValueError(f"accumulate({parts}): {where} has only {n} rows, fewer than {parts} micro-batches")
    chunks = [torch.tensor_split(leaf, parts, dim=0) for leaf in leaves]
    return [optree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(parts)]


def place_batch(batch: Any, device: torch.device | None) -> Any:
    """Move the host tensors of `batch` to `device` (asynchronously: from pinned memory the copy overlaps);
    tensors already there stay. A tensor on another accelerator device is an error naming its path, as `jax.jit`
    refuses arrays committed to another device: copying it silently would hide a wrong placement."""
    if device is None:
        return batch
    leaves, spec = optree.tree_flatten(batch, namespace=_tree.NAMESPACE)
    if all(isinstance(t, torch.Tensor) and t.device == device for t in leaves):
        return batch
    moved = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.device == device:
            moved.append(t)
        elif t.device.type == "cpu":
            moved.append(t.to(device, non_blocking=True))
        else:
            paths = optree.tree_paths(batch, namespace=_tree.NAMESPACE)
            where = "batch" + "".join(f"[{p!r}]" for p in paths[i])
            raise ValueError(
                f"{where} is on {t.device}, but the model computes on {device}: pass host tensors (they are moved "
                f"to {device} for you, asynchronously when pinned) or tensors on {device}"
            )
    return optree.tree_unflatten(spec, moved)


def plain_batch(batch: Any) -> Any:
    """`batch` with every `Mapping` that is not a dict (Hugging Face's `BatchEncoding` from a data collator, a
    `UserDict`) turned into a plain dict, at any depth of dicts, lists and tuples, so that its tensors are
    pytree leaves. Returns `batch` itself when there is none (the common case costs no copy)."""
    if isinstance(batch, dict):
        items = {k: plain_batch(v) for k, v in batch.items()}
        if all(items[k] is v for k, v in batch.items()):
            return batch
        if type(batch) is dict:
            return items
        new = copy.copy(batch)  # OrderedDict, defaultdict: keep the type
        new.update(items)
        return new
    if isinstance(batch, Mapping):
        return {k: plain_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        seq = [plain_batch(v) for v in batch]
        if all(a is b for a, b in zip(seq, batch)):
            return batch
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*seq)
        return type(batch)(seq)
    return batch


def check_batch(batch: Any) -> Any:
    """`batch` as the step computes on it (`plain_batch`: a `BatchEncoding` becomes a dict); raises a `TypeError`
    naming the first leaf that is not a tensor."""
    batch = plain_batch(batch)
    paths, leaves, _ = optree.tree_flatten_with_path(batch, namespace=_tree.NAMESPACE)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            where = "batch" + "".join(f"[{p!r}]" for p in path)
            hint = " (convert it with torch.as_tensor)" if hasattr(leaf, "__array__") else ""
            raise TypeError(
                f"{where} is a {type(leaf).__name__}: a batch must be a pytree (a dict or other Mapping, list, "
                f"tuple) whose leaves are torch.Tensor{hint}"
            )
    return batch


def loss_parts(out: Any) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Normalise what a loss function returned into `(total, count or None, aux)`."""
    aux: dict[str, Any] = {}
    if isinstance(out, tuple) and not isinstance(out, Loss) and len(out) == 2 and isinstance(out[1], dict):
        out, aux = out
        aux = {k: _metric(k, v) for k, v in aux.items()}
    if isinstance(out, Loss):
        total, count = out.total, out.count
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            raise ValueError(f"Loss.total must be a scalar tensor, got {_describe(total)}")
        count_t = count if isinstance(count, torch.Tensor) else torch.tensor(count, device=total.device)
        if count_t.numel() != 1:
            raise ValueError(
                f"Loss.count must be a scalar (the number of elements `total` sums over), got {_describe(count_t)}; "
                "sum it, e.g. af.Loss(total, (labels != -100).sum())"
            )
        # counts stay exact: at least fp32 (a bf16 count of 301 is 300; fp16 overflows past 65504)
        return total.reshape(()), count_t.reshape(()).to(torch.promote_types(total.dtype, torch.float32)), aux
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise ValueError(
                f"loss_fn returned a tensor of shape {tuple(out.shape)}; expected a scalar (0-d) tensor, "
                "an af.Loss(total, count), or (loss, aux_dict) — reduce it, e.g. with .mean()"
            )
        if not out.is_floating_point():
            raise ValueError(f"loss_fn returned a {out.dtype} tensor; the loss must be floating point")
        return out.reshape(()), None, aux
    raise TypeError(
        f"loss_fn returned {_describe(out)}; expected a scalar tensor, an af.Loss(total, count), "
        "or (loss, aux_dict)"
    )


def _metric(key: str, value: Any) -> torch.Tensor:
    """An aux value as a 0-d tensor (metrics are averaged over micro-batches and ranks, so scalars only)."""
    if isinstance(value, bool | int | float):
        return torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"aux[{key!r}] is a {type(value).__name__}; aux values must be scalar tensors or numbers")
    if value.numel() != 1:
        raise ValueError(
            f"aux[{key!r}] has shape {tuple(value.shape)}; aux values are metrics, averaged over micro-batches "
            "and ranks, so they must be scalars: reduce it (e.g. .mean()), or compute per-example outputs with "
            "an af.eval_step"
        )
    return value.reshape(())


def _check_trainable(params: dict[str, torch.Tensor], trainable: tuple[str, ...]) -> None:
    """The params that train are fixed at `step.init` (the optimizer state is built for them)."""
    if all(params[n].requires_grad for n in trainable) and sum(p.requires_grad for p in params.values()) == len(
        trainable
    ):
        return
    frozen = [n for n in trainable if not params[n].requires_grad]
    thawed = [n for n, p in params.items() if p.requires_grad and n not in trainable]
    what = f"frozen after step.init(): {frozen[:3]}" if frozen else f"unfrozen after step.init(): {thawed[:3]}"
    raise ValueError(
        f"params {what}. The trainable params (and the optimizer state built for them) are fixed when a step is "
        "initialised: set requires_grad before step.init() (a new step.init(step.model) starts from the current "
        "weights with a fresh optimizer state), or keep them trainable and zero their updates: "
        "af.train_step(loss_fn, af.optim.chain(optimizer, af.optim.freeze(mask)))"
    )


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
