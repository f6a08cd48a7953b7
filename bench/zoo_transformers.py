"""Transformer models for the bench: Hugging Face BERT, DistilBERT, GPT-2 and Llama built from
configs (random weights, nothing downloaded; HF_HUB_OFFLINE=1), exported with
torch.onnx.export (TorchScript, opset 17) at a fixed sequence length with a dynamic batch
axis, and each also through onnxruntime's transformers optimizer (the second reference):

    HF_HUB_OFFLINE=1 /work/venvs/zoo/bin/python bench/zoo_transformers.py [--only NAMES] [--seq 128]
        [--attention sdpa|eager] [--exporter ts17|dynamo18]
    python bench/models.py ZOO/bert_base_layer.s128.onnx --batch 1 --native .ortopt.onnx

Models (inputs input_ids, attention_mask [batch, seq]; output last_hidden_state):
  bert_base_layer   one BERT-base layer: hidden 768, 12 heads, intermediate 3072
  bert_small        4 layers, hidden 256, 4 heads (the issue's BERT encoder)
  distilbert_small  4 layers, hidden 256, 4 heads
  gpt2_small        4 layers, hidden 256, 4 heads
  llama_small       4 layers, hidden 256, 8 heads, 2 key/value heads
The attention is transformers' default, sdpa, unless --attention eager (those files are named
NAME_eager.sSEQ...); the exporter TorchScript at opset 17 unless --exporter dynamo18 (.dynamo18
before .onnx).
Files go to $FUSION_ZOO or ~/.cache/fusion/zoo as NAME.sSEQ.onnx and NAME.sSEQ.ortopt.onnx
(the latter by `python -m onnxruntime.transformers.optimizer --model_type bert|gpt2`, run by
--python, default this Python: the optimizer imports torch, so the zoo venv's, which has the
same onnxruntime; bench/models.py --native .ortopt.onnx times both).
The builder and exporter are tests/fixtures/export_transformers.py's (the tiny fixtures).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from zoo import zoo_dir  # bench/zoo.py, beside this script: the cache folder

from fusion.models.pytorch import ATTENTION, EXPORTERS, build, export

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
             vocab_size=1000, max_position_embeddings=512)  # fmt: skip
MODELS = {
    "bert_base_layer": ("bert", dict(SMALL, hidden_size=768, num_hidden_layers=1,
                                     num_attention_heads=12, intermediate_size=3072)),
    "bert_small": ("bert", SMALL),
    "distilbert_small": ("distilbert", dict(dim=256, n_layers=4, n_heads=4, hidden_dim=1024,
                                            vocab_size=1000, max_position_embeddings=512)),
    "gpt2_small": ("gpt2", dict(n_embd=256, n_layer=4, n_head=4, vocab_size=1000,
                                n_positions=512)),
    "llama_small": ("llama", dict(SMALL, num_attention_heads=8, num_key_value_heads=2)),
}  # fmt: skip
OPTIMIZER_TYPES = {"bert": "bert", "distilbert": "bert", "gpt2": "gpt2", "llama": "bert"}


def heads_and_hidden(family: str, config: dict) -> tuple[int, int]:
    if family == "distilbert":
        return config["n_heads"], config["dim"]
    if family == "gpt2":
        return config["n_head"], config["n_embd"]
    return config["num_attention_heads"], config["hidden_size"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated names of " + ", ".join(MODELS))
    ap.add_argument("--seq", type=int, nargs="+", default=[128])
    ap.add_argument("--out", help="folder (default $FUSION_ZOO or ~/.cache/fusion/zoo)")
    ap.add_argument("--python", default=sys.executable,
                    help="a Python with onnxruntime for its transformers optimizer")  # fmt: skip
    ap.add_argument("--attention", choices=ATTENTION, default="sdpa")
    ap.add_argument("--exporter", choices=list(EXPORTERS), default="ts17")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(MODELS)
    folder = zoo_dir(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        family, config = MODELS[name]
        for seq in args.seq:
            form = "" if args.attention == "sdpa" else f"_{args.attention}"
            tail = "" if args.exporter == "ts17" else f".{args.exporter}"
            path = folder / f"{name}{form}.s{seq}{tail}.onnx"
            model = build(family, args.attention, **config)
            export(model, path, args.exporter, batch=2, seq=seq, dynamic_sequence=False)
            heads, hidden = heads_and_hidden(family, config)
            opt = path.with_suffix(".ortopt.onnx")
            cmd = [args.python, "-m", "onnxruntime.transformers.optimizer", "--input", str(path),
                   "--output", str(opt), "--model_type", OPTIMIZER_TYPES[family],
                   "--num_heads", str(heads), "--hidden_size", str(hidden)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            failed += done.returncode != 0
            fused = [ln for ln in done.stderr.splitlines() if "fused" in ln.lower()]
            print(path.name, path.stat().st_size, "bytes; optimizer:", done.returncode,
                  "; ".join(fused[-6:]) or done.stderr.strip()[-300:])  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
