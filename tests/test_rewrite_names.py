"""What a rewrite writes into a model's namespace, and what it leaves behind.

The standard-op writer (rewrite(standard_ops=True)) invents names for the nodes, values and
initializers it writes: none may be a name the model already holds (an initializer, a value,
a graph input, a value_info, a value inside a subgraph), or onnxruntime would run the LSTM on
the user's tensor. And a fusion that absorbs a Constant's value leaves no unread Constant or
initializer behind (plain onnxruntime warns about each one it loads), while what the model
itself left unread stays.
"""

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    GraphBuilder,
    assert_all_close,
    assert_fuses,
    conv_block,
    fused_ops,
    random_feeds,
    run_ort,
)
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.cli import main
from fusion.graph import implicit_inputs
from fusion.modelfile import save_model
from fusion.models import GRUWeights, LSTMWeights, unrolled_gru, unrolled_lstm
from fusion.ort import DEFAULT, inference_session

FIXTURES = Path(__file__).parent / "fixtures"
CATALOG = fusion.default_catalog()
ATOL = 1e-5


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of a graph and its subgraphs (inputs, outputs, initializers, node
    outputs, value_info)."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names |= {t.name for t in graph.initializer} | {v for n in graph.node for v in n.output}
    for node in graph.node:
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                names |= value_names(g)
    return names - {""}


def assert_single_assignment(graph: onnx.GraphProto) -> None:
    """Each value is defined once: by one initializer, one graph input or one node output."""
    inits = [t.name for t in graph.initializer]
    inputs = [i.name for i in graph.input if i.name not in inits]
    defined = inits + inputs + [v for n in graph.node for v in n.output if v]
    assert len(defined) == len(set(defined)), sorted(v for v in defined if defined.count(v) > 1)


def step_read_outside(model: onnx.ModelProto) -> onnx.ModelProto:
    """Step 1's h also a graph output: the writer adds a Squeeze of Y and a Gather of it."""
    mid = next(n for n in model.graph.node if n.op_type == "Unsqueeze").input[0]
    hidden = model.graph.output[1].type.tensor_type.shape.dim[1].dim_value
    model.graph.output.append(helper.make_tensor_value_info(mid, TensorProto.FLOAT, ["N", hidden]))
    return model


def occupy(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """`model` with every one of `names` taken by something of its own, all of it read: the
    first a graph input, the second a value inside an If branch, the third a value_info
    declaring a value of that name (typed as nothing the writer makes), the others in turn an
    initializer and a node output, on a side chain of Adds that ends in a graph output."""
    occupied = onnx.ModelProto()
    occupied.CopyFrom(model)
    graph = occupied.graph
    first, inside, declared, *rest = names
    graph.input.append(helper.make_tensor_value_info(first, TensorProto.FLOAT, [1]))
    one = numpy_helper.from_array(np.ones(1, np.float32), "side/one")
    true = numpy_helper.from_array(np.array(True), "side/true")
    branch = helper.make_graph(
        [helper.make_node("Identity", [first], [inside])],
        "then",
        [],
        [helper.make_tensor_value_info(inside, TensorProto.FLOAT, [1])],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", [first], ["side/negated"])],
        "else",
        [],
        [helper.make_tensor_value_info("side/negated", TensorProto.FLOAT, [1])],
    )
    nodes = [helper.make_node("If", ["side/true"], [declared], then_branch=branch,
                              else_branch=other)]  # fmt: skip
    graph.value_info.append(helper.make_tensor_value_info(declared, TensorProto.FLOAT, [1]))
    graph.initializer.extend([one, true])
    last = declared
    for k, name in enumerate(rest):
        if k % 2 == 0:  # an initializer of that name, read
            value = np.full(1, k + 2, np.float32)
            graph.initializer.append(numpy_helper.from_array(value, name))
            nodes.append(helper.make_node("Add", [last, name], [f"side/{k}"]))
            last = f"side/{k}"
        else:  # a node output of that name, read
            nodes.append(helper.make_node("Add", [last, "side/one"], [name]))
            last = name
    graph.node.extend(nodes)
    graph.output.append(helper.make_tensor_value_info(last, TensorProto.FLOAT, [1]))
    onnx.checker.check_model(occupied, full_check=True)
    return occupied


MODELS = {
    "lstm-folded": lambda: unrolled_lstm(LSTMWeights.random(5, 7, seed=1), 4, "N"),
    "lstm-steps-read": lambda: step_read_outside(
        unrolled_lstm(LSTMWeights.random(4, 6, seed=2), 3, "N")
    ),
    "gru": lambda: unrolled_gru(GRUWeights.random(4, 6, seed=3), 3, "N"),
}


def names_the_writer_picks(model: onnx.ModelProto) -> list[str]:
    result = fusion.rewrite(model, CATALOG, standard_ops=True)
    assert result.standard, result.explain()
    return sorted(value_names(result.model.graph) - value_names(model.graph))


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_the_standard_op_writer_takes_no_name_the_model_holds(make):
    clean = make()
    picked = names_the_writer_picks(clean)
    assert len(picked) >= 6, picked  # W, R, B, the Unsqueezes' axes and outputs, the op's Y
    model = occupy(clean, picked)
    result = fusion.rewrite(model, CATALOG, standard_ops=True)
    assert fused_ops(result.model) == [], result.explain()
    assert {"LSTM", "GRU"} & {n.op_type for n in result.model.graph.node}
    assert_single_assignment(result.model.graph)
    onnx.checker.check_model(result.model, full_check=True)
    feeds = random_feeds(model, batch=3)
    feeds[picked[0]] = np.full(1, 0.5, np.float32)
    assert_all_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=0, atol=ATOL)


def test_the_cli_writes_such_a_model(capsys, tmp_path):
    """`fusion rewrite --rnn-as-standard-op` refused it as its own internal error (exit 1)."""
    clean = MODELS["lstm-folded"]()
    model = occupy(clean, names_the_writer_picks(clean))
    src, out = tmp_path / "lstm.onnx", tmp_path / "out.onnx"
    save_model(model, src)
    code = main([str(a) for a in ("rewrite", src, "-o", out, "--rnn-as-standard-op")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""
    written = onnx.load(str(out))
    assert [n.op_type for n in written.graph.node].count("LSTM") == 1
    assert_single_assignment(written.graph)


def test_inlined_cells_take_no_name_the_model_holds():
    """An LSTMSequence inlines its cells' bodies, their values named after the cell's first
    output: here step 2's x already has the name one of cell 1's values would get (the body
    defined it twice: onnxruntime refused the model)."""
    model = unrolled_lstm(LSTMWeights.random(5, 7, seed=4), 3, "N")
    cells = fusion.rewrite(model, CATALOG.select(only=("LSTMCell",))).model
    first, second, _ = (n for n in cells.graph.node if n.op_type == "LSTMCell")
    inner = next(v for n in cells.functions[0].node for v in n.output if v.startswith("t"))
    taken = {second.input[0]: f"{first.output[0]}/{inner}"}
    for node in model.graph.node:
        node.input[:] = [taken.get(v, v) for v in node.input]
        node.output[:] = [taken.get(v, v) for v in node.output]
    result = fusion.rewrite(model, CATALOG)
    assert result.counts() == {"LSTMSequence": 1}, result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    feeds = random_feeds(model, batch=2)
    assert_all_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=0, atol=ATOL)


# ---- what a rewrite leaves behind ------------------------------------------------------------
def unread(graph: onnx.GraphProto) -> tuple[list[str], list[str]]:
    """(Constant outputs, initializers) that no node (nor subgraph) reads and no graph output is."""
    reads = {v for n in graph.node for v in (*n.input, *implicit_inputs(n))}
    reads |= {o.name for o in graph.output}
    constants = [
        v for n in graph.node if n.op_type == "Constant" for v in n.output if v not in reads
    ]
    return constants, [t.name for t in graph.initializer if t.name not in reads]


def ort_log(model: onnx.ModelProto, capfd) -> str:
    """What onnxruntime writes to stderr while loading `model` with its warnings on."""
    capfd.readouterr()
    inference_session(model, DEFAULT, threads=1, warnings=True)
    return capfd.readouterr().err


@pytest.mark.parametrize("standard_ops", [False, True], ids=["fused", "standard-ops"])
def test_absorbed_constants_leave_nothing_unread(capfd, standard_ops):
    """PyTorch's stacked nn.LSTMCell: the split sizes and Gather indices are Constant nodes
    that the fused cells' bodies absorb (35 were left behind, each a warning)."""
    model = onnx.load(str(FIXTURES / "lstmcell_stacked.onnx"))
    assert unread(model.graph) == ([], [])
    assert sum(n.op_type == "Constant" for n in model.graph.node) > 30
    result = fusion.rewrite(model, CATALOG, standard_ops=standard_ops)
    assert result.counts() == {"LSTMSequence": 3}
    assert unread(result.model.graph) == ([], [])
    assert ort_log(result.model, capfd) == ""
    onnx.checker.check_model(result.model, full_check=True)
    feeds = random_feeds(model, batch=2)
    assert_all_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=0, atol=ATOL)


def test_a_constant_seen_through_an_identity_goes_with_it(capfd):
    """Clip's upper bound is Identity(Constant): the fused body holds the bound, and neither
    node is left behind."""
    g = GraphBuilder()
    y = conv_block(g, "x", 4, 4, act="clip", pads=[1, 1, 1, 1])
    model = g.model({"x": ["N", 4, 5, 5]}, [y])
    bound = next(n for n in model.graph.node if n.op_type == "Clip").input[2]
    tensor = next(t for t in model.graph.initializer if t.name == bound)
    model.graph.initializer.remove(tensor)
    model.graph.node.insert(0, helper.make_node("Identity", ["bound/c"], [bound]))
    model.graph.node.insert(0, helper.make_node("Constant", [], ["bound/c"], value=tensor))
    result = assert_fuses(model, ["ConvBiasRelu"])
    assert [n.op_type for n in result.model.graph.node] == ["ConvBiasRelu"]
    assert unread(result.model.graph) == ([], [])
    assert ort_log(result.model, capfd) == ""


def test_what_the_model_left_unread_stays():
    """A dead Constant and an unused initializer of the model's own, a Constant that is a graph
    output: none is the rewrite's to remove."""
    model = onnx.load(str(FIXTURES / "lstmcell_stacked.onnx"))
    graph = model.graph
    dead = helper.make_node("Constant", [], ["own/dead"], value_ints=[1, 2])
    shown = helper.make_node("Constant", [], ["own/shown"], value_ints=[3])
    graph.node.extend([dead, shown])
    graph.output.append(helper.make_tensor_value_info("own/shown", TensorProto.INT64, [1]))
    graph.initializer.append(numpy_helper.from_array(np.zeros(2, np.float32), "own/unused"))
    result = fusion.rewrite(model, CATALOG)
    assert result.counts() == {"LSTMSequence": 3}
    assert unread(result.model.graph) == (["own/dead"], ["own/unused"])
    assert "own/shown" in {v for n in result.model.graph.node for v in n.output}
