"""Example and benchmark models, built op by op the way exporters write them (no download):
used by `fusion demo`, the tests and the benchmarks.

  conv_stack   blocks of 3x3 Conv + bias + Relu (TensorFlow or PyTorch form)
  lstm         LSTM cells unrolled as PyTorch exports nn.LSTMCell in a loop; the native twin
  gru          GRU cells unrolled as PyTorch / tf2onnx write them; the native twin
  squeezenet   SqueezeNet 1.0 and 1.1 as torch.onnx.export writes torchvision's models
  pytorch      real exports by PyTorch's exporters (torch, transformers: the `zoo` extra; not
               imported here)
"""

from fusion.models.conv_stack import conv_stack, conv_stack_flops
from fusion.models.gru import GRUWeights, native_gru, unrolled_gru
from fusion.models.lstm import LSTMWeights, cell_model, native_lstm, unrolled_lstm
from fusion.models.squeezenet import fire_modules, squeezenet, squeezenet_flops

__all__ = [
    "GRUWeights",
    "LSTMWeights",
    "cell_model",
    "conv_stack",
    "conv_stack_flops",
    "fire_modules",
    "native_gru",
    "native_lstm",
    "squeezenet",
    "squeezenet_flops",
    "unrolled_gru",
    "unrolled_lstm",
]
