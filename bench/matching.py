"""How long matching and rewriting take on a large graph (issue: well under a second for 500
nodes). Run: python bench/matching.py [--blocks 170]"""

import argparse

import fusion
from fusion.bench.timing import interleave
from fusion.models import conv_stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=170, help="conv blocks (3 nodes each)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = conv_stack(blocks=args.blocks, channels=4, size=8, form="pytorch")  # Identity weights
    catalog = fusion.default_catalog()
    fusions = len(fusion.rewrite(model, catalog).fusions)
    timing = interleave({"rewrite": lambda: fusion.rewrite(model, catalog)}, args.rounds, warmup=0)
    times = timing.times["rewrite"]
    print(
        f"{len(model.graph.node)} nodes, {len(catalog)} rules, {fusions} fusions: "
        f"median {timing.median('rewrite') * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, "
        f"max {max(times) * 1e3:.0f}) over {args.rounds} rewrites"
    )


if __name__ == "__main__":
    main()
