"""shoalrun's command line. The flags mirror horovodrun's, so job scripts only change the program name."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import shoal
from shoal.runner.config_file import apply_config, load_config

FLAG_HINTS = {
    "--mpi": "Shoal has no MPI controller; it always runs over gloo (and NCCL for CUDA tensors): drop the flag",
    "--jsrun": "Shoal launches over ssh or locally; jsrun is not supported",
    "--mpi-args": "Shoal does not start mpirun; pass environment with -x NAME instead",
    "--tcp": "Shoal's transport is torch.distributed (gloo/NCCL) over TCP already: drop the flag",
    "--binding-args": "Shoal does not start mpirun, so there are no binding arguments",
    "--mpi-threads-disable": "Shoal has no MPI controller: drop the flag",
    "--no-mpi-threads-disable": "Shoal has no MPI controller: drop the flag",
    "--num-nccl-streams": "Shoal issues NCCL collectives from one engine thread on one stream: drop the flag",
    "--thread-affinity": "not supported; pin threads in the training script (torch.set_num_threads, taskset)",
    "--hierarchical-allgather": "not supported: allgather always goes over torch.distributed",
    "--no-hierarchical-allgather": "allgather is never hierarchical in Shoal: drop the flag",
    "--torus-allreduce": "not supported; --hierarchical-allreduce is the two-level path",
    "--no-torus-allreduce": "Shoal has no torus allreduce: drop the flag",
    "--blacklist-cooldown-range": "not supported: a failing host is excluded for the rest of the elastic job",
    "--nproc-per-node": "torchrun's; use -np N (with -H host:slots for several hosts)",
    "--nproc_per_node": "torchrun's; use -np N (with -H host:slots for several hosts)",
    "--nnodes": "torchrun's; list the hosts with -H host1:slots,host2:slots (or --hostfile)",
    "--node-rank": "torchrun's; shoalrun starts every host's workers itself, over ssh",
    "--node_rank": "torchrun's; shoalrun starts every host's workers itself, over ssh",
    "--master-addr": "torchrun's; shoalrun hosts the rendezvous itself (--network-interface picks its address)",
    "--master_addr": "torchrun's; shoalrun hosts the rendezvous itself (--network-interface picks its address)",
    "--master-port": "torchrun's; shoalrun hosts the rendezvous itself on a free port",
    "--master_port": "torchrun's; shoalrun hosts the rendezvous itself on a free port",
    "--rdzv-backend": "torchrun's; shoalrun's rendezvous is its own authenticated store",
    "--rdzv-endpoint": "torchrun's; shoalrun's rendezvous is its own authenticated store",
    "--standalone": "torchrun's; shoalrun on one host is standalone already: drop the flag",
    "--max-restarts": "torchrun's; use elastic flags (--min-np, --max-np) and --reset-limit",
}
"""horovodrun and torchrun flags shoalrun does not take, with what to do instead."""


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the usage before an error; shoalrun prints one line (with a hint for flags it knows of from
    horovodrun or torchrun) and exits 2."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            for token in message.split(":", 1)[1].split():
                flag = token.split("=", 1)[0]
                hint = FLAG_HINTS.get(flag)
                if hint:
                    message = f"{message}; {flag}: {hint}"
                    break
        print(f"shoalrun: error: {message} (see shoalrun --help)", file=sys.stderr)
        sys.exit(2)


def environment_item(item: str) -> str:
    """``-x NAME`` or ``-x NAME=VALUE``, with NAME a valid environment variable name."""
    name = item.partition("=")[0]
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{name!r} is not an environment variable name")
    return item


def parse_rank_filter(text: str) -> set[int]:
    """``--ranks-filter 0,2-3`` as a set of ranks; a bad value is a one-line argparse error."""
    ranks: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            ranks.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {part!r}; expected ranks like 0,2-3") from None
    return ranks


def build_parser() -> argparse.ArgumentParser:
    """Return shoalrun's argument parser (the flag set is frozen by a test)."""
    parser = _OneLineErrorParser(
        prog="shoalrun",
        description="Launch a Shoal (or Horovod-style) training job: local workers directly, remote ones over ssh.",
        epilog="Example: shoalrun -np 4 -H a:2,b:2 python train.py",
    )
    parser.add_argument("-v", "--version", action="version", version=f"shoalrun {shoal.__version__}")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, help="number of worker processes")
    parser.add_argument(
        "-cb", "--check-build", action="store_true", help="show which frameworks and backends are available, then exit"
    )
    hosts = parser.add_argument_group("hosts")
    hosts.add_argument("-H", "--hosts", help="comma-separated host:slots list; default localhost:NP")
    hosts.add_argument("-hostfile", "--hostfile", help="file with one 'host slots=N' (or host:N) per line")
    hosts.add_argument("-p", "--ssh-port", type=int, help="ssh port on the remote hosts")
    hosts.add_argument("-i", "--ssh-identity-file", help="ssh identity (private key) file")
    hosts.add_argument(
        "--ssh-strict-host-key-checking",
        choices=["yes", "accept-new", "no"],
        default="accept-new",
        help="ssh's StrictHostKeyChecking for remote hosts (default accept-new: a new host's key is recorded, a "
        "changed key is refused)",
    )
    hosts.add_argument(
        "-x",
        "--env",
        dest="forward_env",
        type=environment_item,
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set this variable for remote workers, with its value here or the one given (repeatable, as mpirun -x); "
        "remote workers get the rest of shoalrun's environment anyway, as with horovodrun",
    )
    hosts.add_argument(
        "--start-timeout", type=float, default=30.0, help="seconds the workers may take to rendezvous (default 30)"
    )
    hosts.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="network_interface",
        help="network interface(s), comma-separated, whose address remote workers use to reach the rendezvous",
    )
    hosts.add_argument(
        "--slots-per-host",
        type=int,
        help="slots of every host listed without ':N' in -H, a hostfile or discovery output (default 1)",
    )
    hosts.add_argument(
        "--gloo",
        action="store_true",
        help="accepted for horovodrun compatibility; Shoal always uses gloo (and NCCL for CUDA tensors)",
    )
    hosts.add_argument(
        "--horovod-compat",
        action="store_true",
        help="run unmodified Horovod scripts: `import horovod.torch as hvd` (and every horovod.* module) resolves to "
        "Shoal in the workers; nothing is installed, and a real Horovod on the path is refused",
    )
    elastic = parser.add_argument_group(
        "elastic training (any of these flags makes the job elastic: it survives workers that die or join)"
    )
    elastic.add_argument(
        "--min-np", "--min-num-proc", dest="min_np", type=int, help="fewest workers the job may run with (default: -np)"
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        help="most workers the job may grow to (default: every slot offered)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        help="executable polled every second; prints the available hosts, one 'host:slots' per line",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for at least --min-np workers before failing the job (default 600)",
    )
    elastic.add_argument(
        "--reset-limit", type=int, help="fail the job once it would re-form more than this many times (default: no limit)"
    )
    servers = parser.add_argument_group("parameter server (for DistributedOptimizer(..., comm='ps'))")
    servers.add_argument(
        "--num-servers",
        type=int,
        default=0,
        help="start this many dedicated parameter-server processes beside the workers (default 0: co-located "
        "server shards inside the workers)",
    )
    parser.add_argument(
        "--config-file",
        help="horovodrun's YAML config file (params, timeline, stall_check, library_options, logging); flags on the "
        "command line win over it (needs PyYAML)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output-filename", help="directory; each rank's stdout and stderr also go to DIR/rank.N/{stdout,stderr}"
    )
    output.add_argument("--verbose", action="store_true", help="print what shoalrun does (hosts, rendezvous, commands)")
    output.add_argument(
        "--ranks-filter",
        type=parse_rank_filter,
        metavar="RANKS",
        help="show only these ranks' output, e.g. 0 or 0,2-3 (as torchrun's --local-ranks-filter); every rank's "
        "output still goes to --output-filename",
    )
    output.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_timestamp",
        action="store_true",
        help="prefix every output line with the time it arrived, as horovodrun does",
    )
    output.add_argument(
        "--log-level",
        type=str.upper,
        choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"],
        help="Shoal log level in the workers (SHOAL_LOG_LEVEL; any case)",
    )
    for flag in ("--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp"):
        output.add_argument(flag, action="store_true", help=argparse.SUPPRESS)  # horovodrun's; Shoal logs no time
    tuning = parser.add_argument_group("engine tuning (passed to the workers as environment variables)")
    tuning.add_argument("--timeline-filename", help="write a Chrome-trace timeline of the engine to this file (SHOAL_TIMELINE)")
    tuning.add_argument("--timeline-mark-cycles", action="store_true", help="mark engine cycles in the timeline")
    tuning.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false", help=argparse.SUPPRESS)
    tuning.add_argument("--fusion-threshold-mb", type=float, help="tensor fusion buffer size in MiB (SHOAL_FUSION_THRESHOLD)")
    tuning.add_argument("--cycle-time-ms", type=float, help="engine cycle time in ms (SHOAL_CYCLE_TIME)")
    tuning.add_argument(
        "--hierarchical-allreduce",
        action="store_true",
        help="allreduce through shared memory within each host, torch.distributed between hosts "
        "(SHOAL_HIERARCHICAL_ALLREDUCE; on by default whenever a host runs several ranks)",
    )
    tuning.add_argument(
        "--no-hierarchical-allreduce",
        action="store_true",
        help="never use shared memory within hosts; every allreduce goes over gloo (SHOAL_HIERARCHICAL_ALLREDUCE=0)",
    )
    tuning.add_argument("--cache-capacity", type=int, help="response cache capacity; 0 disables it (SHOAL_CACHE_CAPACITY)")
    tuning.add_argument(
        "--disable-cache",
        action="store_true",
        help="horovodrun's: skip its cached host and NIC checks; Shoal keeps no such cache, so this changes nothing "
        "(the response cache is --cache-capacity 0)",
    )
    tuning.add_argument("--no-stall-check", action="store_true", help="disable the stall inspector")
    tuning.add_argument(
        "--autotune",
        action="store_true",
        help="tune fusion threshold, cycle time, gradient bucket, response cache and hierarchical allreduce while "
        "training, by Bayesian optimisation (SHOAL_AUTOTUNE; needs optuna: pip install 'shoal[autotune]')",
    )
    tuning.add_argument("--no-autotune", dest="autotune", action="store_false", help=argparse.SUPPRESS)
    tuning.add_argument("--autotune-log-file", help="CSV of every autotune sample, written by rank 0")
    tuning.add_argument("--autotune-warmup-samples", type=int, help="samples at the defaults that are not scored (3)")
    tuning.add_argument("--autotune-steps-per-sample", type=int, help="engine cycles that moved data per autotune sample (10)")
    tuning.add_argument(
        "--autotune-bayes-opt-max-samples", type=int, help="scored samples before the best setting is frozen (20)"
    )
    tuning.add_argument(
        "--autotune-gaussian-process-noise",
        type=float,
        help="0 treats the score as deterministic, anything up to 1 as noisy (0.8)",
    )
    tuning.add_argument("--stall-check", dest="no_stall_check", action="store_false", help=argparse.SUPPRESS)
    tuning.add_argument(
        "--gloo-timeout-seconds",
        type=float,
        help="how long one engine collective may block before it fails (SHOAL_COLLECTIVE_TIMEOUT_SECONDS)",
    )
    tuning.add_argument(
        "--stall-check-warning-time-seconds",
        type=float,
        help="warn about a stalled tensor after this long (default 60)",
    )
    tuning.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=float,
        help="fail the job when a tensor stalls this long (default: never)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    return parser


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate the elastic flags and fill in their defaults (-np, --min-np and --max-np from one another)."""
    if args.host_discovery_script and (args.hosts or args.hostfile):
        parser.error("use either --host-discovery-script or -H/--hostfile, not both")
    for name in ("num_proc", "min_np", "max_np"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.num_proc is None:
        args.num_proc = args.min_np
    if args.num_proc is None and not (args.hosts or args.hostfile):
        parser.error("an elastic job needs -np or --min-np")
    if args.min_np is None and args.num_proc is not None:
        args.min_np = args.num_proc  # else from the hosts' slots, once they are known (shoal.runner.main)
    if args.num_proc is not None and args.min_np is not None and args.num_proc < args.min_np:
        parser.error(f"-np {args.num_proc} is smaller than --min-np {args.min_np}")
    if args.max_np is not None and args.max_np < max(args.min_np or 0, args.num_proc or 0):
        parser.error(f"--max-np {args.max_np} is smaller than -np/--min-np")
    if args.max_np is None:
        args.max_np = 1 << 30  # bounded by the slots the hosts offer
    if args.elastic_timeout <= 0:
        parser.error(f"--elastic-timeout must be > 0, got {args.elastic_timeout}")
    if args.reset_limit is not None and args.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate shoalrun's flags; bad flags print one line and exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.config_file:
        tokens = list(sys.argv[1:] if argv is None else argv)
        flags = tokens[: len(tokens) - len(args.command)]
        given = {
            action.dest
            for action in parser._actions
            if any(t == o or t.startswith(o + "=") for t in flags for o in action.option_strings)
        }
        try:
            apply_config(args, load_config(args.config_file), given)
        except ValueError as error:
            parser.error(str(error))
    if args.check_build:
        return args
    if not args.command:
        parser.error("no command given; usage: shoalrun -np N [flags] command [args ...]")
    if args.hosts and args.hostfile:
        parser.error("use either -H/--hosts or --hostfile, not both")
    if args.hierarchical_allreduce and args.no_hierarchical_allreduce:
        parser.error("use either --hierarchical-allreduce or --no-hierarchical-allreduce, not both")
    if args.slots_per_host is not None and args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be >= 1, got {args.slots_per_host}")
    args.elastic = any(getattr(args, n) is not None for n in ("min_np", "max_np", "host_discovery_script", "reset_limit"))
    if args.num_servers < 0:
        parser.error(f"--num-servers must be >= 0, got {args.num_servers}")
    if args.elastic:
        if args.num_servers:
            parser.error("--num-servers cannot be combined with elastic flags (a server's shard cannot move yet)")
        _check_elastic(parser, args)
    elif args.num_proc is None and not (args.hosts or args.hostfile):
        parser.error("-np is required when no hosts are given")
    if args.start_timeout <= 0:
        parser.error(f"--start-timeout must be > 0, got {args.start_timeout}")
    for name in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    return args
