"""How long matching and rewriting take on a large graph (issue: well under a second for 500
nodes). Run: python bench/matching.py [--blocks 170]"""

import argparse
import statistics
import time

from fusion.examples import conv_stack

import fusion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=170, help="conv blocks (3 nodes each)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = conv_stack(blocks=args.blocks, channels=4, size=8, form="pytorch")  # Identity weights
    catalog = fusion.default_catalog()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        result = fusion.rewrite(model, catalog)
        times.append(time.perf_counter() - start)
    print(
        f"{len(model.graph.node)} nodes, {len(catalog)} rules, {len(result.fusions)} fusions: "
        f"median {statistics.median(times) * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, "
        f"max {max(times) * 1e3:.0f}) over {args.rounds} rewrites"
    )


if __name__ == "__main__":
    main()
