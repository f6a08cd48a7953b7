"""`python -m fusion.bench --child SPEC`: one child-process measurement (fusion.bench.child);
`python -m fusion.bench --worker FD_IN FD_OUT`: a runner in a process of its own
(fusion.bench.workers). Both are internal to `fusion bench`."""

import json
import sys

from fusion.bench.child import RESULT_TAG, run_child
from fusion.bench.workers import serve

if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(RESULT_TAG + json.dumps(run_child(json.loads(sys.argv[2]))), flush=True)
elif len(sys.argv) == 4 and sys.argv[1] == "--worker":
    serve(int(sys.argv[2]), int(sys.argv[3]))
else:
    sys.exit("usage: python -m fusion.bench --child SPEC | --worker FD_IN FD_OUT (internal)")
