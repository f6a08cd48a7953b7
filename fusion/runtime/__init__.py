"""Running a fused model: plan (islands), steps (what a run executes: islands, kernel steps,
releases, the run loop), kernel (building a model's kernels, thread settings), tactics and
choice (how each node and the whole plan run; race.py judges, timing_cache.py remembers),
feed_checks, and session (fusion.Session, the InferenceSession look-alike, on top of them)."""

from fusion.runtime.session import (
    InvalidFeed,
    NodeArg,
    Profile,
    Session,
    describe_race,
    is_fused,
)

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session", "describe_race", "is_fused"]
