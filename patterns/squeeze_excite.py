"""SqueezeExcite:  y = x * gate(x),  gate(x) = act2(conv2(act1(conv1(mean_hw(x)))))

The squeeze-excitation block of EfficientNet, MobileNetV3 and RegNetY: the mean of each channel
plane (GlobalAveragePool, or ReduceMean over H and W with keepdims, as the dynamo exporter
writes it), two 1x1 convs on the [N, C, 1, 1] means, each with the conv epilogue sub-pattern
(bias, activation: SiLU or Relu, then Sigmoid or HardSigmoid), and the gate multiplied into x
per image and channel. Unfused, the pool and the Mul are onnxruntime islands of their own
between the fused convs around them, and each island boundary converts x's layout.

The kernel: on blocked tensors (the layout of the convs around it) the whole block in one call
(kernels/squeeze_excite.py); on NCHW ones the plane means summed in float64 (kernels/pool.py,
GlobalAveragePool's), the two small products on kernels/dense_gemm.py's GEMM with their
epilogues, then one pass of kernels/pointwise.py multiplying x by the gate.

SqueezeExciteConv:  z = act_p(conv1x1(y) [+ r]) [+ r],  y = x * gate(x)

The gate and the 1x1 conv after it (an inverted residual's projection in EfficientNet,
MobileNetV3 and RegNetY: the conv epilogue sub-pattern, bias, BatchNorm, activation, residual)
as one node. As conv(x g) = (W g) x per image, the gate can be folded into the conv's packed
weights along their input channels (kernels/squeeze_excite.py gated_weights) and the conv
read x itself: y, the size of x, is never written nor read back. That pays where a plane has
more pixels than the conv has outputs (EfficientNet's first blocks: 32 x 112 x 112 read three
times for 16 outputs); on a 7 x 7 plane the weights are the larger, so the node also runs
the gate and the conv one after the other, in one step, and the session times both.
"""

from __future__ import annotations

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Opt, Var, op
from fusion_patterns.activation import activation_keywords
from fusion_patterns.conv import INPUTS as ONE_CONV_INPUTS
from fusion_patterns.conv import (
    blocked_plan,
    check_conv,
    conv_attributes,
    conv_epilogue,
    folded,
    pointwise_reason,
)

PREFIXES = ("fc1_", "fc2_")
CONV_INPUTS = ("W", "B", "bias_add")
INPUTS = ("x", *(p + name for p in PREFIXES for name in CONV_INPUTS))
PER_CONV = ONE_CONV_INPUTS[1:-1]  # the projection's W, B, bias_add, bn_scale, ... bn_var
GATED_INPUTS = (*INPUTS, *("p_" + name for name in PER_CONV), "p_res")


def squeeze_excite():
    x = Var("x", dtype="float32", rank=4)
    pooled = Alt(op.GlobalAveragePool(x, _name="pool"),
                 op.ReduceMean(x, Opt(Const("axes")), _name="pool"))  # fmt: skip
    hidden = conv_epilogue(pooled, "fc1_", residual=False, norm=False)
    gate = conv_epilogue(hidden, "fc2_", residual=False, norm=False)
    return op.Mul(x, gate, _name="scale")


def squeeze_excite_conv():
    return conv_epilogue(squeeze_excite(), "p_", residual=True)


def attributes(m) -> dict:
    return {f"{p}{k}": v for p in PREFIXES for k, v in conv_attributes(m, p).items()}


def gated_attributes(m) -> dict:
    return {**attributes(m), **{f"p_{k}": v for k, v in conv_attributes(m, "p_").items()}}


def check(m) -> str | None:
    pool = m.node("pool")
    if pool.op_type == "ReduceMean":
        attrs = m.attrs("pool")
        axes = m.const("axes")
        axes = attrs.get("axes") if axes is None else axes.tolist()
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            return f"ReduceMean {pool.name} over axes {axes}, not the spatial axes [2, 3]"
        if not attrs.get("keepdims", 1):
            return f"ReduceMean {pool.name} with keepdims=0: the convs need [N, C, 1, 1]"
    channels = m.type("x").shape[1] if m.type("x") and m.type("x").shape else None
    for p in PREFIXES:
        w = m.const(p + "W")
        attrs = m.attrs(p + "conv")
        if w.ndim != 4 or w.shape[2:] != (1, 1) or int(attrs["group"]) != 1:
            return f"{p[:-1]}: a {list(w.shape)} conv of group {attrs['group']}, not a 1x1 one"
        if any(attrs["pads"]):
            return f"{p[:-1]}: pads {list(attrs['pads'])} on a 1x1 image"
        reason = check_conv(m, p)
        if reason:
            return f"{p[:-1]}: {reason}"
    w1, w2 = m.const("fc1_W"), m.const("fc2_W")
    if w1.shape[0] != w2.shape[1] or w2.shape[0] != w1.shape[1]:
        return f"conv weights {list(w1.shape)} and {list(w2.shape)} do not chain C -> M -> C"
    if channels not in (None, w1.shape[1]) and isinstance(channels, int):
        return f"x has {channels} channels, the gate {w2.shape[0]}"
    return None


def check_gated(m) -> str | None:
    reason = check(m) or pointwise_reason(m, "p_")
    if reason:
        return reason
    w1, wp = m.const("fc1_W"), m.const("p_W")
    if wp.shape[1] != w1.shape[1]:
        return f"p: a conv on {wp.shape[1]} channels after a gate of {w1.shape[1]}"
    reason = check_conv(m, "p_")
    return f"p: {reason}" if reason else None


def gate_plan(attrs: dict, constants: list):
    """The gate's two 1x1 convs (their biases and activations) as one
    kernels/squeeze_excite.py plan; constants in INPUTS' order."""
    from fusion_kernels.simd.activation import encode  # heavy (Numba): only when a kernel is built
    from fusion_kernels.squeeze_excite import prepare_squeeze_excite

    convs = []
    for k, p in enumerate(PREFIXES):  # each 1x1 conv: W [M, C], bias, activation
        conv = {key[len(p) :]: v for key, v in attrs.items() if key.startswith(p)}
        w, b = folded(conv, [None, *constants[1 + 3 * k : 4 + 3 * k]])
        convs.append((w[:, :, 0, 0], b, encode(**activation_keywords(conv))))
    (w1, b1, act1), (w2, b2, act2) = convs
    return convs, prepare_squeeze_excite(w1, b1, w2, b2, act1, act2)


class SqueezeExciteKernel:
    """Tactics: the blocked layout (x and y blocked, as the convs around it leave them) in one
    parallel region and in four (kernels/squeeze_excite.py: which is faster depends on the
    shapes), then NCHW. All compute the gate the same way from the plane means."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block  # heavy (Numba): only when a kernel is built
        from fusion_kernels.dense_gemm import prepare_dense
        from fusion_kernels.linear_act import linear_act
        from fusion_kernels.pointwise import pointwise, prepare_pointwise
        from fusion_kernels.pool import global_average_pool
        from fusion_kernels.squeeze_excite import squeeze_excite_blocked

        convs, se_plan = gate_plan(attrs, constants)
        self.layers = [prepare_dense(w.T, b, act) for w, b, act in convs]  # W [C, M]
        self.channels = self.layers[0].k
        self._linear_act = linear_act
        gated = prepare_pointwise(self.channels, gated=True)

        # The plane means: GlobalAveragePool's kernels (float64 sums, parallel over planes).
        # NumPy's float64 mean over the middle axis of the blocked array cost 24-62 us per
        # block in MobileNetV3's shapes, against 7-15 us (bench/NOTES.md).
        def run(x, *_constants):
            return (pointwise(x, gated, gate=self.gate(global_average_pool(x))),)

        # Blocked: the whole block in one call (kernels/squeeze_excite.py): as separate
        # kernels, each call and parallel region cost a few microseconds, 37-94 us a block.
        def run_blocked(xb, *_constants):
            return (squeeze_excite_blocked(xb, se_plan, one_region=True),)

        def run_regions(xb, *_constants):
            return (squeeze_excite_blocked(xb, se_plan),)

        self.run = run
        layout = dict(blocked_inputs=(0,), in_blocks=(block(),), blocked_outputs=(0,),
                      out_channels=(self.channels,))  # fmt: skip
        self.tactics = [
            Tactic("blocked", run_blocked, **layout),
            Tactic("blocked-regions", run_regions, **layout),
            Tactic("nchw", run),
        ]

    def gate(self, means: np.ndarray) -> np.ndarray:
        """[N, C] gate from [N, C] plane means: two 1x1 convs with their epilogues."""
        t = np.ascontiguousarray(means, np.float32)
        for plan in self.layers:  # not NumPy's matmul: see kernels/dense_gemm.py
            t = self._linear_act(t, plan)
        return t

    def __call__(self, x, *constants):
        return self.run(x, *constants)


def make_kernel(attrs: dict, constants: list):
    return SqueezeExciteKernel(attrs, constants)


RULE = Rule(
    "SqueezeExcite",
    squeeze_excite(),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=15,  # before ConvBiasRelu takes its two convs
    description="squeeze-excitation: x * act(conv(act(conv(mean_hw(x))))), float32 NCHW",
    explain_after="Conv",
)


class SqueezeExciteConvKernel:
    """Tactics on blocked tensors (x, the residual and z in the layout of the convs around):
    the gate folded into each image's weights of the conv ("blocked-gated"), and the gate then
    the conv ("blocked-opbyop"), each with the gate's phases in four parallel regions or in
    one (as SqueezeExcite's tactics); the conv on the first register tile of tile_options.
    Called on NCHW tensors it converts them and runs the first."""

    def __init__(self, attrs: dict, constants: list):
        from fusion_kernels.blocked import block, from_blocked, to_blocked  # heavy (Numba)
        from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc, tile_options
        from fusion_kernels.squeeze_excite import (
            bind_gated_weights,
            bind_squeeze_excite_blocked,
            gated_weights,
            squeeze_excite_blocked,
        )

        _, se = gate_plan(attrs, constants)
        conv = {key[2:]: v for key, v in attrs.items() if key.startswith("p_")}
        first = GATED_INPUTS.index("p_W")
        w, bias = folded(conv, [None, *constants[first : first + len(PER_CONV)]])
        b = block()
        plan = blocked_plan(conv, w, bias, tile_options(w.shape, 1)[0], in_block=b)
        res_slot = GATED_INPUTS.index("p_res")
        m = w.shape[0]

        def tactic(fold: bool, one_region: bool):
            def run(xb, *others):
                r = others[res_slot - 1] if plan.residual else None
                if fold:
                    weights = gated_weights(xb, se, plan, one_region)
                    return (conv_nchwc(xb, plan, residual=r, weights=weights),)
                y = squeeze_excite_blocked(xb, se, one_region=one_region)
                return (conv_nchwc(y, plan, residual=r),)

            def bind(xb, *others):
                r = others[res_slot - 1] if plan.residual else None
                if fold:
                    gate = bind_gated_weights(xb, se, plan, one_region)
                    conv = bind_conv_nchwc(xb, plan, residual=r, weights=gate(xb))
                    if plan.residual:
                        return lambda xb, *o: (conv(xb, o[res_slot - 1], gate(xb)),)
                    return lambda xb, *o: (conv(xb, None, gate(xb)),)
                gate = bind_squeeze_excite_blocked(xb, se, one_region=one_region)
                conv = bind_conv_nchwc(xb, plan, residual=r)  # y has x's shape
                if plan.residual:
                    return lambda xb, *o: (conv(gate(xb), o[res_slot - 1]),)
                return lambda xb, *o: (conv(gate(xb)),)

            name = ("blocked-gated" if fold else "blocked-opbyop") + ("-one" if one_region else "")
            reads = (0, res_slot) if plan.residual else (0,)
            # depth_first: folded, x g is never written (fusion.bench.traffic)
            return Tactic(name, run, blocked_inputs=reads, in_blocks=(b,) * len(reads),
                          blocked_outputs=(0,), out_channels=(m,), depth_first=fold,
                          bind=bind)  # fmt: skip

        self.tactics = [tactic(f, o) for f in (True, False) for o in (False, True)]
        blocked = self.tactics[0].run

        def run(x, *others):
            others = list(others)
            if plan.residual:
                others[res_slot - 1] = to_blocked(others[res_slot - 1], b)
            return (from_blocked(blocked(to_blocked(x, b), *others)[0], m),)

        self.run = run

    def __call__(self, x, *constants):
        return self.run(x, *constants)


GATED_CONV = Rule(
    "SqueezeExciteConv",
    squeeze_excite_conv(),
    inputs=GATED_INPUTS,
    prepare=SqueezeExciteConvKernel,
    attributes=gated_attributes,
    check=check_gated,
    accumulates=True,
    priority=17,  # before SqueezeExcite (15) and ConvBiasRelu (10) take its parts
    description="squeeze-excitation, then a 1x1 conv [+ residual]: the gate folded into the "
    "conv's weights per image, float32",
    explain_after="GlobalAveragePool",  # a conv after any Mul (SiLU's) is no near-miss
    from_last=True,
)
