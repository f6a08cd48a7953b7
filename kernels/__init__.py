"""Numba CPU kernels for fused ONNX ops. This package knows nothing about ONNX graphs.

One family per module, each with its validating wrapper(s); every family's wrapper is exported
here. The exports load on first use: a family module compiles (or loads from the cache) Numba
code, which a graph rewrite, that only needs the numba-free `kernels.windows`, must not pay for.

    from kernels import conv2d_bias_act, prepare_conv2d, set_threads
"""

import importlib

_EXPORTS = {
    "conv2d": ("Conv2DPlan", "conv2d_bias_act", "output_shape", "prepare_conv2d"),
    "fire": ("FirePlan", "fire", "prepare_fire"),
    "conv_concat": ("conv_concat",),
    "pool": ("MaxPoolPlan", "global_average_pool", "maxpool2d", "prepare_maxpool"),
    "lstm": ("LSTMPlan", "lstm_cell", "lstm_sequence", "prepare_lstm"),
    "config": ("apply_thread_settings", "get_threads", "set_threads"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
