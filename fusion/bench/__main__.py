"""`python -m fusion.bench --child SPEC`: one child-process measurement (fusion.bench.child)."""

import json
import sys

from fusion.bench.child import RESULT_TAG, run_child

if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(RESULT_TAG + json.dumps(run_child(json.loads(sys.argv[2]))), flush=True)
else:
    sys.exit("usage: python -m fusion.bench --child SPEC (internal; see `fusion bench`)")
