"""Where the blocked layout meets the rest: conversions between steps.

A kernel step whose tactic takes an input blocked (fusion.catalog.Tactic) reads it under the
name `blocked_name(value, block)`; one that produces an output blocked writes it there. Walking
the steps in run order, every read of a form not yet made inserts one conversion (NCHW to
blocked, blocked to NCHW) just before the reader, once per value and form; graph outputs are
converted back to NCHW after the last step. Values that stay between blocked tactics are never
converted, so a region of blocked kernels pays for its layout only at its borders: graph
inputs and outputs and onnxruntime islands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusion.errors import FusionError, one_line

NCHW = "nchw"


def out_block() -> int:
    """The block every blocked kernel writes: this process's (kernels.blocked.block(), the SIMD
    width), asked when a run is planned; a rewritten model does not fix it."""
    from fusion_kernels.blocked import block  # heavy: Numba

    return block()


def blocked_name(value: str, block: int) -> str:
    """The run dict's name of `value` held blocked with `block` channels per block."""
    return f"{value}\x00b{block}"


class ConvertStep:
    """One layout conversion of one value: NCHW -> blocked (block channels per block) or
    blocked -> NCHW (channels real channels)."""

    kind = "convert"

    def __init__(self, source: str, target: str, to_blocked: bool, size: int):
        from fusion_kernels.blocked import from_blocked  # heavy: Numba
        from fusion_kernels.blocked import to_blocked as to_b

        plain = source.split("\x00")[0]
        self.name = f"{'to' if to_blocked else 'from'} blocked {plain}"
        self.inputs, self.outputs = [source], [target]
        self.size = size
        self._convert = (
            (lambda x: to_b(x, block=size)) if to_blocked else (lambda x: from_blocked(x, size))
        )

    def __call__(self, values: dict, keep_all: bool = True) -> None:
        try:
            values[self.outputs[0]] = self._convert(values[self.inputs[0]])
        except ValueError as exc:  # a model declaring a shape its kernels cannot take
            raise FusionError(f"{self.name}: {one_line(exc)}") from None


@dataclass
class Layouts:
    """Which forms of each value exist so far in run order, and what blocked values hold."""

    forms: dict = field(default_factory=dict)  # plain value -> set of NCHW / block sizes
    channels: dict = field(default_factory=dict)  # plain value -> channels (blocked ones)
    blocked: dict = field(default_factory=dict)  # blocked name -> (plain value, channels)

    def has(self, value: str, form) -> bool:
        return form in self.forms.get(value, {NCHW})

    def made(self, value: str, form, channels: int | None = None) -> str:
        self.forms.setdefault(value, set()).add(form)
        if form == NCHW:
            return value
        if channels is not None:
            self.channels[value] = channels
        name = blocked_name(value, form)
        self.blocked[name] = (value, self.channels.get(value))
        return name


def convert(layouts: Layouts, value: str, form) -> list[ConvertStep]:
    """The conversions that make `value` available in `form` (none when it is). A value no
    step has made yet is a feed or a constant: it exists in NCHW."""
    layouts.forms.setdefault(value, {NCHW})
    if layouts.has(value, form):
        return []
    steps = []
    if form == NCHW or not layouts.has(value, NCHW):
        held = next(f for f in layouts.forms[value] if f != NCHW)  # a blocked form exists
        channels = layouts.channels[value]
        steps.append(ConvertStep(blocked_name(value, held), value, False, channels))
        layouts.made(value, NCHW)
    if form != NCHW:
        steps.append(ConvertStep(value, blocked_name(value, form), True, form))
        layouts.made(value, form)
    return steps
