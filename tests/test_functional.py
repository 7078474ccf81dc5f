"""Functional training in one process: pytrees, pure optimizers, loss_and_grad, the guards.

Two-process behaviour (sync_grads, the DDP comparison, the guards under a real
group) is in tests/distributed/test_functional.py.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
import typeguard
from hypothesis import given
from hypothesis import strategies as st

from tests import strategies as fst


def _seed_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(n: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _tensors(layout: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=dtype) for name, shape in layout.items()}


# --- pytrees ---------------------------------------------------------------------------------


@given(
    layout=fst.param_layouts,
    buffers=fst.param_layouts,
    use_adamw=st.booleans(),
    sgd_kw=fst.sgd_hyperparams(),
    adamw_kw=fst.adamw_hyperparams(),
    steps=st.integers(min_value=0, max_value=3),
)
def test_functional_states_flatten_and_unflatten_to_themselves(
    layout: dict, buffers: dict, use_adamw: bool, sgd_kw: dict, adamw_kw: dict, steps: int
) -> None:
    import faccel

    params = _tensors(layout, 0, torch.float32)
    optimizer = faccel.func.adamw(**adamw_kw) if use_adamw else faccel.func.sgd(**sgd_kw)
    state = faccel.func.FunctionalState.create(
        params=params, buffers=_tensors(buffers, 1, torch.float64), optimizer=optimizer
    )
    for k in range(steps):
        state = state.apply_gradients(_tensors(layout, 10 + k, torch.float32))

    leaves, spec = pytree.tree_flatten(state)
    # Leaves are the tensors, all of them; step and hyperparameters stay out.
    sgd_moments = 1 if sgd_kw["momentum"] > 0 else 0
    moments = (3 if adamw_kw["amsgrad"] else 2) if use_adamw else sgd_moments
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    assert len(leaves) == len(layout) * (1 + moments) + len(buffers)
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is faccel.func.FunctionalState and type(back.opt_state) is type(state.opt_state)
    assert (back.step, back.optimizer, back.opt_state.step) == (steps, optimizer, steps)
    assert all(a is b for a, b in zip(pytree.tree_leaves(back), leaves, strict=True))
    assert pytree.tree_structure(back) == spec

    doubled = faccel.func.tree_map(lambda t: t * 2, state)
    assert doubled.step == steps and doubled.optimizer == optimizer
    for name, p in state.params.items():
        assert torch.equal(doubled.params[name], p * 2)
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(state)[0]]
    assert all(path.startswith((".params[", ".buffers[", ".opt_state.")) for path in paths)


def test_register_pytree_keeps_static_fields_out_and_skips_validators_on_rebuild() -> None:
    import faccel

    @faccel.func.register_pytree
    @attrs.frozen(kw_only=True)
    class Scaled:
        value: torch.Tensor = attrs.field(validator=attrs.validators.instance_of(torch.Tensor))
        scale: float = faccel.func.static_field(default=2.0)

    record = Scaled(value=torch.ones(3), scale=0.5)
    # Leaves may become anything under tree_map: no validator runs on the rebuild.
    shapes = faccel.func.tree_map(lambda t: tuple(t.shape), record)
    assert shapes.value == (3,) and shapes.scale == 0.5
    assert faccel.func.register_pytree(Scaled) is Scaled  # twice: a no-op, no warning

    # torch.func transforms see the record: gradients come back as one.
    grads = torch.func.grad(lambda r: (r.value * r.scale).sum())(record)
    assert type(grads) is Scaled and grads.scale == 0.5
    assert grads.value.tolist() == [0.5, 0.5, 0.5]
    batched = torch.func.vmap(lambda r: r.value.sum() * r.scale)(Scaled(value=torch.ones(4, 3)))
    assert batched.tolist() == [6.0] * 4  # the default scale, 2.0


def test_register_pytree_refuses_a_class_that_is_not_attrs() -> None:
    import faccel

    class Plain:
        pass

    with pytest.raises(faccel.errors.ArgumentError, match="needs an attrs class"):
        faccel.func.register_pytree(Plain)


# --- pure optimizers vs torch.optim ----------------------------------------------------------


def _compare_with_torch(
    faccel_opt: Any,
    torch_opt_cls: type,
    kwargs: dict,
    layout: dict,
    lrs: list[float],
    dtype: torch.dtype,
    buffer_keys: dict[str, str],
) -> None:
    """Run both optimizers on the same gradients; parameters and state must agree to 1e-6."""
    params = _tensors(layout, 0, dtype)
    live = [torch.nn.Parameter(p.clone()) for p in params.values()]
    reference = torch_opt_cls(live, foreach=False, **kwargs)
    state = faccel_opt.init(params)
    for k, lr in enumerate(lrs):
        grads = _tensors(layout, 100 + k, dtype)
        inputs = (
            {name: t.clone() for name, t in params.items()},
            {name: g.clone() for name, g in grads.items()},
        )
        for p, g in zip(live, grads.values(), strict=True):
            p.grad = g.clone()
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        params, state = faccel_opt.update(grads, state, params, lr=lr)
        # update() is pure: its arguments are untouched.
        for before, now in ((inputs[0], None), (inputs[1], grads)):
            if now is not None:
                for name in before:
                    assert torch.equal(before[name], now[name])
        assert state.step == k + 1
        for (name, got), want in zip(params.items(), live, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0)
            for ours, theirs in buffer_keys.items():
                mine = getattr(state, ours)
                if mine is not None:
                    torch.testing.assert_close(mine[name], reference.state[want][theirs], rtol=1e-6, atol=0)


@given(
    kwargs=fst.adamw_hyperparams(),
    layout=fst.param_layouts,
    lr_scale=st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_pure_adamw_matches_torch_optim_adamw(
    kwargs: dict, layout: dict, lr_scale: list[float], dtype: torch.dtype
) -> None:
    import faccel

    buffers = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"}
    lrs = [kwargs["lr"] * s for s in lr_scale]
    _compare_with_torch(faccel.func.adamw(**kwargs), torch.optim.AdamW, kwargs, layout, lrs, dtype, buffers)


@given(
    kwargs=fst.sgd_hyperparams(),
    layout=fst.param_layouts,
    lr_scale=st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_pure_sgd_matches_torch_optim_sgd(
    kwargs: dict, layout: dict, lr_scale: list[float], dtype: torch.dtype
) -> None:
    import faccel

    lrs = [kwargs["lr"] * s for s in lr_scale]
    buffers = {"momentum_buffer": "momentum_buffer"}
    _compare_with_torch(faccel.func.sgd(**kwargs), torch.optim.SGD, kwargs, layout, lrs, dtype, buffers)


def test_the_optimizers_refuse_bad_hyperparameters_and_mismatched_trees() -> None:
    import faccel
    from faccel.errors import ArgumentError, FunctionalError

    for bad in (
        lambda: faccel.func.sgd(-0.1),
        lambda: faccel.func.sgd(0.1, nesterov=True),
        lambda: faccel.func.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
        lambda: faccel.func.adamw(betas=(0.9, 1.0)),
        lambda: faccel.func.adamw(eps=-1.0),
        lambda: faccel.func.adamw(weight_decay=-1.0),
    ):
        with pytest.raises(faccel.errors.ArgumentValueError, match=r"must|needs"):
            bad()
    with pytest.raises(ArgumentError):
        faccel.func.adamw(lr="fast")  # type: ignore[arg-type]

    params = {"a": torch.ones(2), "b": torch.ones(3)}
    opt = faccel.func.adamw()
    with pytest.raises(FunctionalError, match="grads must have the structure of params"):
        opt.update({"a": torch.ones(2)}, opt.init(params), params)
    with pytest.raises(FunctionalError, match="amsgrad=True"):
        faccel.func.adamw(amsgrad=True).update(params, opt.init(params), params)
    with pytest.raises(FunctionalError, match="SGDState made by init"):
        faccel.func.sgd(0.1, momentum=0.9).update(params, faccel.func.sgd(0.1).init(params), params)
    # The test suite's typeguard hook would refuse the wrong state type first; users
    # run without it, and get faccel's own message.
    with typeguard.suppress_type_checks(), pytest.raises(FunctionalError, match="AdamWState made by init"):
        opt.update(params, faccel.func.sgd(0.1).init(params), params)


# --- loss_and_grad ---------------------------------------------------------------------------


def _module_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_loss_and_grad_equals_the_modules_backward_with_either_engine() -> None:
    import faccel

    dist = faccel.detect({})
    model = faccel.prepare(dist, _seed_model())
    x, y = _data()
    want_loss, want = _module_grads(model, x, y)
    params, buffers = faccel.func.model_params(dist, model)
    for engine in ("autograd", "func"):
        grad_fn = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss, engine=engine)
        loss, grads = grad_fn(params, buffers, x, y)
        assert not loss.requires_grad and loss.item() == pytest.approx(want_loss, rel=1e-6)
        assert list(grads) == list(want)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-7)
        assert not any(p.requires_grad for p in params.values())  # the caller's tensors untouched


def test_loss_and_grad_with_aux_tuple_inputs_and_unused_parameters() -> None:
    import faccel

    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Bilinear(2, 3, 1)
            self.unused = torch.nn.Parameter(torch.ones(4))

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.mix(a, b)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = torch.nn.functional.mse_loss(out, target)
        return loss, {"mean_out": out.mean().detach()}

    dist = faccel.detect({})
    torch.manual_seed(0)
    model = TwoInputs()
    params, buffers = faccel.func.model_params(dist, model)
    a, b, y = torch.randn(5, 2), torch.randn(5, 3), torch.randn(5, 1)
    results = []
    for engine in ("autograd", "func"):
        grad_fn = faccel.func.loss_and_grad(dist, model, loss_fn, engine=engine, has_aux=True)
        (loss, aux), grads = grad_fn(params, buffers, (a, b), y)
        assert torch.equal(grads["unused"], torch.zeros(4))
        results.append((loss, aux["mean_out"], grads["mix.weight"]))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want)


def test_per_sample_gradients_through_vmap_average_to_the_batch_gradient() -> None:
    import faccel

    dist = faccel.detect({})
    model = _seed_model()
    params, buffers = faccel.func.model_params(dist, model)
    x, y = _data()
    grad_fn = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss, engine="func")
    losses, per_sample = torch.func.vmap(grad_fn, in_dims=(None, None, 0, 0))(params, buffers, x, y)
    assert losses.shape == (12,)
    loss, batch = grad_fn(params, buffers, x, y)
    torch.testing.assert_close(losses.mean(), loss)
    for name, g in batch.items():
        assert per_sample[name].shape == (12, *g.shape)
        torch.testing.assert_close(per_sample[name].mean(0), g, rtol=1e-5, atol=1e-6)


def test_an_ensemble_trained_under_vmap_equals_its_members_trained_alone() -> None:
    import faccel

    dist = faccel.detect({})
    members = [_seed_model(seed) for seed in range(3)]
    stacked, buffers = torch.func.stack_module_state(members)
    stacked = {name: t.detach() for name, t in stacked.items()}
    template = _seed_model()
    grad_fn = faccel.func.loss_and_grad(dist, template, torch.nn.functional.mse_loss, engine="func")
    ensemble_grads = torch.func.vmap(grad_fn, in_dims=(0, 0, None, None))
    opt = faccel.func.adamw(lr=1e-2)
    state = faccel.func.FunctionalState.create(params=stacked, buffers=buffers, optimizer=opt)
    alone = [
        faccel.func.FunctionalState.create(params=faccel.func.model_params(dist, m)[0], optimizer=opt)
        for m in members
    ]
    single = faccel.func.loss_and_grad(dist, template, torch.nn.functional.mse_loss)
    x, y = _data()
    for _ in range(4):
        losses, grads = ensemble_grads(state.params, state.buffers, x, y)
        state = state.apply_gradients(grads)  # elementwise updates: stacked tensors need no vmap
        alone = [s.apply_gradients(single(s.params, {}, x, y)[1]) for s in alone]
    assert losses.shape == (3,)
    for k, member in enumerate(alone):
        for name, p in member.params.items():
            torch.testing.assert_close(state.params[name][k], p, rtol=1e-5, atol=1e-6)


def test_loss_and_grad_applies_the_dists_precision() -> None:
    import faccel

    dist = faccel.DistState.simulated(precision="bf16")
    model = faccel.prepare(dist, _seed_model())  # an autocast wrapper: peeled, then re-applied
    params, buffers = faccel.func.model_params(dist, model)
    assert "0.weight" in params
    x, y = _data(n=4)
    loss, grads = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss)(params, buffers, x, y)
    assert loss.dtype == torch.float32 and grads["0.weight"].dtype == torch.float32
    full, _ = faccel.func.loss_and_grad(faccel.detect({}), model, torch.nn.functional.mse_loss)(
        params, buffers, x, y
    )
    assert loss.item() != full.item()  # bf16 rounding shows
    torch.testing.assert_close(loss, full, rtol=5e-2, atol=5e-2)


def test_loss_and_grad_refuses_an_unknown_engine() -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match="engine must be one of"):
        faccel.func.loss_and_grad(
            faccel.detect({}), _seed_model(), torch.nn.functional.mse_loss, engine="jax"
        )


def test_model_params_are_detached_copies_named_like_the_module() -> None:
    import faccel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    dist = faccel.DistState.simulated(rank=1, world_size=2)  # no peers: nothing to sync
    params, buffers = faccel.func.model_params(dist, faccel.prepare(dist, model))
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert list(buffers) == [n for n, _ in model.named_buffers()]
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p) and not params[name].requires_grad
        assert params[name].data_ptr() != p.data_ptr()


# --- sync_grads in one process ---------------------------------------------------------------


def test_sync_grads_is_the_identity_alone_and_refuses_a_simulated_world() -> None:
    import faccel
    from faccel.errors import ArgumentValueError, DistributedError

    grads = {"w": torch.ones(2), "nested": [torch.zeros(1), None]}
    assert faccel.func.sync_grads(faccel.detect({}), grads) is grads
    with pytest.raises(DistributedError, match="simulated with world_size=2"):
        faccel.func.sync_grads(faccel.DistState.simulated(rank=0, world_size=2), grads)
    with pytest.raises(ArgumentValueError, match="bucket_cap_mb must be > 0 or None, got 0"):
        faccel.func.sync_grads(faccel.detect({}), grads, bucket_cap_mb=0)


def test_sync_grads_without_a_process_group_says_how_to_start_one() -> None:
    import torch.distributed as tdist

    import faccel
    from faccel.errors import DistributedError

    if tdist.is_initialized():  # pragma: no cover - another test left a group running
        pytest.skip("a process group is running in this process")
    dist = faccel.DistState(rank=0, world_size=2, launcher="torchrun", master_addr="127.0.0.1", master_port=1)
    with pytest.raises(DistributedError, match="needs a running process group"):
        faccel.func.sync_grads(dist, {"w": torch.ones(1)})


@given(
    sizes=st.lists(
        st.tuples(st.integers(min_value=0, max_value=300), st.sampled_from(["f32", "f64", "bf16"])),
        max_size=20,
    ),
    cap_kb=st.none() | st.integers(min_value=1, max_value=2),
)
def test_buckets_partition_the_tensors_by_dtype_within_the_cap(sizes: list, cap_kb: int | None) -> None:
    from faccel._func._grad_sync import _buckets

    dtypes = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16}
    leaves: list[Any] = [torch.zeros(n, dtype=dtypes[d]) for n, d in sizes]
    leaves.insert(len(leaves) // 2, None)
    cap = None if cap_kb is None else cap_kb * 1024
    buckets = _buckets(leaves, cap)
    flat = sorted(i for bucket in buckets for i in bucket)
    assert flat == [i for i, leaf in enumerate(leaves) if leaf is not None]  # each tensor once
    for bucket in buckets:
        assert bucket == sorted(bucket) and len({leaves[i].dtype for i in bucket}) == 1
        nbytes = sum(leaves[i].numel() * leaves[i].element_size() for i in bucket)
        assert cap is None or nbytes <= cap or len(bucket) == 1
    if cap is None:
        assert len(buckets) == len({leaf.dtype for leaf in leaves if leaf is not None})


@given(
    shapes=st.lists(fst.tensor_shapes, min_size=1, max_size=12),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.float64]), min_size=12, max_size=12),
    cap_kb=st.none() | st.integers(min_value=1, max_value=2),
)
def test_grad_buckets_lay_every_tensor_out_once_in_order_in_its_dtypes_buffer(
    shapes: list, dtypes: list, cap_kb: int | None
) -> None:
    import faccel
    from faccel._func._grad_sync import _buckets

    like = [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=False)]
    cap_mb = None if cap_kb is None else cap_kb / 1024
    dist = faccel.DistState.simulated(rank=0, world_size=2)
    buckets = faccel.func.grad_buckets(dist, like, bucket_cap_mb=cap_mb)

    assert [list(m) for m in buckets.members] == _buckets(like, None if cap_kb is None else cap_kb * 1024)
    for buffer, members, views in zip(buckets.buffers, buckets.members, buckets.views, strict=True):
        offset = 0
        for i, view in zip(members, views, strict=True):
            assert view.shape == like[i].shape and view.dtype == like[i].dtype == buffer.dtype
            if view.numel():  # an empty view's address is anyone's
                assert view.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()
            offset += view.numel()
        assert offset == buffer.numel()  # the views tile the buffer, nothing left over


def test_grad_buckets_allocate_nothing_alone_and_refuse_what_sync_grads_refuses() -> None:
    import faccel
    from faccel.errors import FunctionalError

    alone = faccel.detect({})
    grads = {"w": torch.ones(3)}
    buckets = faccel.func.grad_buckets(alone, grads)
    assert buckets.buffers == () and faccel.func.sync_grads(alone, grads, buckets=buckets) is grads
    # Checked alone too: a misfit shows on a laptop before it reaches a cluster.
    with pytest.raises(
        FunctionalError, match=r"leaf \['w'\] is a \(2,\) torch.float32 tensor on cpu, expected \(3,\)"
    ):
        faccel.func.sync_grads(alone, {"w": torch.ones(2)}, buckets=buckets)
    with pytest.raises(FunctionalError, match="its structure differs"):
        faccel.func.sync_grads(alone, [torch.ones(3)], buckets=buckets)
    made_for_two = faccel.func.grad_buckets(faccel.DistState.simulated(rank=0, world_size=2), grads)
    with pytest.raises(FunctionalError, match="made for world_size=2, this is a world of 1"):
        faccel.func.sync_grads(alone, grads, buckets=made_for_two)
    # A dict of Parameters (named_parameters) makes the token its plain gradients will have.
    layer = torch.nn.Linear(2, 1)
    assert faccel.func.grad_buckets(alone, dict(layer.named_parameters())).token == ("weight", "bias")
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"bucket_cap_mb must be > 0 .* got -1\.0"):
        faccel.func.grad_buckets(alone, grads, bucket_cap_mb=-1.0)
    with pytest.raises(FunctionalError, match="int64"):
        faccel.func.grad_buckets(alone, {"step": torch.zeros(1, dtype=torch.int64)})


# --- FunctionalState -------------------------------------------------------------------------


def test_functional_state_apply_gradients_is_the_optimizer_update() -> None:
    import faccel

    params = {"w": torch.randn(3), "b": torch.randn(1)}
    grads = {"w": torch.randn(3), "b": torch.randn(1)}
    opt = faccel.func.adamw(lr=0.1, amsgrad=True)
    state = faccel.func.FunctionalState.create(params=params, optimizer=opt)
    new = state.apply_gradients(grads, lr=0.05)
    want_params, want_opt = opt.update(grads, opt.init(params), params, lr=0.05)
    assert (new.step, new.opt_state.step, state.step) == (1, 1, 0)
    for name in params:
        assert torch.equal(new.params[name], want_params[name])
        assert torch.equal(new.opt_state.exp_avg[name], want_opt.exp_avg[name])
        assert torch.equal(state.params[name], params[name])  # the old state is intact
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        new.step = 5  # type: ignore[misc]


def test_the_autograd_engine_under_vmap_says_to_use_the_func_engine() -> None:
    import faccel
    from faccel.errors import FunctionalError

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 1)
    params, buffers = faccel.func.model_params(dist, model)
    grad_fn = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss)
    with pytest.raises(FunctionalError, match="engine='func'"):
        torch.func.vmap(grad_fn, in_dims=(None, None, 0, 0))(
            params, buffers, torch.randn(3, 2), torch.randn(3, 1)
        )


def _example(name: str) -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_run_in_one_process_and_the_functional_seed_matches_the_seed_loop() -> None:
    functional = _example("functional_seed").main(epochs=2)
    plain = _example("seed_loop").main(epochs=2)
    assert functional == pytest.approx(plain, rel=1e-5)
    losses = _example("ensemble_vmap").main(members=3, epochs=1)
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)


def test_a_functional_state_checkpoints_and_restores_bitwise(tmp_path: Any) -> None:
    import faccel
    from faccel.errors import FunctionalError

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    dist = faccel.detect({})
    template = model()
    params, buffers = faccel.func.model_params(dist, template)
    opt = faccel.func.adamw(lr=1e-2, amsgrad=True)
    state = faccel.func.FunctionalState.create(params=params, buffers=buffers, optimizer=opt)
    grad_fn = faccel.func.loss_and_grad(dist, template, torch.nn.functional.mse_loss)
    x, y = _data()
    for _ in range(3):  # the forward updates the BatchNorm buffers in place, as functional_call does
        state = state.apply_gradients(grad_fn(state.params, state.buffers, x, y)[1])

    # No torch optimizer: the functional optimizer's state travels in the extras.
    def train_state(module: torch.nn.Module, functional: Any) -> Any:
        return faccel.TrainState.create(
            model=module,
            optimizer=None,
            step=functional.step,
            extras={"functional": functional.state_dict()},
        )

    faccel.checkpoint(dist, train_state(template, state), tmp_path)
    other = model()
    fresh_params, fresh_buffers = faccel.func.model_params(dist, other)
    fresh = faccel.func.FunctionalState.create(params=fresh_params, buffers=fresh_buffers, optimizer=opt)
    restored = faccel.restore(dist, train_state(other, fresh), tmp_path)
    back = faccel.func.FunctionalState.from_state_dict(restored.extras["functional"], optimizer=opt)

    assert (restored.step, back.step, back.opt_state.step, back.optimizer) == (3, 3, 3, opt)
    saved_leaves, saved_spec = pytree.tree_flatten(state)
    back_leaves, back_spec = pytree.tree_flatten(back)
    assert back_spec == saved_spec and len(back_leaves) == 4 * len(params) + len(buffers)
    for a, b in zip(back_leaves, saved_leaves, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)  # bitwise, int64 num_batches_tracked included

    # Training goes on exactly as it would have (each forward updates its own state's buffers).
    def step(s: Any) -> Any:
        return s.apply_gradients(grad_fn(s.params, s.buffers, x, y)[1])

    for a, b in zip(pytree.tree_leaves(step(back)), pytree.tree_leaves(step(state)), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(FunctionalError, match="max_exp_avg_sq"):
        faccel.func.FunctionalState.from_state_dict(
            restored.extras["functional"], optimizer=faccel.func.adamw()
        )
    with pytest.raises(FunctionalError, match="state_dict"):
        faccel.func.FunctionalState.from_state_dict({"params": {}}, optimizer=opt)


def test_buckets_refuse_integer_tensors() -> None:
    from faccel._func._grad_sync import _buckets
    from faccel.errors import FunctionalError

    with pytest.raises(FunctionalError, match=r"leaf 1 is a torch\.int64 tensor"):
        _buckets([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], None)


# --- the optimizer protocol and parameter groups ---------------------------------------------


class _TinyGPT(torch.nn.Module):
    """nanoGPT's parameter kinds: embeddings, LayerNorm weights and biases, Linear weights and biases."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.ln = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.proj = torch.nn.Linear(4 * width, width)
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        x = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))
        return self.head(self.ln_f(x))


def _decay_matrices(params: dict[str, torch.Tensor]) -> dict[str, str]:
    """nanoGPT's configure_optimizers split: weight decay for every tensor of 2 or more dimensions."""
    return {name: "decay" if p.dim() >= 2 else "no_decay" for name, p in params.items()}


def test_nanogpt_configure_optimizers_as_param_groups_is_torch_adamw_bit_for_bit() -> None:
    import faccel
    from faccel.errors import FunctionalError

    torch.manual_seed(0)
    module = _TinyGPT()
    torch.manual_seed(0)
    reference = _TinyGPT()
    lr, betas, weight_decay = 3e-2, (0.9, 0.95), 0.1

    # nanoGPT's configure_optimizers, as it is written for torch.optim.
    decay = [p for p in reference.parameters() if p.dim() >= 2]
    no_decay = [p for p in reference.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        foreach=False,
    )
    # The same, functionally.
    opt = faccel.func.param_groups(
        _decay_matrices,
        {
            "decay": faccel.func.adamw(lr, betas=betas, weight_decay=weight_decay),
            "no_decay": faccel.func.adamw(lr, betas=betas, weight_decay=0.0),
        },
    )
    dist = faccel.detect({})
    params, buffers = faccel.func.model_params(dist, module)
    state = faccel.func.FunctionalState.create(params=params, buffers=buffers, optimizer=opt)
    assert sorted(state.opt_state.groups["decay"].exp_avg) == [
        "fc.weight",
        "head.weight",
        "proj.weight",
        "wte.weight",
    ]
    assert len(state.opt_state.groups["no_decay"].exp_avg) == 6  # biases and LayerNorm weights

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    grad_fn = faccel.func.loss_and_grad(dist, module, loss_fn)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        idx, targets = torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)
        step_lr = lr * (1 - step / 10)  # a schedule: every group's lr set, as nanoGPT's loop does
        torch_opt.zero_grad()
        loss_fn(reference(idx), targets).backward()
        for group in torch_opt.param_groups:
            group["lr"] = step_lr
        torch_opt.step()
        _, grads = grad_fn(state.params, state.buffers, idx, targets)
        state = state.apply_gradients(grads, lr=step_lr)
        for name, p in reference.named_parameters():
            assert torch.equal(state.params[name], p.detach()), (step, name)
    for name, p in reference.named_parameters():
        group = "decay" if p.dim() >= 2 else "no_decay"
        ours = state.opt_state.groups[group]
        assert torch.equal(ours.exp_avg[name], torch_opt.state[p]["exp_avg"])
        assert torch.equal(ours.exp_avg_sq[name], torch_opt.state[p]["exp_avg_sq"])
        assert ours.step == 5

    # The grouped state checkpoints like any other, and the check sees groups that moved.
    again = faccel.func.FunctionalState.from_state_dict(state.state_dict(), optimizer=opt)
    for a, b in zip(pytree.tree_leaves(again), pytree.tree_leaves(state), strict=True):
        assert torch.equal(a, b)
    all_decay = faccel.func.param_groups(lambda params: dict.fromkeys(params, "decay"), dict(opt.optimizers))
    with pytest.raises(FunctionalError, match=r"groups\['decay'\]\.exp_avg"):
        faccel.func.FunctionalState.from_state_dict(state.state_dict(), optimizer=all_decay)


def test_param_groups_work_on_any_tree_and_refuse_what_does_not_fit() -> None:
    import faccel
    from faccel.errors import FunctionalError

    # A list of tensors: groups key their states by path; per-group lr and optimizer kind.
    opt = faccel.func.param_groups(
        lambda params: ["fast", "slow", "fast"],
        {"fast": faccel.func.sgd(1.0, momentum=0.5), "slow": faccel.func.adamw(0.1, weight_decay=0.0)},
    )
    params = [torch.ones(2), torch.ones(3), torch.ones(1)]
    state = opt.init(params)
    assert sorted(state.groups["fast"].momentum_buffer) == ["[0]", "[2]"]
    grads = [torch.ones(2), torch.ones(3), torch.ones(1)]
    new, state = opt.update(grads, state, params)
    assert type(new) is list and new[0].tolist() == [0.0, 0.0] and new[2].tolist() == [0.0]
    want, _ = faccel.func.adamw(0.1, weight_decay=0.0).update(
        {"x": grads[1]}, faccel.func.adamw(0.1, weight_decay=0.0).init({"x": params[1]}), {"x": params[1]}
    )
    assert torch.equal(new[1], want["x"])
    assert params[0].tolist() == [1.0, 1.0]  # nothing given is modified
    assert isinstance(opt, faccel.func.Optimizer) and hash(opt) == hash(opt)

    with pytest.raises(FunctionalError, match="'medium', which is not one of the groups"):
        faccel.func.param_groups(lambda p: ["medium"] * 3, dict(opt.optimizers)).init(params)
    with pytest.raises(FunctionalError, match="labels\\(params\\) must have the structure of params"):
        faccel.func.param_groups(lambda p: ["fast"], dict(opt.optimizers)).init(params)
    with pytest.raises(faccel.errors.ArgumentValueError, match="at least one group"):
        faccel.func.param_groups(lambda p: p, {})
    with (
        pytest.raises(FunctionalError, match="ParamGroupsState made by init"),
        typeguard.suppress_type_checks(),
    ):
        opt.update(grads, faccel.func.sgd(0.1).init(params), params)
    with pytest.raises(FunctionalError, match="grads must have the structure of params"):
        opt.update(grads[:2], state, params)


def test_a_new_optimizer_is_a_new_record_that_functional_state_takes_as_it_is() -> None:
    import faccel
    from faccel.errors import FunctionalError

    # signSGD with a step counter, written against the protocol alone (no faccel edit).
    @faccel.func.register_pytree
    @attrs.frozen(kw_only=True)
    class SignState:
        last_sign: Any
        step: int = faccel.func.static_field(default=0)

    @attrs.frozen(kw_only=True)
    class SignSGD:
        lr: float

        def init(self, params: Any) -> SignState:
            return SignState(last_sign=faccel.func.tree_map(torch.zeros_like, params))

        def update(
            self, grads: Any, state: SignState, params: Any, *, lr: float | None = None
        ) -> tuple[Any, SignState]:
            rate = self.lr if lr is None else lr
            signs = faccel.func.tree_map(torch.sign, grads)
            new = faccel.func.tree_map(lambda p, s: p - rate * s, params, signs)
            return new, SignState(last_sign=signs, step=state.step + 1)

    opt = SignSGD(lr=0.5)
    assert isinstance(opt, faccel.func.Optimizer)
    state = faccel.func.FunctionalState.create(params={"w": torch.zeros(3)}, optimizer=opt)
    state = state.apply_gradients({"w": torch.tensor([2.0, -3.0, 0.0])})
    state = state.apply_gradients({"w": torch.tensor([1.0, 1.0, 1.0])}, lr=0.25)
    assert state.params["w"].tolist() == [-0.75, 0.25, -0.25] and state.opt_state.step == 2

    saved = state.state_dict()
    assert saved["opt_state"] == {"last_sign": state.opt_state.last_sign, "step": 2}
    back = faccel.func.FunctionalState.from_state_dict(saved, optimizer=opt)
    assert type(back.opt_state) is SignState and back.opt_state.step == 2
    assert back.opt_state.last_sign["w"] is state.opt_state.last_sign["w"]  # not copied
    wrong_step = {**saved, "opt_state": {**saved["opt_state"], "step": 2.0}}
    with pytest.raises(FunctionalError, match=r"state's step does not fit .*expected int, got float"):
        faccel.func.FunctionalState.from_state_dict(wrong_step, optimizer=opt)
    wrong_shape = {**saved, "opt_state": {"last_sign": {"w": torch.zeros(2)}, "step": 2}}
    with pytest.raises(FunctionalError, match=r"last_sign\['w'\] does not fit .*\(3,\) tensor"):
        faccel.func.FunctionalState.from_state_dict(wrong_shape, optimizer=opt)
    with pytest.raises(FunctionalError, match="as a dict of"):
        faccel.func.FunctionalState.from_state_dict({**saved, "opt_state": {"step": 2}}, optimizer=opt)
