"""Command line: ``python -m cuflash {bench,compile,iomodel}`` (also installed as ``cuflash``).

``bench`` is the main job: the benchmark report on the local GPU. Without a GPU it says so and runs the
offline compile check instead.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuflash", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")

    from . import bench, compile_report, iomodel

    bench.add_arguments(sub.add_parser("bench", help="benchmark report on the local GPU"))
    compile_report.add_arguments(
        sub.add_parser("compile", help="compile every kernel variant offline and report its machine code")
    )
    iomodel.add_arguments(
        sub.add_parser("iomodel", help="predicted HBM bytes and FLOPs of naive attention and each cuflash kernel")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["bench"] + list(argv or sys.argv[1:]))
    if args.command == "compile":
        from . import compile_report

        return compile_report.run(args)
    if args.command == "iomodel":
        from . import iomodel

        return iomodel.run(args)
    from . import bench

    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
