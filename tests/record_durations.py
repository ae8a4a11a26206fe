"""Write tests/durations.json from a pytest log run with `--durations=0`: the seconds of each test
file (calls, set-ups and tear-downs summed) that took 5 s or more. conftest.py runs the longest
files first with them. `make test-durations` runs the suite and this."""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::")


def main(log: str) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    for line in Path(log).read_text().splitlines():
        if m := LINE.match(line):
            seconds[m.group(2)] += float(m.group(1))
    slow = {f: round(s) for f, s in seconds.most_common() if s >= 5}
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(slow, indent=1) + "\n")
    print(f"{out}: {len(slow)} files, {sum(slow.values())} s")


if __name__ == "__main__":
    main(sys.argv[1])
