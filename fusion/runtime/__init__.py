"""Running a fused model: plan (islands, kernel steps, releases), kernel (building a fused
node's kernel, thread settings), session (fusion.Session, the InferenceSession look-alike)."""

from fusion.runtime.session import (
    InvalidFeed,
    NodeArg,
    Profile,
    Session,
    describe_race,
    is_fused,
)

__all__ = ["InvalidFeed", "NodeArg", "Profile", "Session", "describe_race", "is_fused"]
