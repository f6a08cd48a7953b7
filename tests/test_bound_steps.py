"""Bound calls: a kernel specialized for one input shape (kernels' bind_* functions, a tactic's
Tactic.bind) gives the general call's outputs bit for bit, at both SIMD widths; a session's
kernel step binds its tactic after a checked call, per input shapes and thread count, takes
the bound call on the runs after, and stays on the checked path where a tactic declines."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_close, assert_fuses, run_bound, run_ort

import fusion

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def assert_same(bound, general, what=""):
    assert bound.shape == general.shape and bound.dtype == general.dtype, what
    np.testing.assert_array_equal(bound, general, err_msg=what)


@pytest.mark.parametrize("block", [8, 16])
def test_bound_convs_match_the_general_call(block):
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc, prepare_conv_nchwc

    cases = [  # weight shape, group, stride, pads, residual, input shape
        ((24, 16, 1, 1), 1, 1, 0, None, (2, 16, 7, 9)),
        ((20, 20, 3, 3), 1, 1, 1, "after", (1, 20, 13, 13)),
        ((20, 20, 3, 3), 1, 2, 1, None, (3, 20, 11, 8)),
        ((40, 1, 3, 3), 40, 2, 1, None, (2, 40, 14, 14)),  # depthwise
        ((17, 1, 5, 5), 17, 1, 2, None, (1, 17, 9, 9)),
    ]
    for wshape, group, s, p, residual, xshape in cases:
        plan = prepare_conv_nchwc(rand(*wshape), rand(wshape[0]), strides=(s, s),
                                  pads=(p,) * 4, group=group, activation="relu",
                                  residual=residual, block=block)  # fmt: skip
        x, x2 = (to_blocked(rand(*xshape), block) for _ in range(2))
        r = r2 = None
        if residual:
            r, r2 = (np.ascontiguousarray(conv_nchwc(v, plan, residual=v) * 0.5) for v in (x, x2))
        call = bind_conv_nchwc(x, plan, residual=r)
        for v, res in ((x, r), (x2, r2)):
            want = conv_nchwc(v, plan, residual=res)
            assert_same(call(v, res), want, f"{wshape} {xshape}")


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("tile", [2, 4])
def test_bound_winograd_matches_the_general_call_and_its_fallback(block, tile):
    """The bound Winograd call, whole or writing a part of a larger output, gives the general
    call's outputs; an inf or NaN in x sends both to the direct conv (onnxruntime's NaNs)."""
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc, prepare_conv_nchwc
    from fusion_kernels.winograd_nchwc import (
        bind_winograd_nchwc,
        prepare_winograd_nchwc,
        winograd_nchwc,
    )

    c, m = 20, 24
    w, bias = rand(m, c, 3, 3), rand(m)
    for residual in (None, "after"):
        plan = prepare_winograd_nchwc(w, bias, tile=tile, block=block, pads=(1,) * 4,
                                      activation="relu", residual=residual)  # fmt: skip
        x, x2 = (to_blocked(rand(2, c, 9, 11), block) for _ in range(2))
        x2[1, 0, 3, 4, 0] = np.nan
        r = r2 = None
        if residual:
            r, r2 = (to_blocked(rand(2, m, 9, 11), block) for _ in range(2))
        call = bind_winograd_nchwc(x, plan, residual=r)
        for v, res in ((x, r), (x2, r2)):
            assert_same(call(v, res), winograd_nchwc(v, plan, residual=res), f"{residual}")
    # parts of a concatenation: a direct conv's blocks, then the Winograd conv's
    first = prepare_conv_nchwc(rand(8, c, 1, 1), rand(8), block=block)
    wino = prepare_winograd_nchwc(w, bias, tile=tile, block=block, pads=(1,) * 4)
    x, x2 = (to_blocked(rand(2, c, 9, 11), block) for _ in range(2))
    x2[0, 1, 0, 0, 1] = np.inf
    blocks = first.out_blocks + wino.direct.out_blocks
    out = np.zeros((2, blocks, 9, 11, block), np.float32)
    parts = [bind_conv_nchwc(x, first, out=out, at=0),
             bind_winograd_nchwc(x, wino, out=out, at=first.out_blocks)]  # fmt: skip
    for v in (x, x2):
        want = np.full_like(out, 7.0)
        conv_nchwc(v, first, out=want, at=0)
        winograd_nchwc(v, wino, out=want, at=first.out_blocks)
        got = np.full_like(out, 7.0)
        for part in parts:
            assert part(v, got) is got
        assert_same(got, want)


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("one_region", [False, True])
def test_bound_squeeze_excitation_matches_the_general_calls(block, one_region):
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc, prepare_conv_nchwc
    from fusion_kernels.simd.activation import encode
    from fusion_kernels.squeeze_excite import (
        bind_gated_weights,
        bind_squeeze_excite_blocked,
        gated_weights,
        prepare_squeeze_excite,
        squeeze_excite_blocked,
    )

    for n, c, hidden, m, hw in [(1, 20, 5, 12, 7), (3, 40, 8, 17, 5), (2, 16, 4, 16, 1)]:
        se = prepare_squeeze_excite(rand(hidden, c, 1, 1), rand(hidden), rand(c, hidden, 1, 1),
                                    rand(c), encode("silu"), encode("sigmoid"))  # fmt: skip
        conv = prepare_conv_nchwc(rand(m, c, 1, 1), rand(m), block=block, in_block=block)
        x, x2 = (to_blocked(rand(n, c, hw, hw), block) for _ in range(2))
        gate = bind_squeeze_excite_blocked(x, se, one_region=one_region)
        weights = bind_gated_weights(x, se, conv, one_region)
        folded = bind_conv_nchwc(x, conv, weights=weights(x))
        # x2 a view into a longer buffer (a concatenation that a later one extends, batch > 1)
        longer = to_blocked(rand(n, c + 2 * block, hw, hw), block)
        x2 = longer[:, : x.shape[1]]
        x2[...] = to_blocked(rand(n, c, hw, hw), block)
        for v in (x, x2):
            assert_same(gate(v), squeeze_excite_blocked(v, se, one_region=one_region))
            want = gated_weights(v, se, conv, one_region)
            assert_same(weights(v), want)
            assert_same(folded(v, None, weights(v)), conv_nchwc(v, conv, weights=want))


@pytest.mark.parametrize("block", [8, 16])
def test_bound_pools_match_the_general_calls_on_views_too(block):
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.pool import (
        bind_global_average_pool_blocked,
        bind_maxpool_blocked,
        global_average_pool_blocked,
        maxpool_blocked,
    )
    from fusion_kernels.windows import prepare_maxpool

    plan = prepare_maxpool((3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    x = to_blocked(rand(3, 40, 13, 11), block)
    longer = to_blocked(rand(3, 40 + 2 * block, 13, 11), block)
    view = longer[:, : x.shape[1]]  # a concatenation's prefix: strided at batch > 1
    gap, pool = bind_global_average_pool_blocked(x, 40), bind_maxpool_blocked(x, plan)
    for v in (x, view):
        assert_same(gap(v), global_average_pool_blocked(v, 40))
        assert_same(pool(v), maxpool_blocked(v, plan))


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("parts", [1, 2])
def test_bound_inverted_residual_matches_the_general_call(monkeypatch, block, parts):
    import fusion_kernels.inverted_residual as K
    from fusion_kernels.blocked import to_blocked
    from fusion_kernels.config import get_threads, set_threads

    if parts == 2:  # one small image, its expanded channels cut in two parts (partial sums)
        monkeypatch.setattr(K, "channel_cuts", lambda *a: K.block_cuts(-(-a[1] // a[10]), 1, 2))
    hswish = ("hard_swish",)
    for c, t, m, s, hw, batch, residual in [(32, 6, 32, 1, 7, 1, "after"),
                                            (24, 4, 40, 2, 13, 2, None),
                                            (40, 1, 40, 1, 7, 1, "after")]:  # fmt: skip
        e = c * t
        expand = (rand(e, c, 1, 1), rand(e)) if t > 1 else (None, None)
        plan = K.prepare_inverted_residual(*expand, rand(e, 1, 3, 3), rand(e),
                                           rand(m, e, 1, 1), rand(m), stride=s,
                                           acts=(hswish, hswish, None), residual=residual,
                                           block=block)  # fmt: skip
        x, x2 = (to_blocked(rand(batch, c, hw, hw), block) for _ in range(2))
        threads = get_threads()
        set_threads(2)
        try:
            call = K.bind_inverted_residual(x, plan)
            for v in (x, x2):
                assert_same(call(v), K.inverted_residual(v, plan), f"{c} {t} {m} {s}")
            if parts == 2 and batch == 1:
                (launch,) = plan.launches.values()
                assert launch.split == 2
        finally:
            set_threads(threads)


def conv_chain(c=16, hw=9):
    """x -> conv 3x3 + relu -> conv 1x1 + x -> relu: two ConvBiasRelu nodes, the second with a
    residual."""
    g = GraphBuilder(opset=17)
    y = g.node("Relu", [g.node("Conv", ["x", g.weight(c, c, 3, 3), g.weight(c)], pads=[1] * 4)])
    z = g.node("Add", [g.node("Conv", [y, g.weight(c, c, 1, 1), g.weight(c)]), "x"])
    return g.model({"x": ["N", c, hw, hw]}, [g.node("Relu", [z])])


def conv_chain_session():
    """conv_chain fused, a session on its first tactics (untimed), feeds of batch 2 and
    onnxruntime's outputs on the original."""
    model = conv_chain()
    result = assert_fuses(model, ["ConvBiasRelu", "ConvBiasRelu"])
    session = fusion.Session(result.model, threads=2, fuse=False, tactics="kernel")
    feeds = {"x": rand(2, 16, 9, 9)}
    return model, result, session, feeds, run_ort(model, feeds)[0]


def kernel_steps(session, feeds):
    return [s for s in session._plans.for_values(feeds).plan.steps if s.kind == "kernel"]


def test_a_step_binds_per_input_shape_and_thread_count():
    from fusion_kernels.config import get_threads, set_threads

    model, result, session, feeds, want = conv_chain_session()
    assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5)
    steps = kernel_steps(session, feeds)
    assert steps and all(len(s._bound) == 1 and all(s._bound.values()) for s in steps)
    # another batch through the same plan (untimed tactics: one plan for every shape): bound
    # for that shape too, the first still there
    other = {"x": rand(3, 16, 9, 9)}
    for _ in range(2):
        assert_close(session.run(None, other)[0], run_ort(model, other)[0], 1e-4, 1e-5)
    assert all(len(s._bound) == 2 for s in kernel_steps(session, feeds))
    # a step called under another thread count does not take a call bound for two threads
    values = dict(session._base, **feeds)
    threads = get_threads()
    set_threads(1)
    try:
        for step in session._plans.for_values(feeds).plan.steps:
            step(values)
    finally:
        set_threads(threads)
    assert all(len(s._bound) == 3 for s in steps)
    assert_close(values[result.model.graph.output[0].name], want, 1e-4, 1e-5)


def test_a_tactic_that_declines_stays_on_the_checked_path():
    """The op-by-op inverted residual re-blocks an input narrower than a block on every call
    (C = 3 under any width, expansion 1): its bind declines, the step keeps checking."""
    g = GraphBuilder(opset=17)
    d = g.node("Clip", [g.node("Conv", ["x", g.weight(3, 1, 3, 3), g.weight(3)], group=3,
                                pads=[1] * 4), g.const(np.array(0, np.float32)),
                        g.const(np.array(6, np.float32))])  # fmt: skip
    y = g.node("Add", [g.node("Conv", [d, g.weight(3, 3, 1, 1), g.weight(3)]), "x"])
    model = g.model({"x": ["N", 3, 7, 7]}, [y])
    result = assert_fuses(model, ["InvertedResidual"], rtol=1e-4)
    feeds = {"x": rand(2, 3, 7, 7)}
    (want,) = run_ort(model, feeds)
    session = fusion.Session(result.model, threads=2, fuse=False, tactics="blocked-opbyop")
    assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5)
    (step,) = kernel_steps(session, feeds)
    assert step.choice == "blocked-opbyop" and list(step._bound.values()) == [False]


def test_a_bind_that_fails_warns_and_the_step_stays_on_the_checked_path():
    from fusion.errors import FusionWarning

    _, _, session, feeds, want = conv_chain_session()
    first = kernel_steps(session, feeds)[0]

    def broken(*_args):
        raise ValueError("no such launch")

    first.bind = broken
    with pytest.warns(FusionWarning, match="could not be bound.*no such launch"):
        (got,) = session.run(None, feeds)
    assert_close(got, want, 1e-4, 1e-5)
    assert list(first._bound.values()) == [False]
    assert_close(run_bound(session, feeds)[0], want, 1e-4, 1e-5)  # checked, every time


def count_replays(monkeypatch) -> list:
    """Each RunPlan program replay (fusion.runtime.steps._replay) appends its calls' count."""
    from fusion.runtime import steps

    seen, replay = [], steps._replay

    def counted(calls, values):
        seen.append(len(calls))
        return replay(calls, values)

    monkeypatch.setattr(steps, "_replay", counted)
    return seen


def test_a_plan_replays_its_bound_calls_per_input_shape(monkeypatch):
    """After a run whose kernel steps took their bound calls, the plan replays them on inputs
    of the same shapes, bit for bit the steps' outputs; inputs of another shape run the steps
    (and record theirs); a profile and a run keeping every value run the steps."""
    model, result, session, feeds, want = conv_chain_session()
    replays = count_replays(monkeypatch)
    got = run_bound(session, feeds)[0]
    assert_close(got, want, 1e-4, 1e-5)
    plan = session._plans.for_values(feeds).plan
    assert replays == [len(plan.steps)] and list(plan.programs) == [(2, (2, 16, 9, 9))]
    other = {"x": rand(3, 16, 9, 9)}
    for _ in range(2):  # checked and bound, then bound and recorded: no replay yet
        assert_close(session.run(None, other)[0], run_ort(model, other)[0], 1e-4, 1e-5)
        assert len(replays) == 1
    assert list(plan.programs) == [(2, (2, 16, 9, 9)), (2, (3, 16, 9, 9))]
    np.testing.assert_array_equal(session.run(None, other)[0], session.run(None, other)[0])
    assert len(replays) == 3
    np.testing.assert_array_equal(session.run(None, feeds)[0], got)  # the first shape's, kept
    assert len(replays) == 4
    session.profile(feeds, repeat=2, warmup=0)
    values = session.run_with_intermediates(feeds)
    assert len(replays) == 4  # neither replays: one times each step, one keeps every value
    assert all(s.outputs[0] in values for s in kernel_steps(session, feeds))
    np.testing.assert_array_equal(values[result.model.graph.output[0].name], got)


def test_a_replay_calls_a_step_that_did_not_bind_as_a_step(monkeypatch):
    """A tactic that declines to bind (the op-by-op inverted residual on a 3-channel input)
    stays a step in the replay, with its checks; the conversions around it too."""
    g = GraphBuilder(opset=17)
    d = g.node("Clip", [g.node("Conv", ["x", g.weight(3, 1, 3, 3), g.weight(3)], group=3,
                                pads=[1] * 4), g.const(np.array(0, np.float32)),
                        g.const(np.array(6, np.float32))])  # fmt: skip
    y = g.node("Add", [g.node("Conv", [d, g.weight(3, 3, 1, 1), g.weight(3)]), "x"])
    model = g.model({"x": ["N", 3, 7, 7]}, [g.node("Relu", [y])])
    result = assert_fuses(model, ["InvertedResidual"], rtol=1e-4)
    feeds = {"x": rand(2, 3, 7, 7)}
    session = fusion.Session(result.model, threads=2, fuse=False, tactics="blocked-opbyop")
    replays = count_replays(monkeypatch)
    assert_close(run_bound(session, feeds)[0], run_ort(model, feeds)[0], 1e-4, 1e-5)
    plan = session._plans.for_values(feeds).plan
    assert replays == [len(plan.steps)] * 2  # nothing bound in the first run: recorded then
    (calls,) = plan.programs.values()
    assert all(run is None for run, *_ in calls)  # each called as a step


def test_a_plan_with_an_island_runs_its_steps(monkeypatch):
    """An island may compute a shape from values, which the replay's key (the shapes of the
    plan's inputs) would not see: a plan with one runs its steps, each checking its own."""
    g = GraphBuilder(opset=17)
    y = g.node("Relu", [g.node("Conv", ["x", g.weight(16, 16, 1, 1), g.weight(16)])])
    model = g.model({"x": ["N", 16, 5, 5]}, [g.node("Softmax", [y], axis=1)])
    result = assert_fuses(model, ["ConvBiasRelu"])
    session = fusion.Session(result.model, threads=2, fuse=False, tactics="kernel")
    feeds = {"x": rand(2, 16, 5, 5)}
    replays = count_replays(monkeypatch)
    assert_close(run_bound(session, feeds)[0], run_ort(model, feeds)[0], 1e-4, 1e-5)
    plan = session._plans.for_values(feeds).plan
    assert any(s.kind == "island" for s in plan.steps)
    assert replays == [] and not plan.programs


def test_a_value_that_is_not_a_float_array_keeps_the_steps():
    """A plan's key is its inputs' shapes; an integer input (a Reshape's target a model feeds
    to a fused linear) may set a kernel's output shape by its values: no replay then."""
    _, _, session, feeds, _ = conv_chain_session()
    run_bound(session, feeds)
    plan = session._plans.for_values(feeds).plan
    assert plan._key(feeds) == (2, (2, 16, 9, 9))
    assert plan._key({"x": feeds["x"].astype(np.int64)}) is None
    assert plan._key({"x": feeds["x"].tolist()}) is None


@pytest.mark.parametrize("width", [8, 16])
def test_bound_dense_products_match_the_general_call(width):
    """The bound product (LinearAct's, LinearGelu's) gives dense_gemm's outputs on rows of
    1 to 100, with and without a residual (one row broadcast, or whole), x read-only too."""
    from fusion_kernels.dense_gemm import bind_dense_gemm, dense_gemm, prepare_dense
    from fusion_kernels.simd.activation import encode

    for m, k, n, residual in ((1, 17, 33, None), (3, 40, 24, "row"), (17, 64, 100, "whole"),
                              (100, 31, 7, None), (0, 8, 8, None)):  # fmt: skip
        plan = prepare_dense(rand(k, n), rand(n), encode("gelu"), width=width)
        x, x2 = rand(m, k), rand(m, k)
        r = {None: None, "row": rand(1, n), "whole": rand(m, n)}[residual]
        call = bind_dense_gemm(x, plan, r)
        for v in (x, x2):
            assert_same(call(v, r), dense_gemm(v, plan, r), f"{m} {k} {n} {residual}")
        x2.flags.writeable = False
        call = bind_dense_gemm(x2, plan, r)
        assert_same(call(x2, r), dense_gemm(x2, plan, r), f"read-only {m} {k} {n}")


def test_a_bound_linear_with_other_reshape_targets_runs_unbound():
    """LinearGelu's bound call is keyed on shapes; the Reshapes' targets are values (computed
    at run time in dynamo's exports): other values than the bound ones take the general run."""
    from fusion_patterns.linear_gelu import make_kernel

    w, b = rand(8, 6), rand(6)
    run = make_kernel({"fc_linear": [0.0, 1.0, 1.0], "activation": "gelu"}, [None, w, None, b])
    (tactic,) = run.tactics
    x = rand(2, 3, 8)
    flat, unflat = np.array([-1, 8], np.int64), np.array([2, 3, 6], np.int64)
    bound = tactic.bind(x, w, None, b, flat, unflat)
    want = run(x, w, None, b, flat, unflat)[0]
    assert want.shape == (2, 3, 6)
    assert_same(bound(x, w, None, b, flat, unflat)[0], want)
    other = np.array([6, 6], np.int64)  # the same product, another output shape
    assert_same(bound(x, w, None, b, flat, other)[0], run(x, w, None, b, flat, other)[0])
    assert bound(x, w, None, b, flat, other)[0].shape == (6, 6)


def test_a_bound_call_that_raises_is_a_kernel_error_naming_its_node():
    """Bound or replayed, a kernel that raises is the step's KernelError (as a checked call's):
    its kernel and node named, the cause kept; the plan runs again once the kernel does."""
    from fusion.errors import KernelError

    _, result, session, feeds, want = conv_chain_session()
    run_bound(session, feeds)
    plan = session._plans.for_values(feeds).plan
    (calls,) = plan.programs.values()
    k = next(i for i, c in enumerate(calls) if c[0] is not None)
    run, step = calls[k][:2]

    def broken(*_args):
        raise RuntimeError("a kernel fault")

    calls[k] = (broken, *calls[k][1:])  # the replay's call
    with pytest.raises(KernelError, match=f"{step.name}.*failed: RuntimeError: a kernel fault"):
        session.run(None, feeds)
    plan.programs.clear()
    key = next(iter(step._bound))
    step._bound[key] = broken  # the step's own bound call
    with pytest.raises(KernelError, match="failed: RuntimeError: a kernel fault"):
        session.run(None, feeds)
    step._bound[key] = run
    assert_close(session.run(None, feeds)[0], want, 1e-4, 1e-5)
