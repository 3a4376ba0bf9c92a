"""Regenerate the measured tables in docs/BENCHMARKS.md from docs/bench/*/results.md.

Each table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` and is replaced by
``docs/bench/NAME/results.md`` as the bench wrote it, so no number is edited by hand:

    python -m dilocox.bench.report
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def regenerate(doc: str = os.path.join(ROOT, "docs", "BENCHMARKS.md")) -> list[str]:
    text = open(doc).read()
    done = []

    def sub(m: re.Match) -> str:
        path = os.path.join(ROOT, "docs", "bench", m.group(2), "results.md")
        if not os.path.exists(path):
            return m.group(0)
        done.append(m.group(2))
        return m.group(1) + open(path).read().strip() + "\n" + m.group(4)

    text = BLOCK.sub(sub, text)
    with open(doc, "w") as f:
        f.write(text)
    return done


def main(argv: list[str] | None = None) -> int:
    print("regenerated:", ", ".join(regenerate()) or "nothing", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
