"""The README's pattern-registration example, run from the README text itself (as a user's
own module, in a fresh process), so the documentation cannot drift from the code."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    text = README.read_text()
    pattern = r"<!-- example:start -->\s*```python\n(.*?)```\s*<!-- example:end -->"
    block = re.search(pattern, text, re.S)
    assert block, "README lost its example block"
    return block.group(1)


def test_readme_example_runs_as_a_script_and_as_a_plugin(tmp_path):
    script = tmp_path / "my_patterns.py"
    script.write_text(readme_example())
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "MatMulBiasGelu: ok" in proc.stdout
    assert "'MatMulBiasGelu': 1" in proc.stdout
    assert "fusion.Session (fused)" in proc.stdout
    cmd = [sys.executable, "-m", "fusion", "patterns", "--json", "--plugin", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert '"name": "MatMulBiasGelu"' in proc.stdout
