"""The built-in catalog: one module per family, each defining its rules with the public API."""

from patterns import conv, fire

RULES = [conv.RULE, fire.RULE]
