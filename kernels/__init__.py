"""Numba CPU kernels for fused ONNX ops. This package knows nothing about ONNX graphs."""

from .config import get_threads, set_threads
from .conv2d import Conv2DPlan, conv2d_bias_act, output_shape, prepare_conv2d

__all__ = [
    "Conv2DPlan",
    "conv2d_bias_act",
    "get_threads",
    "output_shape",
    "prepare_conv2d",
    "set_threads",
]
