"""Property: random graphs with embedded ConvBiasRelu variants and near-misses rewrite into
models that pass the full checker and compute the same outputs in onnxruntime; every conv is
fused (a near-miss leaves the part of its chain after the value that escapes)."""

from helpers import GraphBuilder, assert_fuses, conv_block
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CLEAN = "clean"
NEAR_MISSES = ("graph_output", "side_use", "width_bias", "no_activation")
OTHER = ("softsign", "residual")  # nothing an epilogue takes (see strategies.plain)


def conv_options(draw, size: int, channels: int) -> dict:
    k = draw(st.sampled_from([1, 3, 5]))
    opts = {"k": k, "pads": [k // 2] * 4}
    if size >= 5 and draw(st.booleans()):
        opts["strides"] = [2, 2]
    if k == 3 and draw(st.booleans()):
        opts["dilations"], opts["pads"] = [2, 2], [2, 2, 2, 2]
    if channels % 2 == 0 and draw(st.booleans()):
        opts["group"] = 2
    opts["bias"] = draw(st.sampled_from(["input", "add", "both", "none"]))
    opts["act"] = draw(st.sampled_from(["relu", "clip", "relu6"]))
    return opts


def build(draw):
    opset = draw(st.sampled_from([9, 11, 13, 17]))
    g = GraphBuilder(opset=opset, seed=draw(st.integers(0, 2**16)))
    channels, size = draw(st.sampled_from([2, 4])), draw(st.integers(4, 9))
    input_shape = ["N", channels, size, size]
    x, outputs, clean = "x", [], 0
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from([CLEAN, *NEAR_MISSES, *OTHER]))
        cout = draw(st.sampled_from([2, 4]))
        if kind in OTHER:
            y = g.node("Softsign" if kind == "softsign" else "Abs", [x])
            x = y if kind == "softsign" else g.node("Add", [x, y])
            continue
        opts = conv_options(draw, size, channels)
        if "strides" in opts:
            span = opts.get("dilations", [1])[0] * (opts["k"] - 1) + 1
            size = (size + 2 * opts["pads"][0] - span) // 2 + 1
        if kind == "width_bias":
            opts.update(bias="add", bias_shape=(size,))  # broadcasts along the width
        if kind == "no_activation":
            opts["act"] = "none"
        before = len(g.nodes)
        y = conv_block(g, x, channels, cout, **opts)
        conv_out = g.nodes[before].output[0]
        if kind == "graph_output" and conv_out != y:
            outputs.append(conv_out)
        elif kind == "side_use" and conv_out != y:
            outputs.append(g.node("Sigmoid", [conv_out]))
        clean += 1  # every conv fuses, with all of its chain or the part before the escape
        x, channels = y, cout
    model = g.model({"x": input_shape}, [x, *outputs])
    return model, clean


@st.composite
def models(draw):
    return build(draw)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_rewrite_preserves_outputs(model_and_clean):
    model, clean = model_and_clean
    assert_fuses(model, ["ConvBiasRelu"] * clean, rtol=1e-5, atol=1e-5)
