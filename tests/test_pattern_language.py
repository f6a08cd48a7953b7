"""The pattern language on small rules: outputs by index, shared values, several outputs,
composition, priorities, commutativity and rule validation. onnxruntime is the oracle for
every rewrite (through the fused nodes' function bodies)."""

import numpy as np
import pytest
from helpers import GraphBuilder, assert_fuses, fused_ops

import fusion
from fusion import Alt, Catalog, CatalogError, Const, Opt, Rule, Var, op
from fusion.models import conv_stack
from fusion_patterns.conv import RULE as CONV_RULE
from fusion_patterns.conv import conv_epilogue


def rewrite_checked(model, rules):
    return assert_fuses(model, None, Catalog(rules), rtol=1e-5, atol=1e-6)


def glu_rule():
    """GLU: a, b = split(x, 2, axis=1); y = a * sigmoid(b): a Split matched by output index."""
    split = op.Split(Var("x"), Opt(Const("sizes")), axis=1, _name="split")
    return Rule("Glu", op.Mul(split[0], op.Sigmoid(split[1])), inputs=("x",))


@pytest.mark.parametrize("form", ["attribute", "input", "num_outputs"])
def test_split_outputs_by_index(form):
    opset = {"attribute": 11, "input": 13, "num_outputs": 18}[form]
    g = GraphBuilder(opset=opset)
    kwargs = {"axis": 1}
    inputs = ["x"]
    if form == "attribute":
        kwargs["split"] = [3, 3]
    elif form == "input":
        inputs.append(g.const(np.array([3, 3], np.int64)))
    else:
        kwargs["num_outputs"] = 2
    a, b = g.node("Split", inputs, n_out=2, **kwargs)
    y = g.node("Mul", [g.node("Sigmoid", [b]), a])  # commuted Mul
    result = rewrite_checked(g.model({"x": [2, 6]}, [y]), [glu_rule()])
    assert fused_ops(result.model) == ["Glu"]


def test_split_outputs_swapped_is_a_near_miss():
    g = GraphBuilder(opset=13)
    a, b = g.node("Split", ["x"], n_out=2, axis=1)
    y = g.node("Mul", [a, g.node("Sigmoid", [a])])
    g.node("Identity", [b])
    result = rewrite_checked(g.model({"x": [2, 6]}, [y]), [glu_rule()])
    assert fused_ops(result.model) == []
    assert "is output 0 of Split" in result.explain()


def silu_rule():
    x = Var("x")  # one object used twice: both uses must be the same value
    return Rule("Silu", op.Mul(x, op.Sigmoid(x)), inputs=("x",))


def test_value_used_twice_in_one_pattern():
    g = GraphBuilder()
    y = g.node("Mul", ["x", g.node("Sigmoid", ["x"])])
    assert fused_ops(rewrite_checked(g.model({"x": [3, 4]}, [y]), [silu_rule()]).model) == ["Silu"]
    g = GraphBuilder()
    y = g.node("Mul", ["x", g.node("Sigmoid", ["z"])])
    result = rewrite_checked(g.model({"x": [3, 4], "z": [3, 4]}, [y]), [silu_rule()])
    assert fused_ops(result.model) == []
    assert "expected the same value as" in result.explain()


def test_pattern_with_two_outputs_keeps_order_valid():
    """An output from inside the match (like an LSTM cell's c') may be read outside it, even
    by a node that the original order placed before the match's root."""
    total = op.Add(Var("a"), Var("b"), _name="sum")
    rule = Rule("AddRelu", op.Relu(total, _name="y"), inputs=("a", "b"), outputs=("y", "sum"))
    g = GraphBuilder()
    s = g.node("Add", ["a", "b"])
    side = g.node("Neg", [s])  # reads the inner output, sits between Add and Relu
    y = g.node("Relu", [s])
    result = rewrite_checked(g.model({"a": [2, 3], "b": [2, 3]}, [y, side]), [rule])
    assert [n.op_type for n in result.model.graph.node] == ["AddRelu", "Neg"]
    assert len(result.model.graph.node[0].output) == 2


def test_composition_and_shared_sub_pattern():
    """Two Conv+Bias+Relu branches from one squeeze, concatenated: the catalog's own
    conv_bias_relu pattern, composed three times, with the squeeze shared by both branches."""
    squeeze = conv_epilogue(prefix="s_")
    left, right = conv_epilogue(squeeze, "l_"), conv_epilogue(squeeze, "r_")
    rule = Rule("MiniFire", op.Concat(left, right, axis=1), inputs=("s_x",), priority=20)
    g = GraphBuilder()
    s = g.node("Relu", [g.node("Conv", ["x", g.weight(4, 3, 1, 1)])])
    a = g.node("Relu", [g.node("Conv", [s, g.weight(5, 4, 1, 1), g.weight(5)])])
    b = g.node("Relu", [g.node("Conv", [s, g.weight(6, 4, 3, 3)], pads=[1, 1, 1, 1])])
    y = g.node("Concat", [a, b], axis=1)
    model = g.model({"x": [1, 3, 7, 7]}, [y])
    result = rewrite_checked(model, [rule, CONV_RULE])
    assert fused_ops(result.model) == ["MiniFire"]  # the larger rule wins over ConvBiasRelu
    assert result.counts() == {"MiniFire": 1}


def test_larger_rule_leaves_a_reason_for_the_smaller():
    pool = Rule("ConvReluPool", op.MaxPool(conv_epilogue()), inputs=("x", "W"), priority=20)
    g = GraphBuilder()
    y = g.node(
        "MaxPool",
        [g.node("Relu", [g.node("Conv", ["x", g.weight(4, 3, 3, 3)])])],
        kernel_shape=[2, 2],
    )
    result = rewrite_checked(g.model({"x": [1, 3, 8, 8]}, [y]), [CONV_RULE, pool])
    assert fused_ops(result.model) == ["ConvReluPool"]


def test_alternatives_and_optional_inputs():
    act = Alt(op.Relu(op.Add(Var("x"), Const("b"))), op.Sigmoid(op.Add(Var("x"), Const("b"))))
    rule = Rule("BiasAct", act, inputs=("x",))
    for act_op in ("Relu", "Sigmoid"):
        g = GraphBuilder()
        y = g.node(act_op, [g.node("Add", [g.weight(4), "x"])])
        assert fused_ops(rewrite_checked(g.model({"x": [2, 4]}, [y]), [rule]).model) == ["BiasAct"]


def test_identical_matches_share_one_function_and_output_is_deterministic():
    model = conv_stack(blocks=3, channels=4, size=6)
    first = fusion.rewrite(model).model
    assert len(first.functions) == 1
    again = fusion.rewrite(model).model
    assert first.SerializeToString(deterministic=True) == again.SerializeToString(
        deterministic=True
    )
    twice = fusion.rewrite(first)
    assert twice.fusions == [] and twice.model.SerializeToString() == first.SerializeToString()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Rule("Bad", op.Conv2D(Var("x")), inputs=("x",)), "unknown ONNX op 'Conv2D'"),
        (lambda: Rule("Bad", op.Relu(Var("x"), alpha=1), inputs=("x",)), "no attribute 'alpha'"),
        (lambda: Rule("Bad", op.Relu(Var("x")), inputs=("y",)), "'y' is used but never bound"),
        (lambda: Rule("Bad op", op.Relu(Var("x")), inputs=("x",)), "must be an identifier"),
        (lambda: Rule("Bad", Var("x"), inputs=("x",)), "root must be an op"),
    ],
)
def test_rule_validation(make, message):
    with pytest.raises(CatalogError, match=message):
        make()


def test_name_clash_and_unknown_selection():
    catalog = Catalog([CONV_RULE])
    with pytest.raises(CatalogError, match="already in the catalog"):
        catalog.add(CONV_RULE)
    with pytest.raises(CatalogError, match="no pattern named 'Nope'"):
        catalog.select(only=["Nope"])


def test_any_output_lets_structure_decide_which_output_is_which():
    """a * sigmoid(b) with a, b from one Split in either order: which is which follows from
    the Sigmoid, not from the position."""
    split = op.Split(Var("x"), Opt(Const("sizes")), axis=1)
    rule = Rule("AnyGlu", op.Mul(split.any_output("a"), op.Sigmoid(split.any_output("b"))), ("x",))
    for gate_first in (True, False):
        g = GraphBuilder(opset=13)
        a, b = g.node("Split", ["x"], n_out=2, axis=1)
        a, b = (a, b) if gate_first else (b, a)
        y = g.node("Mul", [a, g.node("Sigmoid", [b])])
        result = rewrite_checked(g.model({"x": [2, 6]}, [y]), [rule])
        assert fused_ops(result.model) == ["AnyGlu"]
