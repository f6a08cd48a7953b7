"""The built-in catalog: one module per family, each defining its rules with the public API."""

from patterns import (
    attention,
    conv,
    conv_concat,
    fire,
    gru,
    gru_native,
    gru_sequence,
    layernorm,
    linear_gelu,
    lstm,
    lstm_native,
    lstm_sequence,
    pool,
)  # fmt: skip

RULES = [
    conv.RULE, fire.RULE, lstm.RULE, lstm_sequence.RULE, lstm_native.RULE, gru.RULE,
    gru_sequence.RULE, gru_native.RULE, conv_concat.RULE, pool.RULE, pool.GAP_FLATTEN,
    attention.RULE, *linear_gelu.RULES, *layernorm.RULES,
]  # fmt: skip
