"""`Step`: a training (or evaluation) step `(state, batch) -> (state, metrics)`, and its constructors.

`loss_fn(model, batch)` receives the module bound to the state's params and buffers. Gradients come from
ordinary autograd; the optimizer updates the params in place (the input state is donated).

Example:
    >>> import torch, accelfn as af
    >>> net = torch.nn.Linear(4, 1)
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1))
    >>> state = step.init(net, seed=0)
    >>> state, metrics = step(state, {"x": torch.ones(8, 4), "y": torch.zeros(8, 1)})
    >>> int(state.step), sorted(metrics)
    (1, ['loss', 'lr'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import nn

from . import random as _random
from . import tree as _tree
from ._typecheck import checked
from .losses import Loss
from .module import Slots, bind, partition, read_buffers, slots_of
from .optim import GradientTransformation, apply_gradients, learning_rate
from .optim.clip import clip_, global_norm
from .state import TrainState

__all__ = ["Step", "train_step", "eval_step", "check_batch", "loss_parts"]

LossFn = Callable[[nn.Module, Any], Any]


class Step:
    """A step function with its configuration; build with `af.train_step` / `af.eval_step`.

    `init(model, seed=0)` binds the model and returns the initial `TrainState`; calling the step runs it.
    """

    def __init__(
        self,
        kind: str,
        fn: LossFn,
        optimizer: GradientTransformation | None = None,
        *,
        clip_grad_norm: float | None = None,
        donate: bool = True,
    ) -> None:
        self.kind = kind
        self.fn = fn
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.donate = donate
        self._module: nn.Module | None = None
        self._slots: Slots | None = None
        self._devices: list[torch.device] = []

    # ---- set-up ---------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module this step runs (after `init`)."""
        if self._module is None:
            raise RuntimeError("this step has no model yet: call `state = step.init(model)` first")
        return self._module

    def init(self, model: nn.Module | TrainState, *, seed: int = 0) -> TrainState:
        """Bind `model` to this step and return its initial state (params are the module's own tensors).

        Given a `TrainState` instead (e.g. a loaded checkpoint), binds it to the model set earlier.
        """
        if isinstance(model, TrainState):
            bind(self.model, model.params, model.buffers, self._slots)
            return model
        if not isinstance(model, nn.Module):
            raise TypeError(f"Step.init(): expected an nn.Module or a TrainState, got {type(model).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"Step.init(): seed must be an int, got {type(seed).__name__}")
        self._module = model
        self._slots = slots_of(model)
        params, buffers = partition(model)
        self._devices = sorted({t.device for t in [*params.values(), *buffers.values()]}, key=str)
        opt_state: Any = ()
        if self.optimizer is not None:
            if not self._slots.trainable:
                raise ValueError("Step.init(): the model has no trainable parameters (all requires_grad=False)")
            opt_state = self.optimizer.init(self._trainable(params))
        return TrainState(
            step=torch.zeros((), dtype=torch.int64),
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            rng=_random.key(seed),
        )

    def _trainable(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert self._slots is not None
        if len(self._slots.trainable) == len(params):
            return params
        return {n: params[n] for n in self._slots.trainable}

    # ---- running ----------------------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> Any:
        if not isinstance(state, TrainState):
            raise TypeError(f"a step takes (state: af.TrainState, batch), got state of type {type(state).__name__}")
        module = self.model
        check_batch(batch)
        if self.kind == "eval":
            return self._eval(module, state, batch)
        return self._train(module, state, batch)

    def _eval(self, module: nn.Module, state: TrainState, batch: Any) -> Any:
        bind(module, state.params, state.buffers, self._slots)
        was_training = module.training
        if was_training:
            module.eval()
        try:
            with torch.no_grad(), _random.seeded(state.rng, self._devices):
                return self.fn(module, batch)
        finally:
            if was_training:
                module.train()

    def _train(self, module: nn.Module, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        assert self.optimizer is not None and self._slots is not None
        if not self.donate:
            state = _tree.map(_clone, state)
        params = bind(module, state.params, state.buffers, self._slots)
        if not module.training:
            module.train()
        keys = _random.split(state.rng, 2)
        with _random.seeded(keys[1], self._devices):
            out = self.fn(module, batch)
        total, count, aux = loss_parts(out)
        loss = total / count if count is not None else total
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not depend on any trainable parameter: loss_fn must compute it from `model`, "
                "the module it receives (not another copy of the network)"
            )
        loss.backward()
        names = self._slots.trainable
        grads = {}
        for n in names:
            p = params[n]
            g = p.grad
            grads[n] = torch.zeros_like(p) if g is None else g
            p.grad = None
        metrics: dict[str, torch.Tensor] = {"loss": loss.detach()}
        if self.clip_grad_norm is not None:
            g_leaves = list(grads.values())
            norm = global_norm(g_leaves)
            clip_(g_leaves, norm, self.clip_grad_norm)
            metrics["grad_norm"] = norm
        opt_state = apply_gradients(self.optimizer, grads, state.opt_state, self._trainable(params))
        lr = learning_rate(opt_state)
        if lr is not None:
            metrics["lr"] = lr
        for k, v in aux.items():
            metrics[k] = v.detach() if isinstance(v, torch.Tensor) else v
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            buffers=read_buffers(self._slots),
            opt_state=opt_state,
            rng=keys[0],
            extra=state.extra,
        )
        return new_state, metrics

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", repr(self.fn))
        if self.kind == "eval":
            return f"eval_step({fn})"
        extra = f", clip_grad_norm={self.clip_grad_norm}" if self.clip_grad_norm is not None else ""
        extra += ", donate=False" if not self.donate else ""
        return f"train_step({fn}{extra})"


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def check_batch(batch: Any) -> None:
    """Raise a `TypeError` naming the first leaf of `batch` that is not a tensor."""
    paths, leaves, _ = optree.tree_flatten_with_path(batch, namespace=_tree.NAMESPACE)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            where = "batch" + "".join(f"[{p!r}]" for p in path)
            hint = " (convert it with torch.as_tensor)" if hasattr(leaf, "__array__") else ""
            raise TypeError(
                f"{where} is a {type(leaf).__name__}: a batch must be a pytree (dict/list/tuple) whose leaves "
                f"are torch.Tensor{hint}"
            )


def loss_parts(out: Any) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Normalise what a loss function returned into `(total, count or None, aux)`."""
    aux: dict[str, Any] = {}
    if isinstance(out, tuple) and not isinstance(out, Loss) and len(out) == 2 and isinstance(out[1], dict):
        out, aux = out
    if isinstance(out, Loss):
        total, count = out.total, out.count
        if not isinstance(total, torch.Tensor) or total.numel() != 1:
            raise ValueError(f"Loss.total must be a scalar tensor, got {_describe(total)}")
        count_t = count if isinstance(count, torch.Tensor) else torch.tensor(count, device=total.device)
        return total.reshape(()), count_t.reshape(()), aux
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


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


@checked
def train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    *,
    clip_grad_norm: float | None = None,
    donate: bool = True,
) -> Step:
    """A training step: `loss_fn(model, batch)` -> loss; gradients; optional clipping; optimizer update.

    `loss_fn` returns a scalar tensor (mean over its batch), an `af.Loss(total, count)`, or
    `(loss, aux_dict)`; `aux` tensors are added to the metrics. With `donate=False` the input state stays
    valid after the call (at the cost of a copy).
    """
    if clip_grad_norm is not None and clip_grad_norm <= 0:
        raise ValueError(f"train_step: clip_grad_norm must be > 0, got {clip_grad_norm}")
    return Step("train", loss_fn, optimizer, clip_grad_norm=clip_grad_norm, donate=donate)


@checked
def eval_step(fn: Callable[..., Any]) -> Step:
    """An evaluation step: `fn(model, batch) -> outputs`, run in eval mode without gradients.

    Calling it returns `fn`'s outputs; the state is not changed.
    """
    return Step("eval", fn)
