"""``python -m shoal.timeline summary FILE`` and ``python -m shoal.timeline plot FILE -o OUT.png``."""

from __future__ import annotations

import argparse

from shoal.timeline import load_phases, plot, summarize


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.timeline", description="Condense a Shoal timeline file.")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="per tensor: exchanges, negotiation wait, transfer time")
    summary.add_argument("file")
    summary.add_argument("--top", type=int, default=15, help="tensors to list (default 15)")
    drawing = commands.add_parser("plot", help="draw the tensors' phases over time (needs matplotlib)")
    drawing.add_argument("file")
    drawing.add_argument("-o", "--output", default="timeline.png")
    drawing.add_argument("--tensors", type=int, default=20, help="rows to draw (default 20)")
    args = parser.parse_args(argv)
    phases = load_phases(args.file)
    if args.command == "summary":
        print(summarize(phases, args.top))
    else:
        print(plot(phases, args.output, args.tensors))


if __name__ == "__main__":
    main()
