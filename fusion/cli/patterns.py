"""`fusion patterns`: the catalog in priority order (a larger entry first)."""

from __future__ import annotations

import json

from fusion.registry import default_catalog

NAME, HELP = "patterns", "list the catalog"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def execute(args) -> int:
    rows = [
        {
            "name": r.name,
            "priority": r.priority,
            "anchors": sorted(r.anchors),
            "matches": r.description,
            "kernel": f"{r.prepare.__module__}.{r.prepare.__qualname__}" if r.prepare else None,
            "inputs": list(r.inputs),
        }
        for r in default_catalog().ordered()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console  # heavy: only for the table
    from rich.table import Table

    table = Table(title="fusion catalog (priority order)")
    # Long words fold onto the next line rather than end in "…": a kernel's dotted name
    # must read whole at 80 columns.
    table.add_column("name", overflow="fold")
    table.add_column("priority", justify="right")
    table.add_column("matches", overflow="fold")
    table.add_column("kernel", overflow="fold")
    for row in rows:
        table.add_row(row["name"], str(row["priority"]), row["matches"], row["kernel"] or "-")
    Console().print(table)
    return 0
