"""`fusion tune MODEL [--batch 1 8]`: choose how every fused node runs, ahead of time.

A Session times each fused node's tactics against onnxruntime on the node's own body, then
races the whole plan against onnxruntime alone (fusion/runtime/tactics.py, Session._settle),
on the first run of each input shape; the choices go to the timing cache (per CPU), and later
sessions on this machine reuse them for free. `tune` makes those first runs now, for the given
batch sizes, and prints what was chosen. Nothing is written but the cache.
"""

from __future__ import annotations

from collections import Counter

from fusion.cli.inputs import batch_dims, beyond_the_checker, load_checked
from fusion.cli.run import prepared_session
from fusion.errors import FusionError
from fusion.feeds import model_inputs
from fusion.runtime import describe_race
from fusion.runtime.timing_cache import cache_dir

NAME, HELP = "tune", "time every fused node's kernels once, for later sessions on this CPU"


def add_arguments(p) -> None:
    p.add_argument("model", help=".onnx file, fused or not (an unfused one is fused in memory)")
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="sizes of the symbolic first axes to tune for (default 1)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="threads (Numba and onnxruntime)")


def execute(args) -> int:
    model, _, checked = load_checked(args.model)
    if any(b < 1 for b in args.batch):
        raise FusionError(f"--batch must be at least 1, got {args.batch}")
    with beyond_the_checker(args.model, checked):
        session = prepared_session(model, args.threads, tactics="fastest")
        for batch in args.batch:
            feeds, _ = model_inputs(session.model, None, 0, batch_dims(session.model, batch))
            session.run(None, feeds)
            print(f"batch {batch}: {describe_race(session.race_for(feeds))}")
            tactics = Counter(session.choices_for(feeds).values())
            print("  tactics: " + (", ".join(f"{n} x{k}" for n, k in tactics.most_common())
                                   or "none (nothing fused)"))  # fmt: skip
    print(f"timing cache: {cache_dir()}")
    return 0
