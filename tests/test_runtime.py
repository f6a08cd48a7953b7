"""fusion.Session against onnxruntime on the same graph with fused nodes left as functions.

Fused models are built by hand: a "ScaledRelu" node, relu(x * s), backed by a Mul + Relu function
and run by a NumPy kernel registered in a test catalog (tests/helpers.py). The crossing cost is
measured by bench/overheads.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import (
    assert_all_close,
    fused_model,
    in_threads,
    run_ort,
    scaled_relu,
    scaled_relu_kernel,
    tensor,
)
from helpers import scaled_relu_catalog as catalog
from onnx import TensorProto as T
from onnx import helper as h

from fusion.catalog import DOMAIN, Catalog
from fusion.errors import FusionError
from fusion.ort import DEFAULT, inference_session
from fusion.runtime import InvalidFeed, Session
from fusion.runtime.plan import IslandPlan, island_settings, may_hold_a_conv

FIXTURES = Path(__file__).parent / "fixtures"


def chain_model(**attrs) -> onnx.ModelProto:
    """a -> Add(a, a) -> ScaledRelu(., s) -> Neg -> z: a kernel between two islands."""
    nodes = [
        h.make_node("Add", ["a", "a"], ["x"], name="add"),
        scaled_relu("x", "s", "y", "sr", **attrs),
        h.make_node("Neg", ["y"], ["z"], name="neg"),
    ]
    s = h.make_tensor("s", T.FLOAT, [], [2.0])
    return fused_model(nodes, [tensor("a")], [tensor("z", None)], [s])


def two_chains_model() -> onnx.ModelProto:
    """Two independent island-kernel-island chains plus a join: still two islands."""
    nodes = [
        h.make_node("Add", ["a", "a"], ["x1"], name="add"),
        h.make_node("Sub", ["b", "a"], ["x2"], name="sub"),
        scaled_relu("x1", "s", "y1", "sr1"),
        scaled_relu("x2", "s", "y2", "sr2"),
        scaled_relu("y2", "s", "y3", "sr3"),  # kernel after kernel: no island in between
        h.make_node("Neg", ["y1"], ["z1"], name="neg"),
        h.make_node("Exp", ["y3"], ["z2"], name="exp"),
        h.make_node("Mul", ["z1", "x2"], ["z3"], name="join"),  # reads islands 0 and 1
    ]
    s = h.make_tensor("s", T.FLOAT, [], [0.5])
    outputs = [tensor("z2", None), tensor("z3", None), tensor("x2", None)]
    return fused_model(nodes, [tensor("a"), tensor("b")], outputs, [s])


def reference(model: onnx.ModelProto, feeds: dict, names=None) -> list[np.ndarray]:
    """onnxruntime alone, running each fused node through its function body."""
    return run_ort(model, feeds, names=names)


def feeds_for(model, seed=0, batch=2) -> dict:
    rng = np.random.default_rng(seed)
    return {
        i.name: rng.standard_normal((batch, 3)).astype(np.float32)
        for i in model.graph.input
        if i.name not in {t.name for t in model.graph.initializer}
    }


def assert_same(actual, expected):
    assert_all_close(actual, expected, rtol=1e-6, atol=1e-6)


# ---- scheduling ------------------------------------------------------------------------------
def test_kernel_between_two_islands():
    model = chain_model()
    sess = Session(model, threads=1, catalog=catalog())
    assert [(s.kind, s.name) for s in sess.steps] == [
        ("island", "island0"),
        ("kernel", "ScaledRelu sr"),
        ("island", "island1"),
    ]
    assert sess.steps[0].outputs == ["x"] and sess.steps[2].inputs == ["y"]
    assert [set(names) for names in sess.releases] == [{"a"}, {"x", "s"}, {"y"}]  # z is kept
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))


def test_islands_are_layered_not_one_per_chain():
    model = two_chains_model()
    sess = Session(model, threads=1, catalog=catalog())
    kinds = [s.kind for s in sess.steps]
    assert kinds == ["island", "kernel", "kernel", "kernel", "island"]
    assert sess.steps[0].nodes == ["add", "sub"]
    assert [s.name for s in sess.steps[1:4]] == [
        "ScaledRelu sr1",
        "ScaledRelu sr2",
        "ScaledRelu sr3",
    ]
    assert sess.steps[4].nodes == ["neg", "exp", "join"]
    assert set(sess.steps[0].outputs) == {"x1", "x2"}  # x2: a graph output read later too
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))


def test_unknown_rule_runs_its_function_in_onnxruntime():
    model = chain_model()
    sess = Session(model, threads=1, catalog=Catalog())
    assert [s.kind for s in sess.steps] == ["island"]
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))


def test_fused_node_without_kernel_or_function_is_refused():
    model = chain_model()
    del model.functions[:]
    with pytest.raises(FusionError, match="'sr'.*no kernel in the catalog and no function"):
        Session(model, threads=1, catalog=Catalog())


def test_kernel_without_function_types_the_next_island_from_the_first_run():
    model = chain_model()
    del model.functions[:]  # shape inference cannot tell y's dtype now
    sess = Session(model, threads=1, catalog=catalog())
    assert sess.steps[2].session is None
    (z,) = sess.run(None, {"a": np.array([[1.0, -1.0, 2.0]], np.float32)})
    np.testing.assert_array_equal(z, [[-4.0, 0.0, -8.0]])
    assert sess.steps[2].session is not None


def test_constant_node_read_by_kernel_is_folded():
    model = chain_model()
    del model.graph.initializer[:]
    const = h.make_node("Constant", [], ["s0"], value=h.make_tensor("v", T.FLOAT, [], [3.0]))
    model.graph.node.insert(0, const)
    model.graph.node.insert(1, h.make_node("Identity", ["s0"], ["s"], name="id"))
    sess = Session(model, threads=1, catalog=catalog())
    assert [s.nodes for s in sess.islands] == [["add"], ["neg"]]  # no Constant, no Identity
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))


def test_graph_outputs_that_are_inputs_or_constants_or_read_later():
    model = chain_model()
    model.graph.output.extend([tensor("a"), tensor("s", []), tensor("x", None)])
    sess = Session(model, threads=1, catalog=catalog())
    feeds = feeds_for(model)
    out = sess.run(None, feeds)
    assert_same(out, reference(model, feeds))
    out[2][...] = 7  # the caller may modify what it got without changing the next run
    assert sess.run(["s"], feeds)[0] == 2.0


def test_initializer_that_is_also_an_input_can_be_fed():
    model = chain_model()
    model.graph.node[2].input[:] = ["y", "bias"]
    model.graph.node[2].op_type = "Sub"
    model.graph.initializer.append(h.make_tensor("bias", T.FLOAT, [3], [1.0, 2.0, 3.0]))
    model.graph.input.append(tensor("bias", [3]))
    sess = Session(model, threads=1, catalog=catalog())
    assert [i.name for i in sess.get_inputs()] == ["a"]
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))
    feeds["bias"] = np.full(3, 10.0, np.float32)
    assert_same(sess.run(None, feeds), reference(model, feeds))


def test_graph_without_nodes():
    graph = h.make_graph([], "g", [tensor("a")], [tensor("a")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    sess = Session(model, threads=1, fuse=False)
    a = np.ones((2, 3), np.float32)
    assert sess.steps == [] and sess.run(None, {"a": a})[0] is a


def test_subgraph_reading_outer_values_gets_them_as_island_inputs():
    then = h.make_graph([h.make_node("Mul", ["y", "s"], ["r"])], "then", [], [tensor("r", None)])
    other = h.make_graph([h.make_node("Neg", ["y"], ["r2"])], "else", [], [tensor("r2", None)])
    model = chain_model()
    model.graph.node.extend(
        [
            h.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="sum"),
            h.make_node("Greater", ["total", "s"], ["cond"], name="gt"),
            h.make_node("If", ["cond"], ["w"], then_branch=then, else_branch=other, name="if"),
        ]
    )
    model.graph.output.append(tensor("w", None))
    sess = Session(model, threads=1, catalog=catalog())
    assert "y" in sess.steps[2].inputs and len(sess.islands) == 2
    for seed in range(3):
        feeds = feeds_for(model, seed)
        assert_same(sess.run(None, feeds), reference(model, feeds))


def test_dead_nodes_are_not_run():
    model = chain_model()
    model.graph.node.append(h.make_node("Exp", ["x"], ["unused"], name="dead"))
    sess = Session(model, threads=1, catalog=catalog())
    assert [s.nodes for s in sess.islands] == [["add"], ["neg"]]


def test_output_names_subset_and_order():
    model = two_chains_model()
    sess = Session(model, threads=1, catalog=catalog())
    feeds = feeds_for(model)
    assert_same(sess.run(["x2", "z2"], feeds), reference(model, feeds, ["x2", "z2"]))
    with pytest.raises(InvalidFeed, match="Invalid output name: y1"):
        sess.run(["y1"], feeds)


def test_fuse_false_runs_an_original_model_as_is():
    graph = h.make_graph([h.make_node("Relu", ["a"], ["z"])], "g", [tensor("a")], [tensor("z")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    sess = Session(model, threads=1, fuse=False)
    feeds = feeds_for(model)
    assert_same(sess.run(None, feeds), reference(model, feeds))
    assert [s.kind for s in sess.steps] == ["island"]


def test_node_args_like_onnxruntime():
    model = chain_model()
    sess = Session(model, threads=1, catalog=catalog())
    ref = inference_session(model)
    for mine, theirs in [
        (sess.get_inputs(), ref.get_inputs()),
        (sess.get_outputs(), ref.get_outputs()),
    ]:
        assert [(a.name, a.type) for a in mine] == [(a.name, a.type) for a in theirs]
    assert sess.get_inputs()[0].shape == ["N", 3]


def random_fused_model(rng: np.random.Generator, size: int = 8) -> onnx.ModelProto:
    """A random DAG of Add, Neg and ScaledRelu over two inputs; some values become outputs."""
    values, nodes = ["a", "b"], []
    for k in range(size):
        kind = rng.choice(["Add", "Neg", "ScaledRelu"])
        src = [values[i] for i in rng.choice(len(values), 2)]
        out = f"v{k}"
        if kind == "Add":
            nodes.append(h.make_node("Add", src, [out], name=f"add{k}"))
        elif kind == "Neg":
            nodes.append(h.make_node("Neg", src[:1], [out], name=f"neg{k}"))
        else:
            nodes.append(scaled_relu(src[0], "s", out, f"sr{k}"))
        values.append(out)
    picked = rng.choice(len(values), 3, replace=False)
    outputs = [tensor(values[i], None) for i in sorted(set(picked) | {len(values) - 1})]
    s = h.make_tensor("s", T.FLOAT, [], [1.5])
    return fused_model(nodes, [tensor("a"), tensor("b")], outputs, [s])


def test_random_graphs_match_onnxruntime():
    rng = np.random.default_rng(0)
    for _ in range(25):
        model = random_fused_model(rng)
        sess = Session(model, threads=1, catalog=catalog())
        feeds = feeds_for(model, int(rng.integers(1000)))
        assert_same(sess.run(None, feeds), reference(model, feeds))
        kinds = "".join(s.kind[0] for s in sess.steps)
        assert "ii" not in kinds  # never two islands in a row


# ---- feed errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "feeds, message",
    [
        ({}, r"Required inputs \(\['a'\]\) are missing"),
        ({"a": np.ones((2, 3), np.float32), "b": np.ones(1)}, "Invalid input name: b"),
        ({"a": np.ones((2, 3))}, r"input: a\. Actual: \(float64\), expected: \(float32\)"),
        ({"a": np.ones((2, 3, 1), np.float32)}, "Invalid rank for input: a Got: 3 Expected: 2"),
        ({"a": np.ones((2, 4), np.float32)}, "invalid dimensions for input: a index: 1 Got: 4"),
    ],
)
def test_feed_errors_name_the_input(feeds, message):
    sess = Session(chain_model(), threads=1, catalog=catalog())
    with pytest.raises(InvalidFeed, match=message) as err:
        sess.run(None, feeds)
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


def test_lists_are_accepted_like_onnxruntime():
    sess = Session(chain_model(), threads=1, catalog=catalog())
    (z,) = sess.run(None, {"a": [[1.0, -2.0, 3.0]]})
    np.testing.assert_array_equal(z, [[-4.0, 0.0, -12.0]])


# ---- threads, profile, progress --------------------------------------------------------------
def test_concurrent_runs_give_each_caller_its_own_result():
    model = two_chains_model()
    sess = Session(model, threads=1, catalog=catalog())
    oracle = inference_session(model)

    def worker(seed):
        for k in range(25):
            feeds = feeds_for(model, seed * 100 + k, batch=1 + k % 3)
            assert_same(sess.run(None, feeds), oracle.run(None, feeds))

    in_threads(worker)


def test_profile_times_every_step():
    model = chain_model()
    sess = Session(model, threads=1, catalog=catalog())
    prof = sess.profile(feeds_for(model), repeat=3)
    assert [(k, n) for k, n, _ in prof.steps] == [(s.kind, s.name) for s in sess.steps]
    assert all(t > 0 for _, _, t in prof.steps) and prof.wall >= prof.total("island")
    assert "between" in str(prof) and prof.to_dict()["kernel_seconds"] > 0


def test_progress_is_called_once_per_kernel():
    calls = []
    Session(two_chains_model(), threads=1, catalog=catalog(), progress=lambda *a: calls.append(a))
    assert calls == [("ScaledRelu sr1", 1, 3), ("ScaledRelu sr2", 2, 3), ("ScaledRelu sr3", 3, 3)]


def test_kernel_gets_attributes_and_constants_once():
    built = []

    def factory(attrs, constants):
        built.append((attrs, constants))
        return scaled_relu_kernel(attrs, constants)

    sess = Session(chain_model(shift=0.5, mode="x"), threads=1, catalog=catalog(factory))
    sess.run(None, feeds_for(chain_model()))
    sess.run(None, feeds_for(chain_model()))
    ((attrs, constants),) = built
    assert attrs == {"shift": 0.5, "mode": "x"}
    assert constants[0] is None and constants[1] == np.float32(2.0)


def test_with_tactics_shares_the_kernels_and_keeps_the_original_as_it_was():
    built = []

    def factory(attrs, constants):
        built.append(attrs)
        return scaled_relu_kernel(attrs, constants)

    model = chain_model()
    sess = Session(model, threads=1, catalog=catalog(factory), tactics="kernel")
    other = sess.with_tactics("onnxruntime")
    assert len(built) == 1  # built once, shared
    assert other.choices == {"ScaledRelu sr": "onnxruntime"}
    assert [s.kind for s in other.steps] == ["island"]
    assert sess.choices == {"ScaledRelu sr": "kernel"} and len(sess.steps) == 3
    feeds = feeds_for(model)
    assert_same(other.run(None, feeds), sess.run(None, feeds))
    with pytest.raises(ValueError, match="untimed"):
        sess.with_tactics("fastest")


@pytest.mark.parametrize(
    ("ops", "level"),
    [
        (["MaxPool"], ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        (["Conv", "MaxPool"], ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ],
)
def test_island_settings_follow_what_runs_between_kernels(ops, level):
    # NCHWc pays for its border reorders only across convolutions (see plan.island_settings)
    nodes, value, inits = [], "x", []
    for k, op_type in enumerate(ops):
        extra = dict(kernel_shape=[3, 3], strides=[2, 2]) if op_type == "MaxPool" else {}
        inputs = [value, "w"] if op_type == "Conv" else [value]
        nodes.append(h.make_node(op_type, inputs, [f"v{k}"], name=f"n{k}", **extra))
        value = f"v{k}"
    if "Conv" in ops:
        w = np.random.default_rng(0).standard_normal((8, 8, 1, 1)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, "w"))
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8, 9, 9])],
        [h.make_tensor_value_info(value, T.FLOAT, None)],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    island = IslandPlan("island0", list(graph.node), ["x"], [value])
    settings = island_settings(island)
    assert settings.optimization == level and not settings.spinning
    # Nothing fused: the island is the whole model and runs as onnxruntime does by default.
    sess = Session(model, threads=1, catalog=Catalog())
    assert [s.kind for s in sess.steps] == ["island"]
    assert sess.steps[0].settings == DEFAULT
    x = np.random.default_rng(1).standard_normal((1, 8, 9, 9)).astype(np.float32)
    assert_same(sess.run(None, {"x": x}), reference(model, {"x": x}))


def test_islands_keep_blocked_layouts_for_nodes_that_may_hide_a_conv():
    empty = h.make_graph([], "g", [], [])
    assert not may_hold_a_conv(h.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2]))
    assert may_hold_a_conv(h.make_node("Conv", ["x", "w"], ["y"]))
    assert may_hold_a_conv(h.make_node("ConvBiasRelu", ["x"], ["y"], domain=DOMAIN))  # a body
    assert may_hold_a_conv(h.make_node("If", ["c"], ["y"], then_branch=empty, else_branch=empty))


def test_islands_answered_from_memory():
    """An island whose inputs are read only by Shape or Size, or by value where they are small
    integers (checked per call), and that draws no random numbers and holds no subgraph, is a
    function of its inputs' shapes and of those values."""
    from fusion.runtime.steps import memo_inputs

    shape = h.make_node("Shape", ["x"], ["s"])
    gather = h.make_node("Gather", ["s", "zero"], ["g"])
    add = h.make_node("Add", ["x", "x"], ["y"])
    like = h.make_node("RandomNormalLike", ["s"], ["r"])
    assert memo_inputs(IslandPlan("i", [shape, gather], ["x"], ["g"], ["zero"])) == []
    assert memo_inputs(IslandPlan("i", [shape, gather, add], ["x"], ["g", "y"], ["zero"])) == ["x"]
    assert memo_inputs(IslandPlan("i", [shape, like], ["x"], ["r"])) is None
    assert memo_inputs(IslandPlan("i", [], ["x"], [])) is None


def test_shape_islands_answered_per_shape_as_onnxruntime():
    """GPT-2's per-layer Reshape targets (Shape, Gather, Unsqueeze, Concat of the previous
    layer's output) run in onnxruntime until an input shape comes a second time, then come
    from memory; every run, at changing batch and sequence, gives onnxruntime's outputs. The
    island of the embeddings reads the token ids by value: never from memory."""
    path = f"{FIXTURES}/gpt2_tiny_sdpa.ts17.onnx"
    sess = Session(path, threads=1, tactics="kernel")
    memos = [i for i in sess.islands if i._memo is not None]
    model = onnx.load(path)
    rng = np.random.default_rng(0)
    for b, s in [(1, 5), (2, 7), (1, 5), (2, 7), (3, 4), (1, 5), (3, 4), (3, 4)]:
        feeds = {"input_ids": rng.integers(0, 50, (b, s)).astype(np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}  # fmt: skip
        assert_all_close(sess.run(None, feeds), run_ort(model, feeds), 1e-4, 1e-4)
    shapes_only = [i for i in memos if not i._read]
    assert len(shapes_only) >= 4
    assert all(len(i._memo) == 3 for i in shapes_only)  # kept on a shape's second run
    assert any(i._read and i._memo for i in memos)  # small integers read by value, in the key
    assert sess.islands[0]._memo is None  # the embeddings of input_ids


def test_an_island_of_one_cast_to_the_input_s_own_dtype_passes_it_through():
    """Llama exports cast each residual sum to float32 (already float32) before the RMSNorm: an
    island of one Cast between two kernels passes the array through; a Cast that converts, or
    whose output is the graph's, still runs in onnxruntime."""
    from fusion.graph import GraphView
    from fusion.runtime.steps import same_values

    def graph(to, out_is_graph_output):
        nodes = [scaled_relu("x", "s", "y", "sr"), h.make_node("Cast", ["y"], ["c"], to=to),
                 scaled_relu("c", "s", "z", "sr2")]  # fmt: skip
        outs = [tensor("c", (4, 3))] if out_is_graph_output else [tensor("z", (4, 3))]
        return fused_model(
            nodes,
            [tensor("x", (4, 3))],
            outs,
            [onnx.numpy_helper.from_array(np.full((1, 3), 0.5, np.float32), "s")],
        )

    view = GraphView(graph(T.FLOAT, False))
    cast = next(n for n in view.nodes if n.op_type == "Cast")
    assert same_values(IslandPlan("i", [cast], ["y"], ["c"]), view) == np.float32
    outside = GraphView(graph(T.FLOAT, True))
    assert same_values(IslandPlan("i", [cast], ["y"], ["c"]), outside) is None
    model = graph(T.FLOAT, False)
    session = Session(model, threads=1, catalog=catalog(), tactics="kernel")
    (island,) = session.islands
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    values = {"y": x}
    island(values)
    assert values["c"] is x
    assert_all_close(session.run(None, {"x": x}), run_ort(model, {"x": x}), 0, 0)
    converting = Session(graph(T.FLOAT16, False), threads=1, catalog=catalog(), tactics="kernel")
    values = {"y": x}
    converting.islands[0](values)  # float32 in, a float16 Cast: onnxruntime converts
    assert values["c"].dtype == np.float16
    np.testing.assert_array_equal(values["c"], x.astype(np.float16))


def test_llama_s_float32_casts_pass_through_as_onnxruntime():
    path = f"{FIXTURES}/llama_tiny_sdpa.ts17.onnx"
    session = Session(path, threads=1, tactics="kernel")
    model = onnx.load(path)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 50, (2, 6)).astype(np.int64),
             "attention_mask": np.ones((2, 6), np.int64)}  # fmt: skip
    assert_all_close(session.run(None, feeds), run_ort(model, feeds), 1e-4, 1e-4)


def test_islands_from_memory_under_concurrent_runs():
    """Runs from several threads at changing shapes: the islands answered from memory (one
    dropping its memory when an output is too large) give each caller onnxruntime's outputs."""
    path = f"{FIXTURES}/gpt2_tiny_sdpa.ts17.onnx"
    sess = Session(path, threads=1, tactics="kernel")
    oracle = inference_session(onnx.load(path))

    def worker(seed):
        rng = np.random.default_rng(seed)
        for k in range(12):
            b, s = 1 + (seed + k) % 3, 3 + k % 4
            feeds = {"input_ids": rng.integers(0, 50, (b, s)).astype(np.int64),
                     "attention_mask": np.ones((b, s), np.int64)}  # fmt: skip
            assert_all_close(sess.run(None, feeds), oracle.run(None, feeds), 1e-4, 1e-4)

    in_threads(worker)
