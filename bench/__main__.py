"""`python -m bench [--quick] [--rounds N] [--systems ...] [--workloads ...]`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench.runner import run
from bench.systems import SYSTEMS
from bench.workloads import FULL, QUICK

WORKLOADS = ("relay", "paced", "requests", "streams", "aborts", "memory")


def choice_list(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated subset of `allowed`."""

    def parse(value: str) -> list[str]:
        names = value.split(",")
        unknown = set(names) - set(allowed)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(sorted(unknown))}")
        return names

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="tether vs nginx vs direct, side by side"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny counts: a smoke test in well under a minute"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat everything; each figure is the median"
    )
    parser.add_argument(
        "--systems",
        type=choice_list(SYSTEMS),
        default=list(SYSTEMS),
        help="comma-separated subset of " + ",".join(SYSTEMS),
    )
    parser.add_argument(
        "--workloads",
        type=choice_list(WORKLOADS),
        default=list(WORKLOADS),
        help="comma-separated subset of " + ",".join(WORKLOADS),
    )
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    run(
        QUICK if args.quick else FULL,
        "quick" if args.quick else "full",
        args.systems,
        args.workloads,
        args.rounds,
        args.results_dir,
    )


main()
