"""The whole-plan race judged on scripted clocks: no test here reads a real timing.

Each candidate is a call that moves a fake clock by the seconds its script gives for that call,
so a race sees exactly the figures a test wants: a quiet machine, load that comes and goes, a
difference inside the noise, a candidate that fails.
"""

from __future__ import annotations

import pytest
from helpers import Clock, FakeMachine

from fusion.runtime.choice import describe_race, race_dict
from fusion.runtime.race import (
    BUSY_CORES,
    MIN_CALLS,
    MIN_MARGIN,
    agrees,
    balanced_orders,
    judge,
    race,
)


def scripted(clock: Clock, seconds, machine: FakeMachine | None = None):
    """A run call that takes seconds(turn) on `clock` in its candidate's turn-th turn (0: the
    warm-up and the call that sizes turns; 1, 2, ...: the race's rounds, untimed calls and
    timed ones alike); a number: always that. Turns are told apart by the machine's waits,
    one after every turn."""
    script = seconds if callable(seconds) else (lambda turn: seconds)
    state = {"turn": -1, "idles": None}

    def run():
        idles = machine.idles if machine is not None else 0
        if idles != state["idles"]:  # the first call since a wait: a new turn of this candidate
            state["turn"], state["idles"] = state["turn"] + 1, idles
        clock.now += script(state["turn"])

    return run


def run_race(times: dict, load: float | None = 0.0, **kw):
    clock, machine = Clock(), FakeMachine(load)
    candidates = {name: scripted(clock, t, machine) for name, t in times.items()}
    return race(candidates, clock=clock, machine=machine, **kw)


def test_the_clearly_fastest_wins_and_says_so():
    verdict = run_race({"onnxruntime": 0.010, "nchw": 0.009, "per-node": 0.006})
    assert verdict.chosen == "per-node" and verdict.decided and not verdict.busy
    assert verdict.seconds == pytest.approx({"onnxruntime": 0.010, "nchw": 0.009,
                                             "per-node": 0.006})  # fmt: skip
    assert verdict.noise == MIN_MARGIN  # no spread at all: the floor
    assert "runs each node's fastest, the fastest (" in describe_race(race_dict(verdict))


def test_a_difference_inside_the_noise_keeps_the_simplest():
    """1% apart is below the 3% floor: onnxruntime, listed first, is kept, and said so."""
    verdict = run_race({"onnxruntime": 0.0100, "per-node": 0.0099})
    assert verdict.chosen == "onnxruntime" and not verdict.decided
    assert "the simplest within the 3% noise of the fastest" in describe_race(race_dict(verdict))


def test_load_during_some_rounds_does_not_decide():
    """onnxruntime is slowed 9x in five of its six turns (another process on the core), the
    per-node plan is not: the one quiet round still shows onnxruntime faster, as the quiet
    machine would. A mean or a median over all rounds would choose per-node."""

    def disturbed(turn):  # turn 0 warms up and sizes turns (8 ms calls); round 3 is quiet
        return 0.008 if turn in (0, 4) else 0.072

    verdict = run_race({"onnxruntime": disturbed, "per-node": 0.0244}, rounds=6, load=None)
    assert verdict.chosen == "onnxruntime"
    assert verdict.busy  # where /proc cannot say, the deciding pair's spread says it


def test_other_processes_load_makes_the_race_provisional():
    assert run_race({"onnxruntime": 0.01, "per-node": 0.005}, load=BUSY_CORES + 0.5).busy
    assert not run_race({"onnxruntime": 0.01, "per-node": 0.005}, load=BUSY_CORES / 2).busy
    assert not run_race({"onnxruntime": 0.01, "per-node": 0.005}, load=None).busy  # unknown


def test_the_noise_measured_in_the_race_widens_the_margin():
    """per-node is 8% faster at best, but both candidates' rounds spread by 20%: not decided."""
    spread = [1.0, 1.2, 1.2, 1.2, 1.2]

    def noisy(base):
        def seconds(turn):
            return base * spread[turn % len(spread)]

        return seconds

    verdict = run_race({"onnxruntime": noisy(0.010), "per-node": noisy(0.0092)})
    assert verdict.noise > 0.08 and verdict.chosen == "onnxruntime" and not verdict.decided


def test_a_candidate_that_fails_is_never_chosen():
    clock = Clock()

    def broken():
        raise RuntimeError("kernel exploded")

    candidates = {"onnxruntime": scripted(clock, 0.01), "per-node": broken}
    verdict = race(candidates, clock=clock, machine=FakeMachine())
    assert verdict.chosen == "onnxruntime"
    assert verdict.failed == {"per-node": "RuntimeError: kernel exploded"}
    assert verdict.seconds["per-node"] == float("inf")
    with pytest.raises(RuntimeError, match="kernel exploded"):
        race({"per-node": broken}, clock=clock, machine=FakeMachine())


def test_turns_are_sized_to_the_call_and_orders_balanced():
    calls = {"a": 0, "b": 0}
    clock = Clock()

    def counting(name, seconds):
        def run():
            calls[name] += 1
            clock.now += seconds

        return run

    race({"a": counting("a", 2.0**-10), "b": counting("b", 0.5)}, rounds=4, clock=clock,
         machine=FakeMachine())  # fmt: skip
    # the warm-up and the sizing call, then per turn untimed calls until 20 ms have passed (21
    # of 0.98 ms) and 20 ms of timed ones (20); at least one untimed call and MIN_CALLS timed
    # ones (b)
    assert calls == {"a": 2 + 4 * (21 + 20), "b": 2 + 4 * (1 + MIN_CALLS)}
    for n in (2, 3, 4, 5):
        orders = balanced_orders(n)
        pairs = [(o[i], o[i + 1]) for o in orders for i in range(n - 1)]
        assert len({pairs.count(p) for p in set(pairs)}) == 1 and len(set(pairs)) == n * (n - 1)


def test_judge_and_agrees_on_plain_figures():
    assert judge({"a": [2.0, 2.0], "b": [1.0, 1.0]})[0] == "b"
    with pytest.raises(ValueError, match="no candidate ran"):
        judge({"a": [], "b": []})
    assert agrees(0.010, [0.0102, 0.0101, 0.0104], 0.03)
    assert not agrees(0.024, [0.016, 0.0162, 0.0159], 0.03)  # far faster than recorded
    assert not agrees(0.008, [0.012, 0.0125], 0.03)  # far slower
    assert agrees(0.01, [], 0.03)  # nothing seen yet


def jittery(base):
    """Rounds of base, 3 base, 5 base, ... in turn: a candidate whose spread is huge."""

    def seconds(turn):
        return base * (1 + 2 * (turn % 3))

    return seconds


def test_a_jittery_candidate_does_not_blur_a_clear_difference_between_two_others():
    """onnxruntime twice as fast as a jittery per-node plan: kept, decided; and a jittery NCHW
    plan between a steady onnxruntime and a steady per-node plan twice as fast changes nothing:
    each pair is weighed with its own noise."""
    verdict = run_race({"onnxruntime": 0.050, "per-node": jittery(0.103)})
    assert (verdict.chosen, verdict.decided, verdict.noise) == ("onnxruntime", True, MIN_MARGIN)
    verdict = run_race({"onnxruntime": 0.1, "nchw": jittery(0.08), "per-node": 0.05})
    assert (verdict.chosen, verdict.decided, verdict.noise) == ("per-node", True, MIN_MARGIN)


def test_a_race_whose_candidates_all_fail_after_their_warm_up_raises():
    clock = Clock()

    def fails_later():
        fails_later.calls += 1
        clock.now += 0.01
        if fails_later.calls > 2:
            raise RuntimeError("a kernel that breaks on its third call")

    fails_later.calls = 0
    with pytest.raises(RuntimeError, match="third call"):
        race({"onnxruntime": fails_later}, clock=clock, machine=FakeMachine())
