"""Models as PyTorch's exporters write them: `torch_export` (any module, by the TorchScript
exporter at opset 17 or the dynamo exporter at opset 18, the file replaced whole), and Hugging
Face transformers (BERT, DistilBERT, GPT-2, Llama) built from a config with random weights
(seed 0), nothing downloaded. Used by bench/zoo.py (torchvision CNNs),
tests/fixtures/export_transformers.py (the committed tiny fixtures) and
bench/zoo_transformers.py (benchmark sizes).

torch and transformers are not dependencies of the project (the `zoo` extra installs them):
they are imported when a model is built, never by `import fusion.models`.

    export(build("bert", hidden_size=32, ...), Path("bert.onnx"), "ts17", batch=2, seq=16)
"""

from __future__ import annotations

import os
from pathlib import Path

from fusion.files import atomic_temp

SEED = 0
EXPORTERS = {"ts17": (False, 17), "dynamo18": (True, 18)}  # name -> (dynamo, opset)


def torch_export(module, args: tuple, path: Path, exporter: str, **kwargs) -> None:
    """torch.onnx.export(module, args) by `exporter` (a key of EXPORTERS) into `path`, weights
    inside the file; kwargs: input/output names, dynamic axes or shapes."""
    import torch

    dynamo, opset = EXPORTERS[exporter]
    with atomic_temp(Path(path)) as tmp:
        torch.onnx.export(module, args, tmp, dynamo=dynamo, opset_version=opset,
                          external_data=False, **kwargs)  # fmt: skip


ATTENTION = ("eager", "sdpa")  # transformers' attention implementations the exports cover


def build(name: str, attention: str = "eager", **config):
    """The Hugging Face base model `name` from a config, seeded, eval mode, with `attention`
    one of ATTENTION: "eager" (the attention written out as products and a Softmax) or "sdpa"
    (torch's scaled_dot_product_attention, transformers' default, which the exporters expand
    into Q and K scaled apart, a boolean mask turned additive by Where and a NaN guard after
    the Softmax). Sets HF_HUB_OFFLINE=1 unless set: configs only, the hub is never contacted."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as tf

    classes = {
        "bert": (tf.BertConfig, tf.BertModel),
        "distilbert": (tf.DistilBertConfig, tf.DistilBertModel),
        "gpt2": (tf.GPT2Config, tf.GPT2Model),
        "llama": (tf.LlamaConfig, tf.LlamaModel),
    }
    config_class, model_class = classes[name]
    torch.manual_seed(SEED)
    cfg = config_class(**config)
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    cfg._attn_implementation = attention
    if name in ("gpt2", "llama"):
        cfg.use_cache = False  # no past key/values as outputs
    model = model_class(cfg).eval()
    with torch.no_grad():  # fresh LayerNorm/RMSNorm weights are 1 and biases 0: randomise
        for param_name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "weight" in param_name else 0.0, 0.1)
    return model


def last_hidden(model):
    """`model` as a module whose forward(input_ids, attention_mask) returns last_hidden_state
    alone (a torch.nn.Module is made here: torch is imported only when used)."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]

    return LastHidden().eval()


def example(batch: int, seq: int, vocab: int, padded: bool = True):
    """Token ids and an attention mask whose last row has its last quarter padded."""
    import torch

    generator = torch.Generator().manual_seed(SEED + batch * 1000 + seq)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    mask = torch.ones((batch, seq), dtype=torch.int64)
    if padded:
        mask[-1, seq - seq // 4 :] = 0
    return ids, mask


def export(model, path: Path, exporter: str, batch: int = 2, seq: int = 16,
           dynamic_sequence: bool = True) -> None:  # fmt: skip
    """Export at [batch, seq]; the batch axis dynamic, the sequence axis too if asked."""
    import torch

    dynamo = EXPORTERS[exporter][0]
    wrapped = last_hidden(model)
    args = example(batch, seq, model.config.vocab_size)
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])
    if dynamo:
        b, s = torch.export.Dim("batch", max=64), torch.export.Dim("sequence", max=512)
        dims = {0: b, 1: s} if dynamic_sequence else {0: b}
        axes = dict(dynamic_shapes=(dims, dims))
    else:
        dims = {0: "batch", 1: "sequence"} if dynamic_sequence else {0: "batch"}
        axes = dict(dynamic_axes={"input_ids": dims, "attention_mask": dims,
                                  "last_hidden_state": dims})  # fmt: skip
    torch_export(wrapped, args, path, exporter, **names, **axes)
