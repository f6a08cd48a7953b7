"""The built-in catalog: one module per family, each defining its rules with the public API."""

from fusion_patterns import (
    attention,
    concat,
    conv,
    conv_concat,
    dense,
    fire,
    gated_mlp,
    gru,
    gru_native,
    gru_sequence,
    inverted_residual,
    layernorm,
    linear_gelu,
    lstm,
    lstm_native,
    lstm_sequence,
    norm,
    pool,
    preact_conv,
    shuffle,
    squeeze_excite,
)  # fmt: skip

RULES = [
    inverted_residual.RULE, inverted_residual.EXPAND_DEPTHWISE, preact_conv.RULE, conv.RULE,
    fire.RULE, lstm.RULE, lstm_sequence.RULE, lstm_native.RULE, gru.RULE,
    gru_sequence.RULE, gru_native.RULE, conv_concat.RULE, pool.RULE, pool.GAP_FLATTEN,
    pool.AVG_POOL, pool.SPATIAL_MEAN, squeeze_excite.GATED_CONV, squeeze_excite.RULE,
    norm.RULE, concat.RULE, dense.RULE, attention.RULE, gated_mlp.RULE, shuffle.RULE,
    *linear_gelu.RULES, *layernorm.RULES,
]  # fmt: skip
