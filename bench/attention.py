"""The attention block alone: fusion's Attention kernel against onnxruntime running the same
unfused subgraph, cut from an exported transformer:

    python bench/attention.py ~/.cache/fusion/zoo/bert_base_layer.s512.onnx [--layer 0]
                              [--seq N (a model with a symbolic sequence axis)] [--json FILE]

The subgraph is the nodes the --layer-th fused Attention node replaces, as the exporter wrote
them (Q, K, V linears, head reshapes and transposes, scaled QK^T, the additive mask, Softmax,
times V, heads merged, output linear, residual Add), cut out of the model file with
onnx.utils.Extractor at that node's computed inputs (the hidden states, the mask, the
residual) and output. Its inputs are the values the whole model computes there on seeded
random input_ids and attention_mask (batch 1: the mask pads nothing). The cut goes through
fusion.bench.measure (bench/models.py's harness: each runner in its own process, onnxruntime
at its defaults, round robin); the kernel's own time, without the Session around it, is in
the "fused nodes alone" lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from onnx.utils import Extractor

from fusion import bench, rewrite
from fusion.bench import FUSED, ORT_ALL, PROCESSES, SAME_PROCESS, Options, Workload
from fusion.modelfile import read_model
from fusion.ort import REFERENCE, inference_session
from fusion_patterns.attention import RULE as ATTENTION


def attention_cut(model: onnx.ModelProto, layer: int, seq: int, seed: int):
    """(the subgraph the layer-th Attention node replaces, the values of its inputs)."""
    fused = rewrite(model).model
    nodes = [n for n in fused.graph.node if n.op_type == "Attention"]
    if len(nodes) <= layer:
        raise SystemExit(f"the model has {len(nodes)} fused Attention nodes, no layer {layer}")
    named = dict(zip(ATTENTION.inputs, nodes[layer].input, strict=False))
    # The shape inputs are left out: the extractor takes along the shape arithmetic that
    # computes them from the hidden states.
    inputs = list(dict.fromkeys(v for k in ("x", "mask", "residual") if (v := named.get(k))))
    output = nodes[layer].output[0]
    values = model_values(model, [*inputs, output], seq, seed)
    typed = onnx.ModelProto()
    typed.CopyFrom(model)  # the cut's borders need types, which shape inference may not reach
    typed.graph.value_info.extend(
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for name, v in values.items()
    )
    cut = Extractor(typed).extract_model(inputs, [output])
    # The extractor keeps no types inside the cut; the runtime's islands need them.
    return onnx.shape_inference.infer_shapes(cut), {name: values[name] for name in inputs}


def model_values(model: onnx.ModelProto, names: list[str], seq: int, seed: int) -> dict:
    """The values `names` take in the whole model (onnxruntime, no optimizations) at batch 1."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        if vi.name == "attention_mask":
            feeds[vi.name] = np.ones((1, seq), np.int64)
        else:
            feeds[vi.name] = rng.integers(0, 4, (1, seq)).astype(np.int64)  # as fusion.feeds
    session = inference_session(probe, REFERENCE, 1)
    return dict(zip(names, session.run(names, feeds), strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="exported transformers (bench/zoo_transformers.py)")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=5.0, help="seconds of timing per workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=128, help="where the model's sequence is symbolic")
    ap.add_argument("--node-rounds", type=int, default=3, help="rounds of the kernel alone")
    ap.add_argument("--same-process", action="store_true", help="quick mode, one process")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    # The Session would time the node's kernel against its body on random float32 inputs,
    # which the shape inputs are not (int64, computed from the hidden states): run the kernel,
    # as in the whole model, where those shapes are unknown until a run.
    os.environ.setdefault("FUSION_TACTICS", "kernel")
    info = bench.machine()
    for line in bench.machine_lines(info):
        print(line)
    opts = Options(threads=args.threads or 2, rounds=args.rounds, min_rounds=min(5, args.rounds),
                   budget=args.budget, repeat=args.repeat, runners=(ORT_ALL, FUSED),
                   mode=SAME_PROCESS if args.same_process else PROCESSES,
                   node_rounds=args.node_rounds, memory=False, compile=False,
                   sgemm=False)  # fmt: skip
    results = []
    for path in args.models:
        model = read_model(path)[0]
        seq = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value or args.seq
        cut, feeds = attention_cut(model, args.layer, seq, args.seed)
        name = f"{Path(path).name.removesuffix('.onnx')} attention {args.layer}"
        results.append(bench.measure(Workload(name, cut, feeds, batch=1), opts))
        r = results[-1]
        print(f"{r.workload}: fusion vs ort-all {r.speedup(ORT_ALL) or 0:.2f}x", flush=True)
    head, body = bench.summary_rows(results)
    print(" | ".join(head))
    for row in body:
        print(" | ".join(row))
    for line in bench.notes(results):
        print(line)
    if args.json:
        bench.write_json(results, args.json, info, command=info["command"])
    return 1 if any(r.refused for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
