"""shoalrun: the job launcher (``shoalrun`` or ``python -m shoal.runner``)."""

from __future__ import annotations

import sys

from shoal.runner.cli import parse_args
from shoal.runner.hosts import HostSpecError
from shoal.runner.launcher import Job, build_slots


def check_build() -> str:
    """horovodrun --check-build's report, for Shoal."""
    import shoal
    import shoal.torch as hvd

    def mark(flag: object) -> str:
        return "[X]" if flag else "[ ]"

    return "\n".join(
        [
            f"Shoal v{shoal.__version__}:",
            "",
            "Available Frameworks:",
            "    [ ] TensorFlow",
            "    [X] PyTorch",
            "    [ ] MXNet",
            "",
            "Available Controllers:",
            f"    {mark(hvd.mpi_built())} MPI",
            f"    {mark(hvd.gloo_built())} Gloo",
            "",
            "Available Tensor Operations:",
            f"    {mark(hvd.nccl_built())} NCCL",
            "    [ ] DDL",
            "    [ ] CCL",
            f"    {mark(hvd.mpi_built())} MPI",
            f"    {mark(hvd.gloo_built())} Gloo",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """shoalrun's entry point; returns the exit code (a failed worker's code, 2 for bad flags)."""
    args = parse_args(argv)
    if args.check_build:
        print(check_build())
        return 0
    if args.elastic:
        from shoal.runner.elastic_driver import ElasticJob, elastic_hosts

        try:
            hosts = elastic_hosts(args)
            if args.num_proc is None:
                args.num_proc = min(sum(h.slots for h in hosts), args.max_np)
            if args.min_np is None:
                args.min_np = args.num_proc
            return ElasticJob(args, hosts).run()
        except (HostSpecError, ValueError) as error:
            print(f"shoalrun: error: {error}", file=sys.stderr)
            return 2
    try:
        slots = build_slots(args)
    except HostSpecError as error:
        print(f"shoalrun: error: {error}", file=sys.stderr)
        return 2
    try:
        job = Job(args, slots)
    except ValueError as error:
        print(f"shoalrun: error: {error}", file=sys.stderr)
        return 2
    return job.run()


def console_main() -> None:
    """The ``shoalrun`` console script."""
    sys.exit(main())
