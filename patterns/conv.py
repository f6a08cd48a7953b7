"""ConvBiasRelu:  y = epilogue(conv(x, W)), a Conv and everything exporters write after it.

    t = conv(x, W) + B                 B: Conv's input, a per-channel Add, both, or none
    t = (t - mean) s / sqrt(var + eps) + b        an unfolded BatchNormalization
    t = t + r                          a residual added before the activation (ResNet)
    t = act(t)                         patterns/activation.py, or none (projection convs)
    y = t + r                          or after it (MobileNetV2's inverted residuals)

x is [N, C, H, W], or [N, C, L] (Conv1d, run as H = 1). Exporters write the bias as Conv's
input (PyTorch), an Add of a constant shaped [C,1,1] or [1,C,1,1] (TensorFlow converters), or
both; a [C]-shaped Add broadcasts along the width, not the channels, and is declined with that
reason. The BatchNorm folds into the weights when the kernel is built: W' = W s', b' = (B -
mean) s' + b with s' = s / sqrt(var + eps). The residual r is any tensor of the output's shape,
the fused node's last input; the blocked kernel takes it blocked.

The name is historical (the rule began as Conv + bias + Relu) and kept so that files fused
before still bind their kernel. FireModule and ConvConcat build on the same sub-pattern with a
clip-only epilogue (`conv_epilogue(kinds=CLIPPING, residual=False)`), what kernels/conv2d runs.
"""

from __future__ import annotations

import os

import numpy as np

from fusion.catalog import Rule, Tactic
from fusion.pattern import Alt, Const, Opt, Pattern, Var, op
from fusion_patterns.activation import (
    CLIPPING,
    KINDS,
    activation,
    activation_attributes,
    activation_keywords,
    check_relu6,
)

INPUTS = ("x", "W", "B", "bias_add", "bn_scale", "bn_bias", "bn_mean", "bn_var", "res")
RESIDUAL_SLOT = INPUTS.index("res")


def per_channel(bias: np.ndarray) -> str | None:
    """A constant added to an NCHW tensor is a channel bias if it broadcasts along axis 1 only."""
    if bias.ndim > 4:
        return f"bias of shape {list(bias.shape)} has more than 4 axes"
    shape = (1,) * (4 - bias.ndim) + bias.shape
    if shape[0] != 1 or shape[2] != 1 or shape[3] != 1:
        return f"Add of shape {list(bias.shape)} is not a per-channel bias"
    return None


def padded(x: Pattern, prefix: str = "") -> Pattern:
    """x, or a Pad of x (its pads, constant value and axes captured as constants): Keras's
    ZeroPadding2D before a 'valid' conv, as tf2onnx writes it (check_pad says when the conv's
    own padding can take it)."""
    pad = op.Pad(x, Const(prefix + "pad_pads"), Opt(Const(prefix + "pad_value")),
                 Opt(Const(prefix + "pad_axes")), _name=prefix + "pad")  # fmt: skip
    return Alt(pad, x)


def conv_epilogue(x: Pattern | None = None, prefix: str = "", kinds=KINDS,
                  residual: bool | Pattern = True, norm: bool = True,
                  pad: bool = False, nhwc: bool = False) -> Pattern:  # fmt: skip
    """Conv (+ bias) (+ BatchNorm) (+ residual) (+ act) (+ residual) on input `x`; captures
    named with `prefix`. kinds: the activations allowed; residual: whether Adds of another
    tensor may join (the residual captured as `{prefix}res`, or the pattern given: a block's
    own input; its Add as res_before or res_after); norm: whether a BatchNormalization may;
    pad: whether a zero Pad of x may (padded); nhwc: whether x may be an NHWC tensor that a
    Transpose to NCHW feeds to the conv (tf2onnx's input of a Keras CNN)."""
    x = x if x is not None else Var(prefix + "x", dtype="float32")
    if nhwc:
        x = Alt(op.Transpose(x, _name=prefix + "nhwc"), x)
    if pad:
        x = padded(x, prefix)
    conv = op.Conv(x, Const(prefix + "W"), Opt(Const(prefix + "B")), _name=prefix + "conv")
    t = Alt(op.Add(conv, Const(prefix + "bias_add", where=per_channel)), conv)
    if norm:
        bn = [Const(prefix + name) for name in ("bn_scale", "bn_bias", "bn_mean", "bn_var")]
        t = Alt(op.BatchNormalization(t, *bn, _name=prefix + "bn"), t)
    if not residual:
        return Alt(activation(t, prefix, kinds), t)
    r = residual if isinstance(residual, Pattern) else Var(prefix + "res", dtype="float32")
    pre = Alt(op.Add(t, r, _name=prefix + "res_before"), t)
    y = Alt(activation(pre, prefix, kinds), t)  # no activation: a residual is added after
    return Alt(op.Add(y, r, _name=prefix + "res_after"), y)


def pad_amounts(m, prefix: str = "") -> list[int]:
    """A matched Pad's [top, left, bottom, right] (zeros when there is none)."""
    if prefix + "pad" not in m.node_index:
        return [0, 0, 0, 0]
    p = [int(v) for v in m.const(prefix + "pad_pads").reshape(-1)]
    return [p[2], p[3], p[6], p[7]]  # ONNX's order: every axis's begin, then every end


def check_nhwc(m, prefix: str = "") -> str | None:
    """Why a Transpose before the conv is not NHWC -> NCHW of a 4-D x, if it is not."""
    if prefix + "nhwc" not in m.node_index:
        return None
    perm = list(m.attrs(prefix + "nhwc").get("perm") or [])
    if perm != [0, 3, 1, 2]:
        return f"Transpose {m.node(prefix + 'nhwc').name} with perm {perm}, not NHWC -> NCHW"
    return None


def check_pad(m, prefix: str = "", consumer: str = "conv") -> str | None:
    """Why a matched Pad cannot become the padding of the node after it (`consumer`, a conv or
    a pool), if it cannot: zeros around the spatial axes of a 4-D x, the node padded
    explicitly (not auto_pad SAME)."""
    if prefix + "pad" not in m.node_index:
        return None
    node = m.node(prefix + "pad")
    mode = m.attrs(prefix + "pad").get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    value, axes = m.const(prefix + "pad_value"), m.const(prefix + "pad_axes")
    pads = m.const(prefix + "pad_pads")
    if mode != "constant" or (value is not None and np.any(value != 0)):
        shown = mode if mode != "constant" else f"constant {value.reshape(-1)[0]}"
        return f"Pad {node.name} pads with {shown}; a conv's padding is zeros"
    if axes is not None:
        return f"Pad {node.name} names its axes {axes.tolist()}; the rule reads pads of all four"
    p = pads.reshape(-1).tolist()
    if len(p) != 8 or any(v < 0 for v in p) or any(p[k] for k in (0, 1, 4, 5)):
        return f"Pad {node.name} pads {p}: only the spatial axes of a 4-D x, by >= 0"
    auto = m.attrs(prefix + consumer)["auto_pad"]
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID"):
        return f"Pad {node.name} before a {consumer} with auto_pad {auto}: pads do not add up"
    return None


def conv_attributes(m, prefix: str = "") -> dict:
    """What the kernel needs to know about one Conv and its epilogue (a Pad before it: in its
    pads)."""
    conv = m.attrs(prefix + "conv")
    own = [0, 0, 0, 0] if conv["auto_pad"] in ("VALID", b"VALID") else list(conv["pads"])
    extra = pad_amounts(m, prefix)
    attrs = {
        "strides": list(conv["strides"]),
        "pads": [a + b for a, b in zip(own, extra, strict=True)] if any(extra) else own,
        "dilations": list(conv["dilations"]),
        "group": int(conv["group"]),
        "auto_pad": "NOTSET" if any(extra) else conv["auto_pad"],  # VALID's 0 + the Pad's
        **activation_attributes(m, prefix),
    }
    if prefix + "bn" in m.node_index:
        attrs["epsilon"] = float(m.attrs(prefix + "bn").get("epsilon", 1e-5))
    if prefix + "nhwc" in m.node_index:
        attrs["nhwc"] = 1
    for where in ("before", "after"):
        if f"{prefix}res_{where}" in m.node_index:
            attrs["residual"] = where
    return attrs


def check_conv(m, prefix: str = "", res: str | None = None) -> str | None:
    """Why the structure matched is not one the kernels run, if it is not. res: the residual's
    capture when conv_epilogue was given one (default: its own, prefix + "res")."""
    w = m.const(prefix + "W")
    rank = w.ndim
    if prefix + "x" in m:  # the match's own input (not an inner conv of a larger pattern)
        vt = m.type(prefix + "x")
        if vt is None or vt.rank is None:
            return f"rank of {m[prefix + 'x']} is unknown"
        rank = vt.rank
        if rank not in (3, 4):
            return f"{m[prefix + 'x']} has rank {rank}: the kernels run 1-D and 2-D convs"
        if w.ndim != rank:
            return f"weight of rank {w.ndim} for an input of rank {rank}"
    channels = w.shape[0]
    bias = m.const(prefix + "bias_add")
    if bias is not None and bias.size not in (1, channels):
        return f"bias of shape {list(bias.shape)} does not match {channels} output channels"
    if rank == 3 and bias is not None and bias.ndim > 2 and bias.size > 1:
        return f"bias of shape {list(bias.shape)} does not broadcast along [N, C, L]'s channels"
    if prefix + "bn" in m.node_index:
        reason = check_bn(m, prefix, channels)
        if reason:
            return reason
    return (check_nhwc(m, prefix) or check_pad(m, prefix) or check_relu6(m, prefix)
            or _check_residual(m, prefix, res or prefix + "res"))  # fmt: skip


def pointwise_reason(m, p: str) -> str | None:
    """Why the conv captured with prefix p is not a plain 1x1 one (stride 1, no pads, group
    1), if it is not: what the depth-first kernels run on a band's pixels."""
    w, a = m.const(p + "W"), m.attrs(p + "conv")
    if w.ndim != 4 or w.shape[2:] != (1, 1) or int(a["group"]) != 1:
        return f"{p[:-1]}: a {list(w.shape)} conv of group {a['group']}, not a 1x1 one"
    if any(a["pads"]) or any(s != 1 for s in a["strides"]) or a["auto_pad"] not in ("NOTSET", ""):
        return f"{p[:-1]}: a 1x1 conv with pads {list(a['pads'])}, strides {list(a['strides'])}"
    return None


def check_bn(m, prefix: str, channels: int) -> str | None:
    """Why a matched BatchNormalization cannot be folded, if it cannot."""
    bn = m.node(prefix + "bn")
    if m.attrs(prefix + "bn").get("training_mode", 0):
        return f"{bn.op_type} {bn.name}: training_mode=1 (statistics of the batch, not folded)"
    for name in ("bn_scale", "bn_bias", "bn_mean", "bn_var"):
        value = m.const(prefix + name)
        if value.size != channels:
            return (
                f"BatchNormalization {name[3:]} of shape {list(value.shape)}, {channels} channels"
            )
    return None


def _check_residual(m, prefix: str, res: str) -> str | None:
    """The residual is a run-time tensor of the output's shape (a constant is a bias that did not
    fit; a smaller tensor would broadcast, which the kernel does not)."""
    adds = [f"{prefix}res_{w}" for w in ("before", "after") if f"{prefix}res_{w}" in m.node_index]
    if not adds:
        return None
    if len(adds) == 2:
        return "a residual Add both before and after the activation; the kernel adds one"
    node = m.node(adds[0])
    value = m[res]
    if m.const(res) is not None:
        return f"Add of shape {list(m.const(res).shape)} is not a per-channel bias"
    have, want = m.type(res), m.view.type_of(node.output[0])
    if have is None or want is None or have.shape is None or want.shape is None:
        return f"Add {node.name}: the shape of {value} is unknown (a residual has the output's)"
    if len(have.shape) != len(want.shape) or any(
        a != b or not isinstance(a, (int, str)) or a in ("", None)
        for a, b in zip(have.shape, want.shape, strict=False)
    ):
        return (f"Add {node.name}: {value} of shape {list(have.shape)} broadcasts to "
                f"{list(want.shape)}; the kernel adds a tensor of the output's shape")  # fmt: skip
    return None


# ---- building the kernel ---------------------------------------------------------------------
def bn_affine(scale, bias, mean, var, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """BatchNormalization as y = x s + t per channel, in float64:
    s = scale / sqrt(var + eps), t = bias - mean s."""
    s = np.reshape(scale, -1) / np.sqrt(np.reshape(var, -1).astype(np.float64) + eps)
    return s, np.reshape(bias, -1) - np.reshape(mean, -1) * s


def folded(attrs: dict, constants: list) -> tuple[np.ndarray, np.ndarray | None]:
    """(W [M, C/group, kh, kw], bias [M] or None) in float32 with the bias Add and the BatchNorm
    folded in (in float64, rounded once); a Conv1d's weight gets kh = 1."""
    _, w, b, bias_add, scale, shift, mean, var = (list(constants) + [None] * 8)[:8]
    m = w.shape[0]
    biases = [np.broadcast_to(np.reshape(v, -1), (m,)) for v in (b, bias_add) if v is not None]
    bias = np.sum(biases, axis=0, dtype=np.float64) if biases else None
    weight = np.asarray(w, np.float64)
    if scale is not None:
        s, t = bn_affine(scale, shift, mean, var, attrs.get("epsilon", 1e-5))
        weight = weight * s.reshape(-1, *([1] * (w.ndim - 1)))
        bias = (0.0 if bias is None else bias) * s + t
    if weight.ndim == 3:
        weight = weight[:, :, None, :]
    return weight.astype(np.float32), None if bias is None else np.asarray(bias, np.float32)


def geometry(attrs: dict, rank: int) -> dict:
    """strides, pads (top, left, bottom, right), dilations of the 2-D conv that runs it: a 1-D
    conv's own with a height-1 axis in front."""
    strides, pads, dilations = attrs["strides"], attrs["pads"], attrs["dilations"]
    if rank == 3:
        strides, dilations = [1, *strides], [1, *dilations]
        pads = [0, pads[0], 0, pads[1]]
    return {"strides": tuple(strides), "pads": tuple(pads), "dilations": tuple(dilations),
            "group": attrs["group"], "auto_pad": attrs["auto_pad"]}  # fmt: skip


def clips_only(attrs: dict) -> bool:
    """Whether kernels/conv2d's own epilogue (bias, clip) is the whole epilogue."""
    return attrs.get("activation", "identity") in (*CLIPPING, "identity") and not attrs.get(
        "residual"
    )


def conv_plan(attrs: dict, weight: np.ndarray, bias: np.ndarray | None):
    """kernels/conv2d's plan with the clip of the epilogue (the rest: see ConvKernel)."""
    from fusion_kernels.conv2d import prepare_conv2d  # heavy (Numba): only when a kernel is built

    clip = activation_keywords(attrs) if clips_only(attrs) else {}  # else: identity
    return prepare_conv2d(weight, bias, **geometry(attrs, 4), **clip)


def blocked_plans(attrs: dict, weight: np.ndarray, bias: np.ndarray | None) -> list:
    """The conv packed for the blocked-layout kernel, once per register tile worth timing
    (none when that kernel cannot run it)."""
    from fusion_kernels.conv_nchwc import supports, tile_options  # heavy (Numba)

    if supports(weight.shape, attrs["group"]) is not None:
        return []
    return [
        blocked_plan(attrs, weight, bias, t) for t in tile_options(weight.shape, attrs["group"])
    ]


def blocked_plan(attrs: dict, weight: np.ndarray, bias: np.ndarray | None, tile: int,
                 in_block: int | None = None):  # fmt: skip
    """The conv packed for the blocked-layout kernel with `tile` output blocks per tile, with
    the whole epilogue (in_block: the input's channels per block, when not the default)."""
    from fusion_kernels.conv_nchwc import prepare_conv_nchwc  # heavy (Numba)

    return prepare_conv_nchwc(weight, bias, **geometry(attrs, 4), **activation_keywords(attrs),
                              residual=attrs.get("residual"), tile=tile,
                              in_block=in_block)  # fmt: skip


class BlockedPart:
    """One conv of a concatenation (ConvConcat's branches, a Fire module's expand convs) run in
    the blocked layout, writing its channel blocks of the concatenated output: the direct
    kernel in place (conv_nchwc's `at`: no copy), or, with `winograd`, a 3x3 stride-1 conv on
    the blocked Winograd kernel (F(4x4) where its reason allows, else F(2x2)), in place too
    (winograd_nchwc's `at`). One register tile, the first that tile_options ranks (a node of several
    convs is timed as a whole: one tactic per combination of tiles would multiply). `reason`
    says why the conv cannot run blocked; None when it can."""

    def __init__(self, attrs: dict, weight: np.ndarray, bias: np.ndarray | None,
                 winograd: bool = False, in_block: int | None = None):  # fmt: skip
        from fusion_kernels.conv_nchwc import supports, tile_options  # heavy (Numba)

        attrs = {**attrs, **geometry(attrs, 4)}
        self.reason = supports(weight.shape, attrs["group"])
        self.direct = self.wino = None
        if self.reason is not None:
            return
        tile = tile_options(weight.shape, attrs["group"])[0]
        self.direct = blocked_plan(attrs, weight, bias, tile, in_block)
        self.in_block, self.blocks = self.direct.in_block, self.direct.out_blocks
        if winograd and self.in_block == self.direct.block:
            from fusion_kernels.winograd_nchwc import prepare_winograd_nchwc

            tiles = [t for t in (4, 2) if winograd_reason(attrs, weight, 4, t) is None]
            if tiles:
                self.wino = prepare_winograd_nchwc(weight, bias, tile=tiles[0],
                                                   **geometry(attrs, 4),
                                                   **activation_keywords(attrs))  # fmt: skip

    def output_shape(self, x_shape) -> tuple:
        from fusion_kernels.conv_nchwc import output_shape

        return output_shape(x_shape, self.direct)

    def bind(self, xb, out, at: int):
        """write(xb, out, at) specialized for arrays of these shapes: f(xb, out) -> out
        (kernels' bind_conv_nchwc, bind_winograd_nchwc)."""
        from fusion_kernels.conv_nchwc import bind_conv_nchwc
        from fusion_kernels.winograd_nchwc import bind_winograd_nchwc

        if self.wino is None:
            return bind_conv_nchwc(xb, self.direct, out=out, at=at)
        return bind_winograd_nchwc(xb, self.wino, out=out, at=at)

    def write(self, xb, out, at: int):
        """Its output into blocks at, at + 1, ... of the blocked array `out`."""
        from fusion_kernels.conv_nchwc import conv_nchwc
        from fusion_kernels.winograd_nchwc import winograd_nchwc

        if self.wino is None:
            conv_nchwc(xb, self.direct, out=out, at=at)
        else:
            winograd_nchwc(xb, self.wino, out=out, at=at)


def blocked_concat(parts: list[BlockedPart], xs) -> np.ndarray:
    """concat_1(part_k(xs[k])) in the blocked layout, each part writing its own blocks (every
    part but the last holds whole blocks: patterns/concat.why_not_blocked)."""
    from fusion_kernels.workspace import empty  # heavy (Numba)

    shapes = [p.output_shape(x.shape) for p, x in zip(parts, xs, strict=True)]
    n, _, oh, ow, b = shapes[0]
    if any((s[0], s[2], s[3]) != (n, oh, ow) for s in shapes):
        sizes = ", ".join(f"{s[0]}x{s[2]}x{s[3]}" for s in shapes)
        raise ValueError(f"branch outputs differ in batch or size ({sizes}): cannot concatenate")
    y = empty((n, sum(s[1] for s in shapes), oh, ow, b))
    at = 0
    for part, x, shape in zip(parts, xs, shapes, strict=True):
        part.write(x, y, at)
        at += shape[1]
    return y


def bind_blocked_concat(parts: list[BlockedPart], xs):
    """blocked_concat(parts, xs) specialized for arrays of these shapes: f(xs) -> y, the
    parts' calls bound (BlockedPart.bind) and y's shape worked out once."""
    from fusion_kernels.workspace import allocator  # heavy (Numba)

    y = blocked_concat(parts, xs)  # checks the shapes
    calls, at = [], 0
    for part, x in zip(parts, xs, strict=True):
        calls.append(part.bind(x, y, at))
        at += part.output_shape(x.shape)[1]
    shape, size, alloc = y.shape, y.size, allocator()

    def call(xs):
        y = alloc(size).reshape(shape)
        for write, x in zip(calls, xs, strict=True):
            write(x, y)
        return y

    return call


# The blocked Winograd tactics offered to the race: F(2x2, 3x3) and F(4x4, 3x3) by default
# (4x fewer multiplies than direct, ~5e-6 of the output's scale in error at 64 channels against
# F(2x2)'s ~1e-6); "2": F(2x2) only; "0": neither (the direct kernel and onnxruntime alone).
WINOGRAD_SWITCH = "FUSION_BLOCKED_WINOGRAD"


def winograd_reason(attrs: dict, weight: np.ndarray, rank: int, tile: int = 2) -> str | None:
    """Why the blocked Winograd kernel F(tile x tile, 3x3) is not offered for this conv (attrs
    as geometry gives them), or None when it is: 2-D, 3x3, stride 1, dilation 1, group 1, and
    for F(4x4) at most MAX_F4_CHANNELS input channels (its error grows with C: bench/NOTES.md,
    Winograd), unless FUSION_BLOCKED_WINOGRAD turns it off."""
    switch = os.environ.get(WINOGRAD_SWITCH, "4")
    if switch not in ("0", "2", "4") or (tile == 4 and switch != "4") or switch == "0":
        return (f"the blocked Winograd F({tile}x{tile}) is turned off ({WINOGRAD_SWITCH}="
                f"{switch!r}; 4 offers F(2x2) and F(4x4), 2 F(2x2) only)")  # fmt: skip
    from fusion_kernels.winograd_nchwc import MAX_F4_CHANNELS, supports  # heavy (Numba)

    if rank != 4:
        return "a 1-D conv: Winograd runs 2-D convs only"
    reason = supports(weight.shape, attrs["strides"], attrs["dilations"], attrs["group"])
    if reason is None and tile == 4 and weight.shape[1] > MAX_F4_CHANNELS:
        reason = (f"{weight.shape[1]} input channels: F(4x4, 3x3)'s error is inside the "
                  f"rule's tolerance up to {MAX_F4_CHANNELS}")  # fmt: skip
    return reason


class ConvKernel:
    """A fused conv's kernel. Called on NCHW (or [N, C, L]) inputs it runs kernels/conv2d, and
    kernels/pointwise for an epilogue beyond a clip; `tactics` offers the blocked-layout kernel
    first when it runs the conv (2-D inputs; one tactic per register tile worth timing,
    "blocked-f4" = 4 output blocks per tile), then that NCHW path (their fallback)."""

    def __init__(self, attrs: dict, weight: np.ndarray, bias: np.ndarray | None, rank: int):
        from fusion_kernels.conv2d import (
            conv2d_bias_act,  # heavy (Numba): only when a kernel is built
        )
        from fusion_kernels.conv_nchwc import bind_conv_nchwc, conv_nchwc
        from fusion_kernels.pointwise import pointwise, prepare_pointwise

        attrs = {**attrs, **geometry(attrs, rank)}
        nchw = conv_plan(attrs, weight, bias)
        rest = None
        if not clips_only(attrs):
            rest = prepare_pointwise(weight.shape[0], **activation_keywords(attrs),
                                     residual=attrs.get("residual"))  # fmt: skip

        def run(x, *others):
            r = others[RESIDUAL_SLOT - 1] if len(others) >= RESIDUAL_SLOT else None
            x4 = x if x.ndim == 4 else x[:, :, None, :]
            y = conv2d_bias_act(x4, nchw)
            if rest is not None:
                pointwise(y, rest, residual=None if r is None else r.reshape(y.shape), out=y)
            return (y if x.ndim == 4 else y[:, :, 0, :],)

        self.run = run
        residual = bool(attrs.get("residual"))

        def blocked_tactic(plan, nchw_in=False):
            """The direct kernel on `plan`. nchw_in: x read in NCHW as blocks of one channel
            (a plan with in_block 1): a stem's image (C under a block) is not converted to the
            blocked layout first (3 x 224 x 224: 25-60 us, or the plan takes an NCHW tactic
            there to avoid it)."""

            def run_blocked(xb, *others):
                r = others[RESIDUAL_SLOT - 1] if residual else None
                if nchw_in:
                    xb = np.ascontiguousarray(xb).reshape(*xb.shape, 1)
                return (conv_nchwc(xb, plan, residual=r),)

            def bind(xb, *others):
                r = others[RESIDUAL_SLOT - 1] if residual else None
                if nchw_in:
                    shape = (*xb.shape, 1)
                    call = bind_conv_nchwc(np.ascontiguousarray(xb).reshape(shape), plan, r)
                    if residual:
                        return lambda x, *o: (call(x.reshape(shape), o[RESIDUAL_SLOT - 1]),)
                    return lambda x, *o: (call(x.reshape(shape)),)
                call = bind_conv_nchwc(xb, plan, residual=r)
                if residual:
                    return lambda xb, *others: (call(xb, others[RESIDUAL_SLOT - 1]),)
                return lambda xb, *others: (call(xb),)

            reads = ([] if nchw_in else [(0, plan.in_block)]) + (
                [(RESIDUAL_SLOT, plan.block)] if residual else [])  # fmt: skip
            return Tactic(
                f"blocked-f{plan.fb}" + ("-nchw-in" if nchw_in else ""), run_blocked,
                blocked_inputs=tuple(pos for pos, _ in reads),
                in_blocks=tuple(block for _, block in reads),
                blocked_outputs=(0,), out_channels=(weight.shape[0],), bind=bind,
            )  # fmt: skip

        def wino_tactic(tile):
            from fusion_kernels.winograd_nchwc import (
                bind_winograd_nchwc,
                prepare_winograd_nchwc,
                winograd_nchwc,
            )

            plan = prepare_winograd_nchwc(weight, bias, tile=tile, **geometry(attrs, 4),
                                          **activation_keywords(attrs),
                                          residual=attrs.get("residual"))  # fmt: skip

            def run_wino(xb, *others):
                r = others[RESIDUAL_SLOT - 1] if residual else None
                return (winograd_nchwc(xb, plan, residual=r),)

            def bind(xb, *others):
                r = others[RESIDUAL_SLOT - 1] if residual else None
                call = bind_winograd_nchwc(xb, plan, residual=r)
                if residual:
                    return lambda xb, *others: (call(xb, others[RESIDUAL_SLOT - 1]),)
                return lambda xb, *others: (call(xb),)

            return Tactic(
                f"blocked-wino{tile}", run_wino,
                blocked_inputs=(0, RESIDUAL_SLOT) if residual else (0,),
                in_blocks=(plan.block, plan.block) if residual else (plan.block,),
                blocked_outputs=(0,), out_channels=(weight.shape[0],), bind=bind,
            )  # fmt: skip

        plans = blocked_plans(attrs, weight, bias) if rank == 4 else []
        stems = []  # the first tile's plan reading NCHW, for an input narrower than a block
        if plans and attrs["group"] == 1 and weight.shape[1] < plans[0].block:
            stems = [blocked_plan(attrs, weight, bias, plans[0].fb, in_block=1)]
        self.winograd_reasons = {t: winograd_reason(attrs, weight, rank, t) for t in (2, 4)}
        winos = [wino_tactic(t) for t, why in self.winograd_reasons.items() if why is None]
        # NCHW last, the blocked ones' fallback: timed per node on Zen 4 it lost 177 of 177
        # convs of the ten CNNs at W = 16, 94 of 98 with the 8-lane code (bench/NOTES.md)
        self.tactics = [*map(blocked_tactic, plans), *(blocked_tactic(p, True) for p in stems),
                        *winos,
                        Tactic(f"nchw-{nchw.method}", run, fallback=bool(plans))]  # fmt: skip

    def __call__(self, x, *others):
        return self.run(x, *others)


def make_kernel(attrs: dict, constants: list):
    """Fold the bias and BatchNorm into the weights once (for every tactic); the kernel runs
    the fused convolution and its epilogue."""
    weight, bias = folded(attrs, constants)
    kernel = ConvKernel(attrs, weight, bias, constants[1].ndim)
    return nhwc_input(kernel) if attrs.get("nhwc") else kernel


def nhwc_input(kernel: ConvKernel):
    """The kernel on an NHWC x (the Transpose before the conv joined the node). An NHWC image
    of C channels is already the blocked layout at C channels per block ([N, 1, H, W, C]): a
    blocked tactic that reads blocks of C (a stem's 3) takes x as it is, the others transpose
    it first."""
    from fusion_kernels.blocked import to_blocked  # heavy (Numba): only when a kernel is built

    def nchw(x):
        return np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))

    def reading_nhwc(t: Tactic) -> Tactic:
        if 0 not in t.blocked_inputs:
            return Tactic(t.name, lambda x, *others: t.run(nchw(x), *others), fallback=t.fallback)
        b = t.in_blocks[t.blocked_inputs.index(0)]

        def run(x, *others):
            n, h, w, c = x.shape
            same = c == b
            xb = np.ascontiguousarray(x).reshape(n, 1, h, w, c) if same else None
            return t.run(xb if same else to_blocked(nchw(x), block=b), *others)

        rest = [(i, k) for i, k in zip(t.blocked_inputs, t.in_blocks, strict=True) if i]
        return Tactic(t.name, run, blocked_inputs=tuple(i for i, _ in rest),
                      in_blocks=tuple(k for _, k in rest), blocked_outputs=t.blocked_outputs,
                      out_channels=t.out_channels, fallback=t.fallback)  # fmt: skip

    def run(x, *others):
        return kernel(nchw(x), *others)

    run.tactics = [reading_nhwc(t) for t in kernel.tactics]
    return run


def check(m) -> str | None:
    return check_conv(m)


RULE = Rule(
    "ConvBiasRelu",
    conv_epilogue(pad=True, nhwc=True),
    inputs=INPUTS,
    prepare=make_kernel,
    attributes=conv_attributes,
    check=check,
    accumulates=True,  # long float32 sums: error relative to the output's scale
    priority=10,
    description="1-D/2-D Conv + bias + BatchNorm + activation + residual Add, float32",
    explain_after="Conv",
    from_last=True,  # the root may be any node of the chain: the longest chain claims first
)
