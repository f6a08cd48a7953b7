"""Real CNNs for the bench: torchvision classifiers exported to ONNX with random weights.

Each model is built with weights=None (seeded, nothing downloaded; BatchNorm statistics and
biases randomised too, see build), put in eval mode and exported with torch.onnx.export twice,
the two ways PyTorch users do it:
  ts17      TorchScript exporter (dynamo=False), opset 17
  dynamo18  torch.export-based exporter (dynamo=True), opset 18
with a dynamic batch axis (one file serves batch 1 and 8), input [N, 3, 224, 224] named "input",
output "logits". Every file is checked: onnx.checker (full check), loaded in onnxruntime, and its
outputs at batch 1 and 8 compared with torch's on a seeded random input (max abs error, and that
error over max |torch output|, which must stay under 1e-4). A failing export or check is
reported with its first error line and the exit status is 1; nothing is hidden or retried.

Files go to a cache folder that is never committed and that no test needs: --out, else
$FUSION_ZOO, else ~/.cache/fusion/zoo; names like resnet18.ts17.onnx, resnet18.dynamo18.onnx.
Existing files are kept (but still checked) unless --force. zoo.json in that folder records the
last results per file.

torch is not a dependency of the project. Export from a separate virtual environment (torch is
large; keep the project's .venv as CI installs it). On x86_64 Linux with Python 3.11:

    python3 -m venv ~/venvs/zoo
    ~/venvs/zoo/bin/pip install torch==2.14.1 torchvision==0.29.1 onnxscript -e .
    ~/venvs/zoo/bin/python bench/zoo.py [--only resnet18,googlenet] [--exporters ts17,dynamo18]
                                        [--out DIR] [--force] [--threads 2] [--json FILE]

(the same as `pip install -e ".[zoo]"`: the project itself provides the onnxruntime session).
Pin torch and torchvision as above: a plain `pip install torch` may pull a multi-GB CUDA build
from the network (see env's machine notes; this machine has the pinned wheels on disk).
onnxscript is what the dynamo exporter translates with.

BENCH is the real-model bench set (issue 15), COVERAGE more CNNs for pattern coverage
(squeeze-excite, hard-swish, grouped convs). `--only bench` / `--only coverage` name the sets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from fusion.models.pytorch import EXPORTERS, torch_export
from fusion.numerics import compare_arrays
from fusion.ort import DEFAULT, inference_session

# torchvision constructor -> keyword arguments beyond weights=None. GoogLeNet: no auxiliary
# classifiers (they only run in training), and its own initialisation asked for explicitly
# (torchvision warns otherwise).
BENCH = {
    "resnet18": {},
    "resnet50": {},
    "mobilenet_v2": {},
    "googlenet": {"aux_logits": False, "init_weights": True},
    "shufflenet_v2_x1_0": {},
    "densenet121": {},
    "squeezenet1_1": {},
}
COVERAGE = {
    "efficientnet_b0": {},
    "mobilenet_v3_small": {},
    "mobilenet_v3_large": {},
    "regnet_y_400mf": {},
    "regnet_x_400mf": {},
    "resnext50_32x4d": {},
}
MODELS = {**BENCH, **COVERAGE}
INPUT_SHAPE = (3, 224, 224)
BATCHES = (1, 8)  # checked against torch; the export itself traces batch 2 (see export)
SEED = 0
RTOL = 1e-4  # max |onnxruntime - torch| / max |torch| allowed; float32 exports reach ~1e-6


def zoo_dir(out: str | os.PathLike | None = None) -> Path:
    """The cache folder: `out`, else $FUSION_ZOO, else ~/.cache/fusion/zoo."""
    return Path(out or os.environ.get("FUSION_ZOO") or Path.home() / ".cache" / "fusion" / "zoo")


def model_path(folder: Path, name: str, exporter: str) -> Path:
    return folder / f"{name}.{exporter}.onnx"


@dataclass
class Result:
    model: str
    exporter: str
    file: str
    status: str = "ok"  # ok | failed
    stage: str = ""  # where it failed: build, export, checker, onnxruntime, compare
    error: str = ""  # the first line of the error
    exported: bool = False  # False: the file was already there
    export_s: float | None = None
    nodes: int | None = None
    convs: int | None = None
    opset: int | None = None
    ops: dict[str, int] = field(default_factory=dict)
    max_abs: dict[str, float] = field(default_factory=dict)  # "b1", "b8" -> max |ort - torch|
    max_rel: dict[str, float] = field(default_factory=dict)  # that over max |torch|

    def fail(self, stage: str, exc: BaseException) -> Result:
        lines = str(exc).strip().splitlines()
        self.status, self.stage = "failed", stage
        self.error = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
        return self


def build(name: str):
    """torchvision's `name` with seeded random weights, in eval mode."""
    import torch  # heavy, and only the export venv has it
    import torchvision

    torch.manual_seed(SEED)
    model = getattr(torchvision.models, name)(weights=None, **MODELS[name])
    # Fresh BatchNorm is the identity (mean 0, var 1, scale 1, shift 0) and fresh conv biases
    # are zero; folded or not, a zero bias is dropped by the dynamo exporter's optimizer, so the
    # graph would not look like a trained model's. Seeded random statistics and biases instead.
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
                shape = layer.running_mean.shape
                layer.running_mean.normal_(0.0, 0.1, generator=generator)
                layer.running_var.copy_(torch.rand(shape, generator=generator) + 0.5)
                if layer.affine:
                    layer.weight.copy_(torch.rand(shape, generator=generator) + 0.5)
                    layer.bias.normal_(0.0, 0.1, generator=generator)
            elif isinstance(layer, torch.nn.Conv2d | torch.nn.Linear) and layer.bias is not None:
                layer.bias.normal_(0.0, 0.1, generator=generator)
    return model.eval()


def example(batch: int):
    import torch

    generator = torch.Generator().manual_seed(SEED + batch)
    return torch.randn((batch, *INPUT_SHAPE), generator=generator)


def export(model, path: Path, exporter: str) -> None:
    """Write `model` to `path` (replaced whole when complete), the batch axis dynamic."""
    import torch

    dynamo = EXPORTERS[exporter][0]
    # Traced at batch 2: torch.export specialises a dimension it sees as 1.
    args = (example(2),)
    names = {"input_names": ["input"], "output_names": ["logits"]}
    if dynamo:
        axes = {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=1024)},)}
    else:
        axes = {"dynamic_axes": {"input": {0: "batch"}, "logits": {0: "batch"}}}
    torch_export(model, args, path, exporter, **names, **axes)


def check(result: Result, model, path: Path, threads: int) -> None:
    """onnx.checker, an onnxruntime session, and outputs against torch at each batch size."""
    import torch

    stage = "checker"
    try:
        onnx.checker.check_model(str(path), full_check=True)
        proto = onnx.load(str(path))
        ops = Counter(n.op_type for n in proto.graph.node)
        result.nodes, result.convs, result.ops = len(proto.graph.node), ops["Conv"], dict(ops)
        result.opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
        stage = "onnxruntime"
        session = inference_session(path, DEFAULT, threads=threads)
        for batch in BATCHES:
            stage = "onnxruntime"
            x = example(batch)
            (got,) = session.run(None, {"input": x.numpy()})
            stage = "compare"
            with torch.no_grad():
                want = model(x).numpy()
            scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
            same = compare_arrays("logits", got, want, 0.0, RTOL * scale, check_dtype=False)
            if same.max_abs == np.inf:
                raise ValueError(f"{same.note or 'NaN in the output'} (torch's is the reference)")
            err, rel = same.max_abs, same.max_abs / scale
            result.max_abs[f"b{batch}"], result.max_rel[f"b{batch}"] = err, rel
            if not same.ok:
                raise ValueError(f"batch {batch}: max abs error {err:.3g} is {rel:.2g} of max "
                                 f"|torch output|, above {RTOL:g} (a file from other weights? "
                                 "--force exports it again)")  # fmt: skip
    except Exception as exc:
        result.fail(stage, exc)


def run_one(name: str, exporter: str, folder: Path, force: bool, threads: int) -> Result:
    path = model_path(folder, name, exporter)
    result = Result(name, exporter, str(path))
    try:
        model = build(name)
    except Exception as exc:
        return result.fail("build", exc)
    if force or not path.exists():
        start = time.perf_counter()
        try:
            export(model, path, exporter)
        except Exception as exc:
            return result.fail("export", exc)
        result.exported, result.export_s = True, time.perf_counter() - start
    check(result, model, path, threads)
    return result


def table(results: list[Result]) -> str:
    head = ["model", "exporter", "status", "nodes", "Conv", "max abs err b1 / b8", "rel b1 / b8",
            "export s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        status = "ok" if r.status == "ok" else f"failed ({r.stage}): {r.error[:160]}"
        row = [r.model, r.exporter, status, r.nodes, r.convs,
               " / ".join(f"{r.max_abs[k]:.2e}" for k in r.max_abs),
               " / ".join(f"{r.max_rel[k]:.1e}" for k in r.max_rel),
               "cached" if r.export_s is None else f"{r.export_s:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join("-" if v in (None, "") else str(v) for v in row) + " |")
    return "\n".join(lines)


def pick(text: str | None, known: dict, sets: dict | None = None) -> list[str]:
    """Comma-separated names (or set names) -> the list, refusing unknown names."""
    if not text:
        return list(known)
    picked = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if sets and name in sets:
            picked += [n for n in sets[name] if n not in picked]
        elif name in known:
            picked += [name] * (name not in picked)
        else:
            raise ValueError(f"unknown name {name!r}; known: {', '.join([*(sets or {}), *known])}")
    return picked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model names, or 'bench' / 'coverage'")
    ap.add_argument("--exporters", help=f"comma-separated, of {', '.join(EXPORTERS)}")
    ap.add_argument("--out", help="cache folder (default $FUSION_ZOO or ~/.cache/fusion/zoo)")
    ap.add_argument("--force", action="store_true", help="export again over existing files")
    ap.add_argument("--threads", type=int, default=2, help="torch and onnxruntime threads")
    ap.add_argument("--json", help="also write this run's results here")
    args = ap.parse_args(argv)
    try:
        names = pick(args.only, MODELS, {"bench": BENCH, "coverage": COVERAGE})
        exporters = pick(args.exporters, EXPORTERS)
    except ValueError as exc:
        ap.error(str(exc))  # exit status 2
    folder = zoo_dir(args.out)
    folder.mkdir(parents=True, exist_ok=True)

    import torch
    import torchvision

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, onnx "
          f"{onnx.__version__}, onnxruntime {ort.__version__} -> {folder}", flush=True)  # fmt: skip
    results = []
    for name in names:
        for exporter in exporters:
            r = run_one(name, exporter, folder, args.force, args.threads)
            results.append(r)
            print(f"{name}.{exporter}: {r.status} {r.error}".rstrip(), flush=True)
    print(table(results))

    index = folder / "zoo.json"  # the last results per file, for later readers of the folder
    known = json.loads(index.read_text()) if index.exists() else {}
    known.update({Path(r.file).name: asdict(r) for r in results})
    index.write_text(json.dumps(known, indent=1, sort_keys=True))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if any(r.status != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
