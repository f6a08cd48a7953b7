"""What the tests share: graph builders, the onnxruntime oracle, the assertions every pattern
test makes (assert_fuses, near_miss, assert_close), naive NumPy references, and small fused
models with a NumPy kernel (ScaledRelu) for the runtime and verify tests, and the check every
refusal of bad input makes (assert_refused)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

import fusion
from fusion.catalog import DOMAIN, Catalog, Rule
from fusion.cli import main
from fusion.functions import content_hash
from fusion.models import conv_stack
from fusion.models.builder import GraphBuilder as ModelBuilder
from fusion.numerics import compare_arrays
from fusion.ort import DEFAULT, REFERENCE, inference_session
from fusion.pattern import Const, Var, op

FLOAT = TensorProto.FLOAT


# ---- graphs ----------------------------------------------------------------------------------
class GraphBuilder(ModelBuilder):
    """fusion's builder with the tests' names ("/conv3" writes "/conv3_out"), random weights,
    and models whose output types come from shape inference, as exporters write them."""

    def node_name(self, op_type: str) -> str:
        return self.fresh(f"/{op_type.lower()}")

    def output_names(self, name: str, n_out: int) -> list[str]:
        return [f"{name}_out{k}" if n_out > 1 else f"{name}_out" for k in range(n_out)]

    def weight(self, *shape, scale: float = 0.3) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def model(self, inputs: dict, outputs, elem=FLOAT, ir_version: int | None = None):
        """inputs: name -> shape; outputs: list of names (shapes left to inference)."""
        model = super().model(inputs, dict.fromkeys(outputs), elem, name="test")
        if ir_version is not None:
            model.ir_version = ir_version
        inferred = onnx.shape_inference.infer_shapes(model)  # typed outputs, as exporters write
        del model.graph.output[:]
        model.graph.output.extend(inferred.graph.output)
        if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output):
            _shapes_from_a_run(model)
        return model


def conv_block(
    g: GraphBuilder,
    x: str,
    cin: int,
    cout: int,
    k: int = 3,
    bias: str = "input",  # "input" (Conv's third input), "add", "both" or "none"
    bias_shape: tuple | None = None,
    act: str = "relu",  # "relu", "clip" (input bounds or attributes by opset), "relu6", "none"
    **conv_attrs,
) -> str:
    w = g.weight(cout, cin // conv_attrs.get("group", 1), k, k)
    inputs = [x, w]
    if bias in ("input", "both"):
        inputs.append(g.weight(cout, scale=0.1))
    y = g.node("Conv", inputs, **conv_attrs)
    if bias in ("add", "both"):
        shape = bias_shape or (1, cout, 1, 1)
        y = g.node("Add", [y, g.weight(*shape, scale=0.1)])
    if act == "relu":
        y = g.node("Relu", [y])
    elif act in ("clip", "relu6"):
        lo, hi = 0.0, (6.0 if act == "relu6" else 0.5)
        if g.opset >= 11:
            lo_name = g.const(np.array(lo, np.float32))
            hi_name = g.const(np.array(hi, np.float32))
            y = g.node("Clip", [y, lo_name, hi_name])
        else:
            y = g.node("Clip", [y], min=lo, max=hi)
    return y


def fire_graph(g, x, cin, squeeze, e1, e3, order="1x1,3x3", axis=1, name="/cat", **block):
    """Squeeze, 1x1 and 3x3 (pad 1) expand, Concat; `block` passes conv_block's variants."""
    s = conv_block(g, x, cin, squeeze, k=1, **block)
    a = conv_block(g, s, squeeze, e1, k=1, **block)
    b = conv_block(g, s, squeeze, e3, k=3, pads=[1, 1, 1, 1], **block)
    branches = [a, b] if order == "1x1,3x3" else [b, a]
    return s, a, b, g.node("Concat", branches, axis=axis, name=name)


def _shapes_from_a_run(model: onnx.ModelProto) -> None:
    """Where inference gives up, take the output ranks and sizes from one onnxruntime run."""
    results = run_ort(model, random_feeds(model, batch=1))
    for out, value in zip(model.graph.output, results, strict=True):
        dims = ["N", *value.shape[1:]] if value.ndim else []
        out.CopyFrom(helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, dims))


def random_feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def fused_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == DOMAIN]


def save_external(model: onnx.ModelProto, path: Path, location: str = "weights.bin") -> None:
    onnx.save_model(
        model, str(path), save_as_external_data=True, location=location, size_threshold=0
    )


# ---- the oracle and the assertions -----------------------------------------------------------
def run_ort(model, feeds: dict, optimize: bool = False, names=None) -> list[np.ndarray]:
    """onnxruntime on a ModelProto or a file (which reads its external data itself): the
    unfused graph as written (fusion.ort.REFERENCE), or with optimize at its defaults."""
    return inference_session(model, DEFAULT if optimize else REFERENCE).run(names, feeds)


def assert_close(got, want, rtol: float, atol: float, check_dtype: bool = True, what: str = "",
                 scaled: bool = False):  # fmt: skip
    """fusion.numerics' comparison as an assertion (check_dtype=False: a float64 reference;
    scaled: the error relative to the output's scale, an accumulating kernel's rule)."""
    result = compare_arrays(what or "value", got, want, rtol, atol, check_dtype, scaled)
    scale = ", atol raised to rtol x max |want|" if scaled else ""
    assert result.ok, f"{result} (rtol {rtol:g}, atol {atol:g}{scale})"


def assert_all_close(got, want, rtol: float, atol: float) -> None:
    """Outputs of two runs, one by one."""
    assert len(got) == len(want), (len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, rtol, atol, what=f"output {k}")


def run_bound(session: fusion.Session, feeds: dict) -> list[np.ndarray]:
    """session.run three times on the same feeds: the first run's kernel steps check their
    outputs and bind their tactics for these shapes (Tactic.bind), the second takes the bound
    calls (and its plan records them, when it may: RunPlan._record), the third replays them
    (RunPlan's program); all must give the same outputs, bit for bit (the same compiled code
    on the same arguments). Returns the third's."""
    first = session.run(None, feeds)
    for _ in range(2):
        later = session.run(None, feeds)
        for a, b in zip(first, later, strict=True):
            np.testing.assert_array_equal(b, a)
    return later


def assert_fuses(
    model: onnx.ModelProto,
    ops: list[str] | None,
    catalog: Catalog | None = None,
    batch: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> fusion.RewriteResult:
    """Rewrite; the fused ops in graph order are `ops` (None: not checked); the result passes
    the full ONNX checker and, in plain onnxruntime (through the fused nodes' function bodies),
    gives the original's outputs."""
    result = fusion.rewrite(model, catalog)
    if ops is not None:
        assert fused_ops(result.model) == ops, result.explain()
    onnx.checker.check_model(result.model, full_check=True)
    feeds = random_feeds(model, batch=batch)
    assert_all_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol, atol)
    return result


def near_miss(
    model, rule: str | None, *fragments: str, catalog: Catalog | None = None, fused=None
) -> str:
    """Rewrite; `rule` fused nothing (None: no rule fused anything), or exactly the ops `fused`
    were fused when given; the explanation of `rule` (None: of every rule) holds every fragment,
    the reason a near-miss was not fused. Returns the explanation."""
    result = fusion.rewrite(model, catalog)
    ops = fused_ops(result.model)
    if fused is not None:
        assert ops == fused, result.explain()
    else:
        assert (rule not in ops) if rule else ops == [], "a near-miss was fused"
    text = result.explain(rule)
    for fragment in fragments:
        assert fragment in text, text
    return text


# ---- naive NumPy references ------------------------------------------------------------------
def naive_conv(x, w, b, strides, pads, dilations, group, lo=-math.inf, hi=math.inf):
    """y[n, m, oh, ow] = b[m] + sum_{c, i, j} w[m, c, i, j] * xpad[n, g*Cg + c, oh*s + i*d, ...],
    clipped to [lo, hi], in float64."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = strides, dilations, pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (wd + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    y = np.zeros((n, m, oh, ow))
    mg = m // group
    for g in range(group):
        xg = xp[:, g * cg : (g + 1) * cg]
        wg = w[g * mg : (g + 1) * mg].astype(np.float64)
        for i in range(kh):
            for j in range(kw):
                r, s = i * dh, j * dw
                patch = xg[:, :, r : r + (oh - 1) * sh + 1 : sh, s : s + (ow - 1) * sw + 1 : sw]
                y[:, g * mg : (g + 1) * mg] += np.einsum("nchw,mc->nmhw", patch, wg[:, :, i, j])
    if b is not None:
        y += b.reshape(1, m, 1, 1)
    return np.clip(y, lo, hi)


def naive_lstm(x, h, c, w):
    """PyTorch's LSTM recurrence in float64 (w: fusion.models.LSTMWeights)."""
    hid = w.hidden
    hs, cs = [], []
    for xt in x.astype(np.float64):
        g = xt @ w.W.T + h @ w.R.T + w.Wb + w.Rb
        i, f, o = (1 / (1 + np.exp(-g[:, k * hid : (k + 1) * hid])) for k in (0, 1, 3))
        c = f * c + i * np.tanh(g[:, 2 * hid : 3 * hid])
        h = o * np.tanh(c)
        hs.append(h)
        cs.append(c)
    return np.array(hs), np.array(cs)


def naive_gru(x, h, w, linear_before_reset=1):
    """The GRU recurrence in float64 (w: fusion.models.GRUWeights, gates r, z, n): PyTorch's
    (the reset after the recurrent product), or with it before (linear_before_reset=0)."""
    hid = w.hidden
    hs = []
    for xt in x.astype(np.float64):
        gx, gh = xt @ w.W.T + w.Wb, h @ w.R.T + w.Rb
        r, z = (1 / (1 + np.exp(-gx[:, k] - gh[:, k])) for k in (np.s_[:hid], np.s_[hid : 2 * hid]))
        if linear_before_reset:
            n = np.tanh(gx[:, 2 * hid :] + r * gh[:, 2 * hid :])
        else:
            n = np.tanh(gx[:, 2 * hid :] + (r * h) @ w.R[2 * hid :].T + w.Rb[2 * hid :])
        h = (1 - z) * n + z * h
        hs.append(h)
    return np.array(hs)


# ---- fused models with a NumPy kernel ---------------------------------------------------------
# A "ScaledRelu" node, relu(x * s), backed by a Mul + Relu function and run by a NumPy kernel
# registered in a test catalog: fused models built by hand, for the runtime and verify.
OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]


def scaled_relu_kernel(attrs: dict, constants: list):
    """relu(x * s) in NumPy; `shift` (an attribute) exists so that a test can break the kernel."""
    shift = attrs.get("shift", 0.0)

    def run(x, s):
        return (np.maximum(x * s, 0).astype(x.dtype) + np.float32(shift),)

    return run


def scaled_relu_catalog(kernel=scaled_relu_kernel, **options) -> Catalog:
    pattern = op.Relu(op.Mul(Var("x"), Const("s")))
    return Catalog([Rule("ScaledRelu", pattern, inputs=("x", "s"), prepare=kernel, **options)])


def scaled_relu_function(attributes=()) -> onnx.FunctionProto:
    """The body the rewriter would write, named by its content hash as the rewriter names it
    (the runtime binds a kernel only to such a body)."""
    func = helper.make_function(
        DOMAIN,
        "ScaledRelu",
        ["x", "s"],
        ["y"],
        [helper.make_node("Mul", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [helper.make_opsetid("", 18)],
        attributes=list(attributes),
    )
    func.overload = content_hash(func)
    return func


def scaled_relu(x: str, s: str, y: str, name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node("ScaledRelu", [x, s], [y], name=name, domain=DOMAIN, **attrs)


def fused_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    """A model of `nodes`; each ScaledRelu node calls the function declaring its attributes."""
    functions = {(): scaled_relu_function()}
    for node in nodes:
        if node.domain == DOMAIN and node.op_type == "ScaledRelu":
            names = tuple(sorted(a.name for a in node.attribute))
            func = functions.setdefault(names, scaled_relu_function(names))
            node.overload = func.overload
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=OPSETS, functions=list(functions.values()))
    model.ir_version = 10
    return model


def tensor(name, shape=("N", 3), elem=FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


# ---- control flow ----------------------------------------------------------------------------
PADS = [1, 1, 1, 1]


def _branch(name: str, x: str, cout: int, seed: int, outer: str | None = None):
    """A subgraph holding a whole Conv + bias + Relu (weights its own, input from outside)."""
    g = GraphBuilder(seed=seed, first=100 * seed)  # names apart from the other graphs'
    y = conv_block(g, x, 4, cout, bias="add", pads=PADS)
    if outer:  # reads a value of the enclosing graph too
        y = g.node("Add", [y, outer])
    out = helper.make_tensor_value_info(y, FLOAT, None)
    return helper.make_graph(g.nodes, name, [], [out], g.inits)


def control_flow_model() -> onnx.ModelProto:
    """Patterns inside If (both branches), Loop and Scan bodies, and in the main graph one
    block that fuses and one whose Conv output is also read inside the If (an escape the
    subgraph hides), so only its Conv fuses, without the bias Add and Relu."""
    g = GraphBuilder(seed=1)
    h = conv_block(g, "x", 4, 4, pads=PADS)  # fuses
    before = len(g.nodes)
    read_inside = conv_block(g, h, 4, 4, bias="add", pads=PADS)  # its Conv output is read by the If
    conv_out = g.nodes[before].output[0]
    cond = g.node("Greater", [g.node("ReduceSum", ["x"], keepdims=0), g.const(np.float32(0))])
    if_out = g.node(
        "If",
        [cond],
        then_branch=_branch("then", read_inside, 4, 2, outer=conv_out),
        else_branch=_branch("else", read_inside, 4, 3),
    )
    # Loop: 2 iterations of v <- cbr(v), a loop-carried value.
    body = GraphBuilder(seed=4, first=400)
    v_next = conv_block(body, "v", 4, 4, bias="both", pads=PADS)
    loop_body = helper.make_graph(
        [*body.nodes, helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "loop",
        [
            helper.make_tensor_value_info("iter", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info(v_next, FLOAT, None),
        ],
        body.inits,
    )
    trips, true = g.const(np.int64(2)), g.const(np.array(True))
    loop_out = g.node("Loop", [trips, true, if_out], body=loop_body)
    # Scan over a leading axis of length 1: the body sees [N, 4, H, W].
    scan = GraphBuilder(seed=5, first=500)
    s_out = conv_block(scan, "s", 4, 4, act="clip", pads=PADS)
    scan_body = helper.make_graph(
        scan.nodes,
        "scan",
        [helper.make_tensor_value_info("s", FLOAT, ["N", 4, 5, 5])],
        [helper.make_tensor_value_info(s_out, FLOAT, ["N", 4, 5, 5])],
        scan.inits,
    )
    stacked = g.node("Unsqueeze", [loop_out, g.const(np.array([0], np.int64))])
    scanned = g.node("Scan", [stacked], body=scan_body, num_scan_inputs=1)
    return g.model({"x": ["N", 4, 5, 5]}, [scanned, h])


# ---- refusals: one line on stderr, exit 2, the folder unchanged ------------------------------
def state(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden temporaries too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result, message: str, folder: Path, before: dict) -> None:
    code, _, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), repr(err)  # one line, no blank one
    assert err.startswith("fusion: error: ") and message in err, err
    assert state(folder) == before  # no output, no temporary file, the input unchanged


def data_names(folder: Path, model: str) -> list[str]:
    """The data files save_model wrote for `model` in `folder`: MODEL.<digest>.data."""
    return sorted(p.name for p in folder.glob(f"{model}.*.data"))


def small_model(**kw) -> onnx.ModelProto:
    return conv_stack(blocks=2, channels=4, size=6, **kw)


# Every command that reads a model file, and what it needs besides (a quick bench).
READING_A_MODEL = {
    "rewrite": ["-o", "out.onnx"],
    "match": [],
    "run": ["-o", "out.npz"],
    "verify": [],
    "tune": [],
    "bench": ["--same-process", "--threads", "1", "--rounds", "1", "--budget", "0"]
    + ["--no-memory", "--no-compile", "--no-nodes"],
}


def typed_model(elem: int) -> onnx.ModelProto:
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    g = GraphBuilder()
    w = g.const((g.rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(dtype))
    b = g.const(np.full(4, 0.1, dtype))
    y = g.node("Relu", [g.node("Conv", ["x", w, b], pads=[1, 1, 1, 1], name="/conv")])
    return g.model({"x": ["N", 2, 5, 5]}, [y], elem=elem)


# ---- the whole-plan race on a scripted clock ---------------------------------------------------
class Clock:
    """A clock that moves only when told (scripted run times)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeMachine:
    """A machine whose other processes use `load` cores (None: unknown); no threads to wait on.
    `idles` counts the waits (the race waits after each candidate's warm-up and each turn)."""

    def __init__(self, load: float | None = 0.0):
        self.load = load
        self.idles = 0

    def start(self):
        pass

    def stop(self):
        return self.load

    def elapsed(self):  # a watch judges after its WATCH_RUNS runs, however short
        return float("inf")

    def wait_idle(self):
        self.idles += 1


def scripted_race(monkeypatch, seconds: dict, load: float | None = 0.0) -> list[str]:
    """Make every Session's whole-plan race run each candidate for real (it must work) but
    time it on a scripted clock: candidate `name` takes seconds[name] per call, on a machine
    whose other processes use `load` cores. Returns the list of races' candidates, appended
    as they run (a test can count races)."""
    from fusion.runtime import race as race_module

    raced = []

    def fake_race(calls, **kw):
        clock = Clock()

        def timed(name, call):
            def run():
                call()
                clock.now += seconds[name]

            return run

        raced.append(list(calls))
        scripted = {name: timed(name, call) for name, call in calls.items()}
        return race_module.race(scripted, clock=clock, machine=FakeMachine(load), **kw)

    monkeypatch.setattr("fusion.runtime.choice.race", fake_race)
    # the watch of a cached plan measures the machine too: the same machine
    monkeypatch.setattr("fusion.runtime.choice.Machine", lambda: FakeMachine(load))
    return raced


def in_threads(work, n: int = 4) -> None:
    """work(i) for i < n, each in a thread of its own, all at once; the first exception any
    raised is raised here."""
    import threading

    errors = []

    def run(i):
        try:
            work(i)
        except Exception as exc:  # re-raised by the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
