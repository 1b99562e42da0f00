"""docs/quickstart.md's Python blocks, run as one script in their order, the "# H200 only" block included: what an
engineer with an H200 pastes first. Section 6's block is a module file (``# my_cpu_backend.py``), not a step, and
is left out.

    python3 bench/device/quickstart.py            # on an H200 machine with the kernel packages, from the repo root
    python3 bench/device/quickstart.py --print    # the script it runs (tests/test_cli.py compiles it on a CPU)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"


def script(text: str | None = None) -> str:
    """The quickstart's Python blocks joined in order, each under a comment naming its section."""
    text = QUICKSTART.read_text() if text is None else text
    out, section = [], ""
    for m in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", text, re.M | re.S):
        if m.group(1):
            section = m.group(1)
        elif not m.group(2).lstrip().startswith("# my_cpu_backend.py"):
            out.append(f"# --- {section}\n{m.group(2)}")
    return "\n".join(out)


if __name__ == "__main__":
    src = script()
    if "--print" in sys.argv[1:]:
        print(src)
    else:
        exec(compile(src, str(QUICKSTART), "exec"), {"__name__": "__quickstart__"})  # noqa: S102
