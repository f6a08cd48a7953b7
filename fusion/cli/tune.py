"""`fusion tune MODEL [--batch 1 8] [--force]`, `fusion tune [MODEL] --show`: choose how every
fused node runs, ahead of time, or show what was chosen.

A Session times each fused node's tactics against onnxruntime on the node's own body, then
races the whole plan against onnxruntime alone (fusion/runtime/choice.py and race.py), on
the first run of each input shape; the choices go to the timing cache (per CPU), and later
sessions on this machine reuse them for free. `tune` makes those first runs now, for the given
batch sizes, and prints what was chosen; `--force` times and races again what the cache already
answers. `--show` prints the cached whole-plan verdicts (of MODEL, or all) with when and under
what load they were taken, and times nothing. Nothing is written but the cache.
"""

from __future__ import annotations

import time
from collections import Counter

from fusion.cli.inputs import batch_sizes, beyond_the_checker, load_checked, positive_int
from fusion.cli.run import prepared_session
from fusion.errors import FusionError
from fusion.feeds import model_inputs, random_shapes, require_memory
from fusion.graph import GraphView
from fusion.runtime import describe_race
from fusion.runtime.session import cached_races
from fusion.runtime.timing_cache import cache_dir

NAME, HELP = "tune", "time every fused node's kernels once, for later sessions on this CPU"


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=".onnx file, fused or not (an unfused one is fused in memory)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, nargs="+", default=None,
                   help="sizes of the symbolic first axes to tune for (default 1)")  # fmt: skip
    p.add_argument(
        "--threads", type=positive_int, default=None, help="threads (Numba and onnxruntime)"
    )
    p.add_argument("--force", action="store_true",
                   help="time and race again what the timing cache already answers")  # fmt: skip
    p.add_argument("--show", action="store_true",
                   help="print the cached whole-plan verdicts (MODEL's, or all)")  # fmt: skip


def execute(args) -> int:
    if args.show:
        if args.force or args.batch:
            raise FusionError("--show times nothing: it takes no --force or --batch")
        return _show(args.model, args.threads)
    if args.model is None:
        raise FusionError("tune needs a MODEL (or --show)")
    model, _, checked = load_checked(args.model)
    batches = batch_sizes(model, args.batch)  # what the model can take, a warning for the rest
    view = GraphView(model)
    for batch in batches:  # before the kernels compile: inputs the memory can hold
        require_memory(random_shapes(view, None, batch))
    with beyond_the_checker(args.model, checked):
        session = prepared_session(model, args.threads, tactics="fastest", retime=args.force)
        for batch in batches:
            feeds, _ = model_inputs(session.model, None, 0, None, batch)
            session.run(None, feeds)
            said = f"batch {batch}" if batch is not None else "inputs as declared"
            print(f"{said}: {describe_race(session.race_for(feeds))}")
            tactics = Counter(session.choices_for(feeds).values())
            print("  tactics: " + (", ".join(f"{n} x{k}" for n, k in tactics.most_common())
                                   or "none (nothing fused)"))  # fmt: skip
    print(f"timing cache: {cache_dir()}")
    return 0


def _show(path, threads: int | None) -> int:
    model = None
    if path is not None:
        model, _, _ = load_checked(path)
    rows = [row for row in cached_races(model)
            if threads is None or row[0].split("|")[2] == f"t{threads}"]  # fmt: skip
    whose = f"for {path}" if path is not None else "in all"
    if not rows:
        print(f"no cached whole-plan verdict {whose} on this CPU")
    for key, race, written in rows:
        digest, dims, ran = key.removeprefix("plan:").split("|")[:3]
        model_part = "" if path is not None else f"model {digest}, "
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(written)) if written else "?"
        print(f"{model_part}inputs {dims or '-'}, threads {ran[1:]}, raced {when}:")
        print(f"  {describe_race(race)}")
    print(f"timing cache: {cache_dir()}")
    return 0
