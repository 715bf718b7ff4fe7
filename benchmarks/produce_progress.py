"""What ``acs produce``'s progress bar costs: the same stdin through ``--progress`` and
``--no-progress`` in alternating runs (same machine, same moment), medians and their ratio.

    .venv/bin/python benchmarks/produce_progress.py [--lines 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    data = b"".join(b"message %d\n" % i for i in range(args.lines))
    times = {"--no-progress": [], "--progress": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in times:
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "pyspark_acs.cli.main", "produce", "--root", f"{tmp}/{mode}{r}",
                                "--stream", "bench", "--data-cache", "none", "--metadata-cache", "none", mode],
                               input=data, check=True, capture_output=True)
                times[mode].append(time.perf_counter() - t0)
    base, bar = statistics.median(times["--no-progress"]), statistics.median(times["--progress"])
    print(f"acs produce of {args.lines} lines, median of {args.rounds} runs each:")
    print(f"  --no-progress {base:.2f} s ({args.lines / base:,.0f} msg/s)")
    print(f"  --progress    {bar:.2f} s ({args.lines / bar:,.0f} msg/s)")
    print(f"  ratio progress/no-progress {bar / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
