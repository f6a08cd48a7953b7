"""`fusion run MODEL`: run a model (fused or not) with fusion.Session, outputs to an .npz."""

from __future__ import annotations

import io

import numpy as np

from fusion.cli.inputs import (
    add_input_argument,
    beyond_the_checker,
    check_writes,
    input_files,
    load_checked,
    non_negative_int,
    positive_int,
)
from fusion.cli.progress import progress_bar
from fusion.feeds import model_inputs
from fusion.files import write_atomic
from fusion.runtime import Session

NAME, HELP = "run", "run a model with fusion.Session"


def add_arguments(p) -> None:
    p.add_argument("model", help=".onnx file, fused or not (an unfused one is fused in memory)")
    add_input_argument(p)
    p.add_argument("-o", "--output", help="write the outputs to this .npz file")
    p.add_argument(
        "--threads", type=positive_int, default=None, help="threads (Numba and onnxruntime)"
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of random inputs not given"
    )


def execute(args) -> int:
    model, data_files, checked = load_checked(args.model)
    check_writes({"the output": args.output}, args.model, data_files, args.input)
    with beyond_the_checker(args.model, checked):
        session = prepared_session(model, args.threads)
        feeds, source = model_inputs(session.model, input_files(args.input), args.seed, None)
        outputs = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    for name, value in zip(names, outputs, strict=True):
        print(f"{name}: {value.dtype} {list(value.shape)}")
    if args.output:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(names, outputs, strict=True)))
        write_atomic(args.output, buffer.getvalue())
    print(f"inputs: {source}; {Session.__name__} ran {len(session.steps)} steps")
    return 0


def prepared_session(model, threads, tactics=None, retime: bool = False) -> Session:
    """A fusion.Session, with a progress bar while kernels compile on first use."""
    from rich.console import Console  # heavy: only for a command that builds kernels

    # On stderr: what is printed while it shows (a warning) goes there too, not to stdout.
    with progress_bar(Console(stderr=True)) as bar:
        task = bar.add_task("preparing kernels", total=None)

        def progress(name, i, total):
            bar.update(task, total=total, completed=i - 1, description=f"kernel {name}")

        return Session(model, threads=threads, progress=progress, tactics=tactics, retime=retime)
