"""`fusion verify ORIGINAL [FUSED]`: fusion.Session against onnxruntime; exit 1 when they differ."""

from __future__ import annotations

import json

from fusion.cli.inputs import (
    add_input_argument,
    beyond_the_checker,
    input_files,
    load_checked,
    non_negative_float,
    non_negative_int,
)
from fusion.verify import verify

NAME, HELP = "verify", "compare a fused model with the original in onnxruntime"


def add_arguments(p) -> None:
    p.add_argument("original", help="the original .onnx file")
    p.add_argument("fused", nargs="?", help="the fused file (default: fuse the original)")
    add_input_argument(p)
    p.add_argument("--rtol", type=non_negative_float, default=None, help="relative tolerance")
    p.add_argument("--atol", type=non_negative_float, default=None, help="absolute tolerance")
    p.add_argument("--per-node", action="store_true", help="check each fused node's kernel")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random inputs")
    p.add_argument("--json", action="store_true", help="machine-readable report")


def execute(args) -> int:
    return verify_files(
        args.original,
        args.fused,
        inputs=args.input,
        rtol=args.rtol,
        atol=args.atol,
        per_node=args.per_node,
        seed=args.seed,
        as_json=args.json,
    )


def verify_files(
    original,
    fused=None,
    inputs: list[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    per_node: bool = False,
    seed: int = 0,
    as_json: bool = False,
) -> int:
    """Verify the fused file (or the original fused in memory) and print the report."""
    model, _, checked = load_checked(original)
    fused_model, _, fused_checked = load_checked(fused) if fused else (None, (), True)
    with beyond_the_checker(original, checked and fused_checked):
        report = verify(
            model,
            fused_model,
            inputs=input_files(inputs),
            rtol=rtol,
            atol=atol,
            per_node=per_node,
            seed=seed,
        )
    print(json.dumps(report.to_dict(), indent=2) if as_json else report)
    return 0 if report.ok else 1
