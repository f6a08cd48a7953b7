"""The built-in catalog: one module per family, each defining its rules with the public API."""

from patterns import conv, conv_concat, fire, lstm, lstm_native, lstm_sequence, pool

RULES = [
    conv.RULE, fire.RULE, lstm.RULE, lstm_sequence.RULE, lstm_native.RULE, conv_concat.RULE,
    pool.RULE, pool.GAP_FLATTEN,
]  # fmt: skip
