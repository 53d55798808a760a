"""``python -m shoal.timeline summary FILE...``, ``plot FILE -o OUT.png`` and ``merge FILE... -o OUT.json``."""

from __future__ import annotations

import argparse

from shoal.timeline import load_trace, plot, summarize, write_merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.timeline", description="Condense Shoal timeline files.")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="per tensor: exchanges, waits, transfer, who arrived last; overlap")
    summary.add_argument("files", nargs="+", help="one timeline, a merged one, or one file per rank")
    summary.add_argument("--top", type=int, default=15, help="tensors to list (default 15)")
    drawing = commands.add_parser("plot", help="draw one rank's compute spans and tensor phases (needs matplotlib)")
    drawing.add_argument("files", nargs="+")
    drawing.add_argument("-o", "--output", default="timeline.png")
    drawing.add_argument("--tensors", type=int, default=20, help="tensor rows to draw (default 20)")
    drawing.add_argument("--rank", type=int, default=None, help="the rank to draw (default: the lowest)")
    drawing.add_argument("--steps", type=int, default=None, help="draw only the last N optimizer steps")
    merging = commands.add_parser("merge", help="put per-rank files (the TIMELINE knob set to tl-{rank}.json) on one clock")
    merging.add_argument("files", nargs="+")
    merging.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "merge":
            count = write_merged(args.files, args.output)
            print(f"{args.output}: {count} events from {len(args.files)} files")
            return
        trace = load_trace(args.files)
    except (OSError, ValueError) as error:
        parser.exit(2, f"python -m shoal.timeline: error: {error}\n")
    if args.command == "summary":
        print(summarize(trace, args.top))
    else:
        print(plot(trace, args.output, args.tensors, args.rank, args.steps))


if __name__ == "__main__":
    main()
