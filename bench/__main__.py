"""`python -m bench [--quick] [--systems direct,nginx,tether,tether_info]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.runner import run
from bench.workloads import FULL, QUICK

SYSTEMS = ("direct", "nginx", "tether", "tether_info")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description="tether vs nginx vs direct, side by side")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke test in well under a minute")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    names = args.systems.split(",")
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    run(QUICK if args.quick else FULL, "quick" if args.quick else "full", names, args.results_dir)


main()
