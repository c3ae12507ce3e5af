"""Expert parallel over an `ep` mesh axis: dispatch and combine, the experts' forward, plans and their errors in
one process; ep2 and dp2 x ep2 on real processes (gloo, through `accelfn launch`) vs one process on the global
batch (tests/workers/ep_worker.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import accelfn as af
from accelfn import mesh as _mesh
from accelfn.dryrun import Assumptions
from accelfn.moe import AllToAllDispatcher, ep_forward, load_balancing_loss, local_experts
from accelfn.moe.routing_model import imbalance, routed_counts, uniform_choices
from accelfn.transforms.shard.expert_parallel import expert_params, model_ep_plan
from tests._launch import ROOT, expect_ok, run_workers

EXPERTS = 4


def qwen(layers: int = 1, experts: int = EXPERTS, vocab: int = 32, kv_heads: int = 1) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=8,
                         num_experts=experts, num_experts_per_tok=2)  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def test_dispatch_then_combine_is_the_identity():
    d = AllToAllDispatcher(None, EXPERTS, 1)
    x, experts = torch.randn(9, 3), torch.tensor([3, 0, 3, 1, 1, 0, 2, 3, 0])
    rows, counts, handle = d.dispatch(x, experts)
    assert counts.tolist() == [3, 2, 1, 3]
    assert torch.equal(rows, x[torch.argsort(experts, stable=True)])  # grouped by expert, stable
    assert torch.equal(d.combine(rows, handle), x)


def test_experts_not_divisible_by_ep_is_refused():
    with pytest.raises(ValueError, match="6 experts cannot be split over ep=4"):
        AllToAllDispatcher(None, 6, 4)


def test_ep_forward_equals_transformers_experts_with_gradients():
    """The dispatching forward (one rank: every expert local) gives transformers' output and the same gradients
    for the experts, the routing weights and the hidden states (the router's gradient flows through them)."""
    experts = qwen().model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)
    weights = torch.rand(7, 2, generator=g, requires_grad=True)
    index = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 0], [0, 1], [1, 3], [3, 1]])  # expert 2 gets no token

    def grads(fn):
        out = fn()
        params = [hidden, weights, experts.gate_up_proj, experts.down_proj]
        return out, torch.autograd.grad((out * torch.linspace(-1, 1, 16)).sum(), params)

    ref, ref_grads = grads(lambda: experts(hidden, index, weights))
    out, out_grads = grads(
        lambda: ep_forward(experts, AllToAllDispatcher(None, EXPERTS, 1), hidden, index, weights)
    )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(out_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert out_grads[2][2].abs().max() == 0  # the idle expert: a zero gradient


def test_grouped_gemms_equal_the_per_expert_loop_with_gradients(monkeypatch):
    """torch._grouped_mm (what a platform with it uses; CPU runs it too, in fp32) == the loop, an idle expert
    included; no rows at all: the loop (grouped GEMMs take no empty input)."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    experts = qwen().model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    for counts in (torch.tensor([3, 0, 4, 2]), torch.zeros(4, dtype=torch.int64)):
        rows = torch.randn(int(counts.sum()), 16, requires_grad=True)
        outs = []
        for grouped in ((), (torch.float32,)):
            y = local_experts(experts, rows, counts, grouped)
            g = torch.autograd.grad(
                (y * torch.linspace(-1, 1, 16)).sum(), [rows, experts.gate_up_proj, experts.down_proj]
            )
            outs.append((y, *g))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(calls) == 2  # the two GEMMs of the grouped run with rows; none for the empty one


def test_grouped_gemms_run_in_autocasts_dtype_on_fp32_master_weights(monkeypatch):
    """Under autocast bf16 the fp32 experts' weights are cast as `linear` casts them, so a platform whose grouped
    GEMMs take bf16 (CUDA from sm90) runs them on fp32 master weights, equal to the bf16 loop."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    experts = qwen().model.layers[0].mlp.experts
    counts = torch.tensor([3, 0, 4, 2])
    rows = torch.randn(9, 16)
    outs = []
    for grouped in ((), (torch.bfloat16,)):
        with torch.autocast("cpu", torch.bfloat16):
            y = local_experts(experts, rows, counts, grouped)
        outs.append(torch.autograd.grad((y.float() * torch.linspace(-1, 1, 16)).sum(), experts.down_proj)[0])
    assert calls == [torch.bfloat16, torch.bfloat16] and experts.down_proj.dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_under_autocast_the_rows_travel_in_its_dtype_with_the_loops_values():
    """An fp32 residual stream under autocast bf16: the dispatch moves bf16 rows (half the bytes, both ways), and
    the output and gradients equal transformers' own expert loop under the same autocast."""
    experts = qwen().model.layers[0].mlp.experts
    moved = []

    class Recording(AllToAllDispatcher):
        def dispatch(self, x, chosen):  # noqa: ANN001, ANN202
            moved.append(x.dtype)
            return super().dispatch(x, chosen)

    torch.manual_seed(1)
    hidden = torch.randn(6, 16, requires_grad=True)
    index, weights = torch.randint(0, EXPERTS, (6, 2)), torch.rand(6, 2)
    outs = []
    for forward in (lambda: ep_forward(experts, Recording(None, EXPERTS, 1), hidden, index, weights),
                    lambda: experts(hidden, index, weights)):  # fmt: skip
        with torch.autocast("cpu", torch.bfloat16):
            y = forward()
        outs.append((y.float(), *torch.autograd.grad((y.float() ** 2).sum(), [hidden, experts.down_proj])))
    assert moved == [torch.bfloat16]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_load_balancing_loss_with_padding_equals_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(2 * 5, EXPERTS, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ref = load_balancing_loss_func(logits, EXPERTS, 2, mask)
    torch.testing.assert_close(load_balancing_loss(logits, EXPERTS, 2, mask), ref)


def test_model_ep_plan_and_user_plan():
    model = qwen(layers=2)
    plan = model_ep_plan(model)
    assert plan is not None and plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    owners = expert_params(model, plan)
    assert owners["model.layers.1.mlp.experts.down_proj"] == "model.layers.1.mlp.experts"
    assert len(owners) == 4
    assert model_ep_plan(nn.Linear(2, 2)) is None


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"model.layers.*.mlp.expert.gate_up_proj": "grouped_gemm", "model.layers.*.mlp.experts": "ep_dispatch_experts"},
         r"ep_plan entry 'model.layers.\*.mlp.expert.gate_up_proj' \(grouped_gemm\) matches no parameter"),
        ({"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.gate": "ep_dispatch_experts",
          "model.layers.*.mlp.experts.down_proj": "grouped_gemm"},
         r"experts module 'model.layers.0.mlp.gate' has no parameter marked 'grouped_gemm'"),
        ({"model.layers.*.mlp.experts.down_proj": "grouped_gemm"}, "not an 'ep_dispatch_experts' entry"),
        ({"model.layers.*.mlp.experts": "colwise"}, r"ep_plan\['model.layers.\*.mlp.experts'\] = 'colwise' is not"),
    ],
)  # fmt: skip
def test_a_bad_plan_names_its_entry(plan, message):
    with pytest.raises(ValueError, match=message):
        expert_params(qwen(), plan)


def _fake(shape: dict[str, int]) -> Iterator[af.Mesh]:
    """A mesh over torch's fake process group (errors raised at lowering, before any collective)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _mesh.destroy_process_group()
    world = 1
    for size in shape.values():
        world *= size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield af.Mesh(shape, device="cpu")
    finally:
        _mesh.destroy_process_group()


@pytest.fixture
def ep2() -> Iterator[af.Mesh]:
    yield from _fake({"ep": 2})


@pytest.fixture
def ep2_tp2() -> Iterator[af.Mesh]:
    yield from _fake({"ep": 2, "tp": 2})


def _step(mesh: af.Mesh, **kw) -> af.Step:
    return af.shard(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), mesh, **kw)


def test_ep_refusals_name_the_culprit(ep2):
    with pytest.raises(ValueError, match="Linear brings no expert-parallel plan"):
        _step(ep2).init(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="stacks 3 experts on dim 0, which ep=2 does not divide"):
        _step(ep2).init(qwen(experts=3))
    with pytest.raises(
        ValueError, match="combines with strategy 'ddp', 'fsdp' or 'hsdp'.*not strategy='local_sgd'"
    ):
        _step(ep2, strategy="local_sgd")
    with pytest.raises(ValueError, match="not strategy='fsdp', backend='deepspeed'"):
        _step(ep2, strategy="fsdp", backend="deepspeed")
    with pytest.raises(ValueError, match="FSDP-sharded over the data axes other than ep.*has none"):
        _step(ep2, strategy="fsdp")
    with pytest.raises(
        ValueError, match=r"ep_plan entry 'experts' \(ep_dispatch_experts\) matches no module"
    ):
        _step(ep2, ep_plan={"experts": "ep_dispatch_experts"}).init(nn.Linear(2, 2))


def test_hsdp_with_ep_needs_dp_outermost():
    """hsdp replicates over dp and shards over fsdp x ep: a mesh naming dp after them is refused, naming the fix."""
    for mesh in _fake({"fsdp": 2, "dp": 2, "ep": 2}):
        with pytest.raises(ValueError, match=r"strategy='hsdp'.*name 'dp' before them"):
            _step(mesh, strategy="hsdp").init(qwen())


def test_tp_plan_entries_for_the_experts_give_way_to_the_ep_plan(ep2_tp2):
    """tp2 x ep2: a tp plan that also splits the experts (as transformers' MoE plans do) leaves them to the ep plan
    (said in print(step)); attention split over tp, experts over ep and the tp axis it borrows (1 of 4 per rank)."""
    plan = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # transformers' styles for the experts
        "model.layers.*.mlp.experts": "moe_tp_experts",
    }
    step = _step(ep2_tp2, tp_plan=plan)
    state = step.init(qwen(kv_heads=2))
    dropped = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts"]
    assert f"the experts follow the ep plan, not these tp plan entries: {dropped}" in repr(step), repr(step)
    q, experts = (
        state.params["model.layers.0.self_attn.q_proj.weight"],
        state.params["model.layers.0.mlp.experts.gate_up_proj"],
    )
    assert q.device_mesh.mesh_dim_names == ("tp",) and q.placements[0].is_shard(0), q
    assert experts.device_mesh.mesh_dim_names == ("ep", "tp") and experts.to_local().shape[0] == EXPERTS // 4
    assert "1 of 4 experts per rank (split over ep=2 x tp=2)" in repr(step), repr(step)
    with pytest.raises(ValueError, match="tp_plan entry 'model.layers.*.attn.q' matches no module"):
        _step(ep2_tp2, tp_plan={"model.layers.*.attn.q": "colwise"}).init(qwen(kv_heads=2))


def test_sequence_parallel_with_ep_is_refused(ep2_tp2):
    with pytest.raises(ValueError, match=r"sequence_parallel=True with expert parallel \(ep=2, tp=2\)"):
        _step(ep2_tp2, sequence_parallel=True)


def test_capacity_with_context_parallel_is_refused():
    from accelfn.moe import set_capacity

    model = qwen()
    set_capacity(model, 1.0)
    for mesh in _fake({"cp": 2, "ep": 2}):
        with pytest.raises(ValueError, match="capacity factor .* context or tensor parallel .*dropless"):
            _step(mesh).init(model)


def test_router_logits_under_a_pipeline_are_refused():
    """pp2 x ep2 lowers (each stage's experts over its ep group); a loss asking for the router logits (an aux or
    z-loss, which the last stage would compute on its own layers only) is refused in the first step, on every
    stage (the shape probe runs the loss before any message), and so is a config that asks for them."""
    ids = torch.randint(0, 32, (4, 6))

    def aux_loss(m, b):
        out = m(input_ids=b, output_router_logits=True)
        return out.logits.sum() + out.aux_loss

    for mesh in _fake({"pp": 2, "ep": 2}):
        step = af.shard(af.pipeline(af.train_step(aux_loss, af.optim.sgd(0.1)), mesh, microbatches=2), mesh)
        state = step.init(qwen(layers=2))
        assert "expert_parallel(ep=2)" in repr(step) and "2 of 4 experts per rank" in repr(step), repr(step)
        assert not any("layers.1" in k for k in state.params)  # stage 0 of 2: layer 1 is the other stage's
        with pytest.raises(ValueError, match="asks for output_router_logits=True.*expert bias"):
            step(state, ids)
        model = qwen(layers=2)
        model.config.output_router_logits = True
        base = af.train_step(lambda m, b: m(input_ids=b).logits.sum(), af.optim.sgd(0.1))
        with pytest.raises(ValueError, match="config.output_router_logits is True"):
            af.shard(af.pipeline(base, mesh, microbatches=2), mesh).init(model)


@pytest.fixture
def given() -> Iterator[list[dict[str, str]]]:
    """expert_parallel.GIVEN (process-wide: what af.shard last recorded for the planner), as it was after the test."""
    from accelfn.transforms.shard.expert_parallel import GIVEN

    before = list(GIVEN)
    yield GIVEN
    GIVEN[:] = before


def test_ep_plan_without_an_ep_axis_is_kept_for_the_planner_and_leaves_the_experts_whole(given):
    """A script passing ep_plan= runs on any mesh (accelfn plan reads the plan to search ep: GIVEN); without ep the
    plan is checked and the experts stay whole: two SGD steps give plain PyTorch's losses and params."""
    plan = {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    batches = [torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    loss = lambda m, b: m(input_ids=b).logits.float().pow(2).mean()  # noqa: E731
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        step = af.shard(af.train_step(loss, af.optim.sgd(0.1)), mesh, ep_plan=plan)
        state = step.init(qwen())
        losses = []
        for ids in batches:
            state, metrics = step(state, ids)
            losses.append(metrics["loss"].item())
    assert given[-1] == plan
    assert "ep=1: the ep plan's 1 experts module(s) stay whole on each rank" in repr(step), repr(step)
    model = qwen()  # the reference: plain PyTorch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses = []
    for ids in batches:
        out = loss(model, ids)
        opt.zero_grad()
        out.backward()
        opt.step()
        ref_losses.append(out.item())
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    ref = dict(model.named_parameters())
    assert state.params.keys() == ref.keys()
    for k, v in state.params.items():
        torch.testing.assert_close(v, ref[k].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "plan",
    [
        {"model.layers.*.mlp.experts": "ep_dispatch_experts"},  # no param marked grouped_gemm
        {"model.layers.*.mlp.expert.gate_up_proj": "grouped_gemm", "model.layers.*.mlp.experts": "ep_dispatch_experts"},
        {"model.layers.*.mlp.experts": "colwise"},
    ],
)  # fmt: skip
def test_a_bad_ep_plan_gets_the_same_error_at_ep1_as_at_ep2(plan, given):
    """af.shard(ep_plan=) checks the plan against the model on every mesh: at ep=1 (one process, and a fake dp=2
    rank) the error of ep=2, naming the entry."""
    errors = []
    for shape in ({"ep": 2}, {"dp": 2}, {"dp": 1}):
        for mesh in _fake(shape):
            with pytest.raises(ValueError) as caught:
                _step(mesh, ep_plan=plan).init(qwen())
            errors.append(str(caught.value))
    assert errors[0].startswith(("ep_plan entry", "ep_plan: the experts module", "ep_plan[")), errors[0]
    assert errors == [errors[0]] * 3, errors


def test_ep_dispatcher_is_swapped_named_and_checked(ep2):
    """af.shard(ep_dispatcher=factory): the factory is called per experts module with the ep group, the experts, the
    ep size, the capacity factor and the data group; print(step) names it; a factory whose result is no Dispatcher,
    a value that is not callable, or a dispatcher without an ep axis are refused, naming the culprit."""
    made = []

    class Mine(AllToAllDispatcher):
        def __init__(self, **kw):  # noqa: ANN003
            made.append(sorted(kw))
            super().__init__(**kw)

    step = _step(ep2, ep_dispatcher=Mine)
    step.init(qwen(layers=2))
    assert made == [["capacity_factor", "data_group", "group", "num_experts", "size"]] * 2, made
    assert (
        "expert_parallel(ep=2, dispatcher=test_ep_dispatcher_is_swapped_named_and_checked.<locals>.Mine)"
        in repr(step)
    ), repr(step)
    assert "Mine dispatch" in repr(step) and "all-to-all dispatch" not in repr(step), repr(step)
    with pytest.raises(TypeError, match=r"ep_dispatcher=.*<lambda>\) returned dict for 'model.layers.0.mlp.experts'"
                       ".*no dispatch and no combine method"):  # fmt: skip
        _step(ep2, ep_dispatcher=lambda **kw: {}).init(qwen())
    with pytest.raises(TypeError, match="ep_dispatcher"):
        _step(ep2, ep_dispatcher="deepep")
    with (
        af.Mesh({"dp": -1}, device="cpu") as mesh,
        pytest.raises(ValueError, match="ep_dispatcher given, but the mesh has no ep axis"),
    ):
        _step(mesh, ep_dispatcher=AllToAllDispatcher)


def _assert_loads_in_one_process(folder, model) -> None:
    """The checkpoint a worker saved at `folder` (`save=`) loads without ep in one process into `model`'s state:
    exactly the params the worker gathered into `<folder>-full.safetensors`."""
    from safetensors.torch import load_file

    like = af.train_step(lambda m, b: m(**b).logits.sum(), af.optim.sgd(0.5)).init(model)
    loaded = af.checkpoint.load(folder, like=like)
    want = load_file(f"{folder}-full.safetensors")
    assert sorted(loaded.params) == sorted(want)
    for k, v in want.items():
        assert torch.equal(loaded.params[k], v), k


@pytest.mark.slow
def test_ep2_equals_one_process(tmp_path):
    """Loss, grad norm and params (experts, router, attention, embeddings) after 2 SGD steps; clipping; every token
    to one rank's experts (the other receives none: no hang, zero gradients); a user's MoE module and plan;
    under af.accumulate and full af.remat (the all-to-alls run again in the recomputed forward); a checkpoint
    saved and loaded at ep2, and without ep in one process (exact); two runs bitwise identical; under af.autocast bf16 (vs one process under it); the load-balancing loss of the global batch (vs transformers' aux_loss);
    a user's dispatcher (`ep_dispatcher`: all-gather and select instead of all-to-all); AdamW with a rank that
    receives no token (its experts' state and weight decay as one process's); selective af.remat; the experts'
    grouped GEMMs in emulated mxfp8 (af.autocast_fp8) vs one process running them alike (to 1e-3: bf16 outputs)."""
    configs = ["qwen", "qwen:clip:to=0", "qwen:to=1", "user", "user:clip:to=1", "qwen:accumulate", "qwen:remat:to=1:repeat",
               "user:accumulate", f"qwen:save={tmp_path / 'ckpt'}", "qwen:aux:clip", "qwen:bf16", "qwen:gather:clip",
               "user:gather:to=1", "qwen:adamw:to=1", "qwen:selective", "qwen:fp8", "qwen:fp8:to=1:clip"]  # fmt: skip
    expect_ok(run_workers("ep_worker.py", 2, "ep=2", *configs, timeout=300), configs, 2)
    # the ep2 checkpoint loads without ep, in one process: the same params (resharded from the experts' pieces)
    _assert_loads_in_one_process(tmp_path / "ckpt", qwen(layers=2, vocab=64))


@pytest.mark.slow
def test_fsdp2_x_ep2_on_four_processes_equals_one_process(tmp_path):
    """ddp: experts summed over the other data axis only (each ep rank holds other experts: not ep x too large);
    fsdp: dense layers sharded over all 4 ranks, experts FSDP-sharded over fsdp within their ep rank (efsdp);
    the norm counting each expert once. With 2 experts (1 per ep rank, efsdp=2 > 1) the experts are sharded on
    dim 1 over efsdp, no rank holding padding (torchtitan's layout), and their checkpoint saves and loads exactly
    at that layout and in one process."""
    configs = [
        "qwen:clip",
        "user:to=0",
        "qwen:fsdp",
        "qwen:fsdp:clip:to=1",
        "user:fsdp:to=0",
        "qwen:fsdp:aux",
        f"qwen:fsdp:experts=2:clip:save={tmp_path / 'ckpt'}",
        "user:fsdp:experts=2",
    ]
    expect_ok(run_workers("ep_worker.py", 4, "fsdp=2,ep=2", *configs, timeout=300), configs, 4)
    _assert_loads_in_one_process(tmp_path / "ckpt", qwen(layers=2, vocab=64, experts=2))


@pytest.mark.slow
def test_hsdp_dp2_fsdp2_ep2_on_eight_processes_equals_one_process():
    """strategy hsdp x ep: dense layers replicated over dp and sharded over fsdp x ep (4 ranks); the experts split
    over ep, replicated over dp and FSDP-sharded over fsdp (on dim 1 with 2 experts: 1 per ep rank over fsdp=2);
    their gradients summed over dp and fsdp only; the norm counting each expert once; clipping, a router sending
    every token to one ep rank. Loss, grad norm and every param after 2 SGD steps vs one
    process on the global batch."""
    configs = ["qwen:hsdp:clip", "user:hsdp:to=0", "qwen:hsdp:experts=2:clip"]
    expect_ok(run_workers("ep_worker.py", 8, "dp=2,fsdp=2,ep=2", *configs, timeout=400), configs, 8)


@pytest.mark.slow
def test_ep4_and_ep2_with_pp2_tp2_cp2_equal_one_process(tmp_path):
    """ep=4: 4 ranks exchange rows with each other; two of them receive no token (to=...). On the same processes:
    pp=2 x ep=2 (af.pipeline, 1F1B, 2 micro-batches, times 2 under accumulate): each stage's experts split over its
    ep group, the all-to-alls in each stage's forward and backward, the stage's params, the loss, the norm and the
    imbalance over both stages, the expert bias from the counts of every micro-batch; tp=2 x ep=2: the model's tp
    plan on attention, embeddings and head (its entries for the experts give way to the ep plan; the per-head
    q/k norms' gradients summed over tp), the experts split over ep x tp (one per rank), each tp rank dispatching
    its share of the tokens; cp=2 x ep=2: experts over ep x cp, each rank dispatching its part of every sequence,
    the aux loss and the bias counted over ep x cp. To fp32 round-off (1e-6) against one process. The tp2 x ep2
    checkpoint (experts in pieces over ep x tp, attention over tp) loads at tp2 x ep2 and in one process, exactly."""
    configs = [
        "qwen:clip",
        "user:to=1",
        "qwen:mesh=pp=2,ep=2:pp:clip:bias",
        "qwen:mesh=pp=2,ep=2:pp:to=0:accumulate",
        f"qwen:mesh=tp=2,ep=2:clip:aux:save={tmp_path / 'ckpt'}",
        "qwen:mesh=tp=2,ep=2:to=1:accumulate:bias",
        "qwen:mesh=cp=2,ep=2:clip:aux",
        "qwen:mesh=cp=2,ep=2:to=0:accumulate:bias",
    ]
    expect_ok(run_workers("ep_worker.py", 4, "ep=4", *configs, timeout=300), configs, 4)
    _assert_loads_in_one_process(tmp_path / "ckpt", qwen(layers=2, vocab=64, kv_heads=2))


# examples/train_moe.py under `accelfn launch` with ep=2 (its loss falls, each rank holds half the experts):
# tests/test_plan_space.py launches it from the config `accelfn plan --write` chose.


def test_uniform_routing_picks_k_distinct_experts_every_k_subset_alike():
    """The dry run's uniform router: each token's k experts are distinct, and each of the C(5, 3) = 10 subsets of
    3 of 5 experts comes up equally often (chi-square over 20,000 tokens, 9 degrees of freedom, below its 99.9%
    quantile 27.88); k = E picks every expert."""
    chosen = uniform_choices(20_000, 3, 5, torch.Generator().manual_seed(0))
    ordered = chosen.sort(1).values
    assert bool((ordered[:, 1:] > ordered[:, :-1]).all()) and int(chosen.min()) >= 0 and int(chosen.max()) < 5
    subsets = torch.unique(ordered, dim=0, return_counts=True)[1].double()
    assert len(subsets) == 10 and float(((subsets - 2000) ** 2 / 2000).sum()) < 27.88, subsets
    every = uniform_choices(7, 4, 4, torch.Generator().manual_seed(1)).sort(1).values
    assert torch.equal(every, torch.arange(4).expand(7, 4))


def test_uniform_routing_imbalance_equals_an_independent_simulation():
    """At 128 tokens x top-8 of 16 experts on each of 4 ep ranks (4 experts each), the modelled max/mean rows
    per expert and the busiest rank's rows over the mean, averaged over 300 layers, equal those of 600 numpy
    trials (an argsort of uniform keys per token, another generator) within 4 standard errors. Sampling with
    replacement would give a larger imbalance (1.112 vs 1.081 here, 4 standard errors 0.006): the test tells them
    apart."""
    import numpy as np

    tokens, k, experts, ep = 128, 8, 16, 4

    def figures(counts: np.ndarray) -> tuple[float, float]:  # counts [ep, experts]
        load = counts.sum(0)
        ranks = load.reshape(ep, experts // ep).sum(1)
        return load.max() / load.mean(), ranks.max() / ranks.mean()

    ours = np.array([figures(routed_counts("uniform", tokens=tokens, k=k, num_experts=experts, sources=ep,
                                           layer=layer).numpy()) for layer in range(300)])  # fmt: skip
    rng = np.random.default_rng(12345)
    ref = []
    for _ in range(6):  # 100 trials at a time
        picks = rng.random((100, ep, tokens, experts)).argsort(-1)[..., :k]
        onehot = (picks[..., None] == np.arange(experts)).any(-2)  # [trial, ep, tokens, experts]
        ref += [figures(c) for c in onehot.sum(2)]
    ref_a = np.array(ref)
    for j in range(2):
        se = np.sqrt(ours[:, j].var() / len(ours) + ref_a[:, j].var() / len(ref_a))
        mean, ref_mean = ours[:, j].mean(), ref_a[:, j].mean()
        assert abs(mean - ref_mean) < 4 * se, (j, mean, ref_mean, se)
    assert 1.06 < ref_a[:, 0].mean() < 1.1 and 1.01 < ref_a[:, 1].mean() < 1.04, ref_a.mean(0)


def test_routing_models_are_seeded_per_layer_and_even_is_the_exact_spread():
    """The uniform model routes alike in two runs (a seed per layer and source rank) and differently per layer and
    rank; "even" is every expert rows / E (the remainder to the first, every rank alike); a measured factor gives
    the first expert that many times the mean; anything else is a named error."""
    one = dict(tokens=64, k=2, num_experts=8, sources=4)
    a, b = routed_counts("uniform", layer=3, **one), routed_counts("uniform", layer=3, **one)
    assert torch.equal(a, b) and not torch.equal(a, routed_counts("uniform", layer=4, **one))
    assert a.sum(1).tolist() == [128] * 4 and len({tuple(r) for r in a.tolist()}) == 4
    even = routed_counts("even", tokens=5, k=3, num_experts=4, sources=2)
    assert even.tolist() == [[4, 4, 4, 3]] * 2
    measured = routed_counts(2.0, **one)
    assert imbalance(measured) == 2.0 and measured.sum(1).tolist() == [128] * 4
    for bad in ("balanced", 0.5, True):
        with pytest.raises(ValueError, match=f"moe_routing must be one of 'uniform', 'even'.*got {bad!r}"):
            Assumptions(moe_routing=bad)


def test_a_real_run_under_a_watcher_routes_by_its_expert_ids():
    """The routing model is for fake tensors only: a real run measured by the dry run's watcher (`measure_real`)
    dispatches by the real expert ids (a model there would send other splits than the other processes')."""
    d = AllToAllDispatcher(group=None, num_experts=4, size=1)
    x, experts = torch.arange(6.0).reshape(3, 2), torch.tensor([[2, 0], [2, 1], [3, 2]])
    with af.dry_mode.watching(af.dry_mode.Watcher()):
        rows, counts, handle = d.dispatch(x.repeat_interleave(2, 0), experts)
    assert counts.tolist() == [1, 1, 3, 1] and torch.equal(d.combine(rows, handle), x.repeat_interleave(2, 0))


def test_dry_run_of_the_example_at_deepseek_v3_shapes_on_256_h100s_counts_the_all_to_alls_and_the_experts():
    """DeepSeek-V3's layer shapes (a `transformers` DeepseekV3Config, one dense and one MoE layer: 256 experts,
    top-8) as one of 256 ranks (dp=32 x ep=8) of an H100 job, on fake tensors: the dispatch models a balanced
    router (uniform: this rank given the busiest ep rank's rows, as `routed_counts` computes them); the rows move through 4 all-to-alls on ep (dispatch and combine, forward and backward) within a node;
    the experts' gradients are summed over dp only; the experts run as on an H100 (grouped GEMMs in bf16) and
    their FLOPs are counted: the step's FLOPs equal the model's matmuls and attention counted here by hand."""
    tokens, k, d, f, heads = 4096, 8, 7168, 2048, 128
    report = af.dry_run(ROOT / "examples" / "train_moe.py", ["--model", "deepseek-v3", "--layers", "2", "--init",
                        "meta", "--bf16", "--seq", str(tokens), "--batch-size", "1", "--steps", "2"],
                        nproc_per_node=8, nnodes=32, gpu="h100", mesh="dp=32,ep=8", search=False)  # fmt: skip
    # the default routing model: each of the 8 ep ranks' tokens picks 8 of 256 experts at random; this rank gets
    # the busiest ep rank's rows (its 32 experts' rows from every rank), sends its own 4096 x 8
    counts = routed_counts("uniform", tokens=tokens, k=k, num_experts=256, sources=8, layer=0)
    loads = counts.view(8, 8, 32).sum(2)  # [source, destination ep rank]
    busiest = int(loads.sum(0).argmax())
    received = int(loads[:, busiest].sum())
    assert received > tokens * k  # the busiest rank gets more than the even share
    a2a = report.comm["all_to_all"]["ep"]
    assert a2a["count"] == 4 and a2a["intra_node"], report.comm
    # dispatch sends 4096 x 8 rows and the backward returns the received ones; combine sends back the received
    # rows and its backward the 4096 x 8: bf16 rows, 7/8 of them to the other ranks
    assert a2a["bus_bytes"] == 2 * (tokens * k + received) * d * 2 * 7 // 8, (a2a, received)
    assert report.moe == {"routing": "uniform", "moe_imbalance": imbalance(counts), "ep": 8, "layers": 1,
                          "rank_load": received / (tokens * k)}  # fmt: skip
    assert 1.05 < report.moe["moe_imbalance"] < 1.3, report.moe  # 8 x 4096 x 8 rows over 256 experts
    assert "MoE routing (assumed uniform" in str(report) and '"moe_imbalance"' in report.to_json()
    assert "dp" in report.comm["all_reduce"], report.comm  # the experts' gradients: over dp, not dp x ep
    assert "grouped GEMMs in bfloat16" in report.strategy, report.strategy
    attention = 7168 * 1536 + 1536 * heads * 192 + d * (512 + 64) + 512 * heads * 256 + heads * 128 * d
    per_token = (
        2 * attention + 3 * d * 18432 + 3 * d * f + d * 256 + d * 129280
    )  # shared expert, router, head
    routed = received * 3 * d * f  # every received row one expert's gate_up and down
    sdpa = 2 * (2 * 2 * tokens * tokens * 192 * heads) // 2  # q k^T and p v (v padded to 192), causal half
    expected = 3 * (2 * tokens * per_token + 2 * routed) + 2 * (
        sdpa + 5 * sdpa // 2
    )  # fwd + 2 bwd; sdpa bwd: 5
    assert report.flops_per_step == pytest.approx(expected, rel=0.01)


def test_dry_run_of_dp2_tp2_ep4_dispatches_over_tp_x_ep():
    """16 ranks on fake tensors (dp=2 x tp=2 x ep=4; ep borrows tp): the all-to-alls run over tp x ep (8 ranks,
    4 per MoE layer and step), the tp ranks share out their tokens (all-gathers over tp), and the experts'
    gradients are summed over dp only (each of the 8 ranks of a tp x ep group holds other experts)."""
    report = af.dry_run(ROOT / "examples" / "train_moe.py", ["--steps", "2", "--experts", "16"], nproc_per_node=8,
                        nnodes=2, device="cpu", mesh="dp=2,tp=2,ep=4", search=False)  # fmt: skip
    assert report.comm["all_to_all"]["tpxep"]["count"] == 8, report.comm
    assert set(report.comm["all_to_all"]) == {"tpxep"}, report.comm
    assert "tp" in report.comm["all_gather"], report.comm
    assert "dp" in report.comm["all_reduce"], report.comm
    assert "2 of 16 experts per rank (split over tp=2 x ep=4)" in report.strategy, report.strategy


def _example_moe_params() -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """examples/train_moe.py's model with `--experts 8`, built here from its transformers config on the meta device
    (the reference the dry-run tests count against): all its params, and of them the experts'."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        params = dict(Qwen3MoeForCausalLM(cfg).named_parameters())
    experts = {n: p for n, p in params.items() if ".experts." in n}
    assert len(experts) == 4  # gate_up_proj, down_proj of 2 layers
    return params, experts


def test_dry_run_of_fsdp4_ep4_shards_two_local_experts_on_dim_1_without_padding():
    """16 ranks on fake tensors (fsdp=4 x ep=4, strategy fsdp, 8 experts: 2 per ep rank over efsdp=4; "even"
    routing: the all-to-alls' bytes as before the routing model): the
    experts are FSDP-sharded on dim 1, so the measured rank (rank 0, where FSDP2 puts dim 0's padding) holds
    1/16 of the experts, not 1 of its 2 experts padded to 4 rows (2x), and each efsdp all-gather and
    reduce-scatter moves its ep rank's 2 experts, not 4 rows. The reference: the model's params counted here."""
    report = af.dry_run(ROOT / "examples" / "train_moe.py", ["--steps", "2", "--experts", "8", "--strategy", "fsdp"],
                        nproc_per_node=8, nnodes=2, device="cpu", mesh="fsdp=4,ep=4", search=False,
                        assumptions=Assumptions(moe_routing="even"))  # fmt: skip
    assert "experts FSDP-sharded on dim 1 over efsdp=4 (2 local experts: no padding)" in report.strategy
    # "even" routing: every expert 1/8 of each rank's 8 x 16 tokens x 2 rows, as before the routing model: 4
    # all-to-alls of 256 rows of 32 fp32 per MoE layer, 2 layers
    assert report.comm["all_to_all"]["ep"]["bytes"] == 2 * 4 * 256 * 32 * 4, report.comm
    assert report.moe == {"routing": "even", "moe_imbalance": 1.0, "rank_load": 1.0, "layers": 2, "ep": 4}
    params, experts = _example_moe_params()
    dense = sum(-(-p.shape[0] // 16) * p[0].numel() * 4 for n, p in params.items() if n not in experts)
    assert report.per_rank["params"] == dense + sum(p.numel() * 4 for p in experts.values()) // 16
    one_layer = (
        sum(p.numel() * 4 for n, p in experts.items() if ".layers.0." in n) // 4
    )  # an ep rank's 2 experts
    gather, scatter = report.comm["all_gather"]["fsdp"], report.comm["reduce_scatter"]["fsdp"]
    assert (gather["count"], scatter["count"]) == (4, 2), (
        report.comm
    )  # 2 layers: forward, backward; gradients
    assert gather["bytes"] == 4 * one_layer and scatter["bytes"] == 2 * one_layer, report.comm


def test_dry_run_of_hsdp_dp2_fsdp4_ep2_shards_the_experts_over_fsdp_and_replicates_them_over_dp():
    """16 ranks on fake tensors (dp=2 x fsdp=4 x ep=2, strategy hsdp, 8 experts: 4 per ep rank): the dense layers
    sharded over fsdp x ep (8 ranks) and replicated over dp; the experts split over ep, then sharded over fsdp
    (1 of each ep rank's 4 experts per rank) and replicated over dp. Their gradients: reduce-scattered over fsdp
    (each MoE layer's 4 local experts), then every rank's gradient shards all-reduced over dp, never over ep.
    The reference: the model's params counted here."""
    report = af.dry_run(ROOT / "examples" / "train_moe.py", ["--steps", "2", "--experts", "8", "--strategy", "hsdp"],
                        nproc_per_node=8, nnodes=2, device="cpu", mesh="dp=2,fsdp=4,ep=2", search=False)  # fmt: skip
    assert "shard(hsdp, dp=2, fsdp=4, ep=2)" in report.strategy, report.strategy
    params, experts = _example_moe_params()
    dense = sum(-(-p.shape[0] // 8) * p[0].numel() * 4 for n, p in params.items() if n not in experts)
    expert_bytes = sum(p.numel() * 4 for p in experts.values()) // 2 // 4  # E/ep experts, then / fsdp
    assert report.per_rank["params"] == dense + expert_bytes, report.per_rank
    one_layer = (
        sum(p.numel() * 4 for n, p in experts.items() if ".layers.0." in n) // 2
    )  # an ep rank's 4 experts
    gather, scatter = report.comm["all_gather"]["fsdp"], report.comm["reduce_scatter"]["fsdp"]
    assert (gather["count"], scatter["count"]) == (4, 2), (
        report.comm
    )  # 2 layers: forward, backward; gradients
    assert gather["bytes"] == 4 * one_layer and scatter["bytes"] == 2 * one_layer, report.comm
    assert report.comm["reduce_scatter"]["fsdpxep"]["count"] == 3, report.comm  # dense: 2 blocks + root
    reduce = report.comm["all_reduce"]["dp"]  # each rank's gradient shards, experts' and dense, once over dp
    assert (reduce["count"], reduce["bytes"]) == (2 + 3, report.per_rank["params"]), report.comm
    # no gradient over ep (nor over the whole world: that one carries the loss, the count and the norm's scalars)
    assert set(report.comm["all_reduce"]) == {"dp", "dpxfsdpxep"}, report.comm
    assert report.comm["all_reduce"]["dpxfsdpxep"]["bytes"] < 1024, report.comm
