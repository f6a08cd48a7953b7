"""Numba CPU kernels for fused ONNX ops. This package knows nothing about ONNX graphs.

The folder kernels/ installs as the package `fusion_kernels`: a top-level `kernels` is Hugging
Face's (a dependency of transformers 5), and two packages of one name in one environment
overwrite each other's files.

One family per module, each with its validating wrapper(s), all exported here by name. The
exports load on first use: a family module compiles (or loads from the cache) Numba code,
which a graph rewrite, that only needs the numba-free `fusion_kernels.windows`, must not pay
for. A wrapper named like its module (fire, conv_concat, conv_nchwc, attention, dense_gemm,
pointwise, linear_act) is reached through the module, `fusion_kernels.fire.fire`: exporting
it by name would shadow the module (`import fusion_kernels.fire as m` would then give the
function).

    from fusion_kernels import conv2d_bias_act, prepare_conv2d, set_threads
"""

import importlib

_EXPORTS = {
    "conv2d": ("Conv2DPlan", "conv2d_bias_act", "output_shape", "prepare_conv2d"),
    "fire": ("FirePlan", "prepare_fire"),
    "conv_nchwc": ("ConvPlan", "prepare_conv_nchwc", "tile_options"),
    "blocked": ("block", "block_size", "blocked_shape", "from_blocked", "to_blocked"),
    "pool": (
        "MaxPoolPlan",
        "global_average_pool",
        "global_average_pool_blocked",
        "maxpool2d",
        "maxpool_blocked",
        "prepare_maxpool",
    ),  # fmt: skip
    "pointwise": ("PointwisePlan", "pointwise_blocked", "prepare_pointwise"),
    "squeeze_excite": ("SqueezeExcitePlan", "prepare_squeeze_excite", "squeeze_excite_blocked"),
    "dense_gemm": ("DensePlan", "prepare_dense"),
    "linear_act": ("GatedMLPPlan", "gated_mlp", "prepare_gated_mlp"),
    "attention": ("attention_core",),
    "concat": ("concat_channels",),
    "shuffle": ("channel_gather", "channel_gather_blocked", "shuffle_map"),
    "layernorm": ("layer_norm",),
    "lstm": ("LSTMPlan", "lstm_cell", "lstm_sequence", "prepare_lstm"),
    "gru": ("gru_sequence", "prepare_gru"),
    "config": ("apply_thread_settings", "get_threads", "set_threads"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
