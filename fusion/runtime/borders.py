"""Per-node choices that count what they cost their neighbours: the layout conversions at the
borders of a blocked region.

Each fused node's tactics are timed alone (Chooser.time_tactics), on inputs already in the form
the tactic reads. In a plan, a node whose fastest tactic reads NCHW between two blocked ones
costs two conversions its timing never saw: ShuffleNet's MaxPool ran its NCHW tactic 10 us
faster than its blocked one, and the plan converted the stem's 24 x 112 x 112 output out of the
blocked layout and back for it, 143 + 43 us (bench/NOTES.md, "ShuffleNet without islands"). So the
per-node choices are revised as a whole:

    cost = sum over fused nodes of their tactic's time
         + sum over values of the conversions their readers need from the form they are made in

each conversion timed once per shape and block (cached with the tactics), and one node at a
time moves to the tactic that lowers the cost most, until none does. A node keeps its choice
unless another is cheaper by the conversions it saves, so this never undoes a per-node choice
that pays for itself. One node at a time can stall where two must move together (a stem conv
and the pool after it, both NCHW: either alone going blocked adds a conversion), so the walk
also starts from every node on its fastest blocked tactic, and the cheaper end is kept.
"""

from __future__ import annotations

from collections.abc import Callable

from fusion.catalog import Tactic
from fusion.graph import GraphView
from fusion.runtime.tactics import ONNXRUNTIME

NCHW = "nchw"
PASSES = 8  # over every node; each pass that moves a node lowers the cost, so few are needed

# (value's NCHW shape, block) -> (seconds NCHW -> blocked, seconds blocked -> NCHW)
ConvertTimes = Callable[[tuple, int], tuple[float, float]]


def reads_and_writes(node, tactic: Tactic | None, out_block: int) -> tuple[dict, dict]:
    """The forms (NCHW, or a block size) `tactic` reads each input in, a set (one value at two
    positions may be read in two: conv(x) + x with x plain and the residual blocked), and the
    form it writes each output in, by value name (None: the node's body, all NCHW)."""
    forms = {pos: NCHW for pos, v in enumerate(node.input) if v}
    writes = {v: NCHW for v in node.output if v}
    if tactic is not None:
        for pos, block in zip(tactic.blocked_inputs, tactic.in_blocks, strict=True):
            forms[pos] = block
        for pos in tactic.blocked_outputs:
            writes[node.output[pos]] = out_block
    reads: dict = {}
    for pos, form in forms.items():
        reads.setdefault(node.input[pos], set()).add(form)
    return reads, writes


def revise(view: GraphView, choices: dict, options: dict, times: dict, shapes: dict,
           out_block: int, convert_times: ConvertTimes) -> dict:  # fmt: skip
    """`choices` (fused node index -> Tactic, or None for its body) revised as the module
    says. options[i]: the tactics node i may take (None among them for the body); times[i]:
    their seconds by name (ONNXRUNTIME for the body); nodes without `times` keep their choice.
    shapes: value -> NCHW shape where known (a value of unknown shape costs nothing to
    convert: it cannot be timed)."""

    def node_time(i: int, tactic: Tactic | None) -> float:
        return times[i].get(ONNXRUNTIME if tactic is None else tactic.name, float("inf"))

    def blocked_start(i: int) -> Tactic | None:
        fast = [t for t in options[i] if t is not None and (t.blocked_inputs or t.blocked_outputs)
                and node_time(i, t) < float("inf")]  # fmt: skip
        return min(fast, key=lambda t: node_time(i, t)) if fast else choices[i]

    ends = []
    for start in (dict(choices), {i: blocked_start(i) if i in times else t
                                  for i, t in choices.items()}):  # fmt: skip
        walk = _Walk(view, start, out_block, shapes, convert_times)
        walk.descend(options, times, node_time)
        ends.append((walk.total(times, node_time), walk.choices))
    return min(ends, key=lambda end: end[0])[1]


class _Walk:
    """Choices, the forms they read and write, and the cost of the conversions between."""

    def __init__(self, view, choices, out_block, shapes, convert_times):
        self.view, self.choices, self.out_block = view, choices, out_block
        self.shapes, self.convert_times = shapes, convert_times
        self.forms = {i: reads_and_writes(view.nodes[i], t, out_block) for i, t in choices.items()}

    def made_in(self, value: str):
        producer = self.view.producer.get(value)
        if producer is None or producer[0] not in self.forms:
            return NCHW  # a feed, a constant, an island's output
        return self.forms[producer[0]][1].get(value, NCHW)

    def needed(self, value: str) -> set:
        wanted = {NCHW} if self.view.is_graph_output(value) else set()
        for j in self.view.consumers.get(value, ()):
            wanted |= self.forms[j][0].get(value, {NCHW}) if j in self.forms else {NCHW}
        return wanted

    def conversions(self, value: str) -> float:
        shape = self.shapes.get(value)
        if shape is None or len(shape) != 4 or self.view.constant(value) is not None:
            return 0.0
        made = self.made_in(value)
        wanted = self.needed(value) - {made}
        cost = self.convert_times(shape, made)[1] if wanted and made != NCHW else 0.0
        return cost + sum(self.convert_times(shape, form)[0] for form in wanted - {NCHW})

    def border_cost(self, i: int) -> float:
        node = self.view.nodes[i]
        return sum(self.conversions(v) for v in {*node.input, *node.output} if v)

    def total(self, times: dict, node_time) -> float:
        values = {v for i in self.forms for n in (self.view.nodes[i],) for v in
                  (*n.input, *n.output) if v}  # fmt: skip
        return sum(node_time(i, self.choices[i]) for i in times) + sum(
            self.conversions(v) for v in values
        )

    def descend(self, options: dict, times: dict, node_time) -> None:
        """One node at a time to its cheapest tactic, given the others', until none moves."""
        for _ in range(PASSES):
            moved = False
            for i in sorted(times):
                current = self.choices[i]
                best, best_cost = current, node_time(i, current) + self.border_cost(i)
                for tactic in options[i]:
                    if tactic is current or node_time(i, tactic) == float("inf"):
                        continue
                    self.forms[i] = reads_and_writes(self.view.nodes[i], tactic, self.out_block)
                    cost = node_time(i, tactic) + self.border_cost(i)
                    if cost < best_cost:
                        best, best_cost = tactic, cost
                self.choices[i] = best
                self.forms[i] = reads_and_writes(self.view.nodes[i], best, self.out_block)
                moved |= best is not current
            if not moved:
                break
