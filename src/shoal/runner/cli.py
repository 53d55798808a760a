"""shoalrun's command line. The flags mirror horovodrun's, so job scripts only change the program name."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

import shoal
from shoal.config import EngineConfig, LaunchConfig, Setting, env_name, settings
from shoal.runner.config_file import apply_config, load_config

ENGINE_DEST = "engine:"
"""Where the parser puts an ``EngineConfig`` field's flag: ``ENGINE_DEST + field name``."""

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


def _help(setting: Setting, engine: bool) -> str:
    """The flag's help: the knob's, its environment name, and its default when it has one worth showing."""
    text = setting.knob.help
    if setting.knob.env is not None:
        text += f" ({env_name(setting.knob.env)})"
    shows_default = setting.default is not None and not isinstance(setting.default, (list, set))
    if setting.kind is not bool and (shows_default or setting.knob.shown_default is not None):
        shown = setting.default_text()
        if setting.knob.flag_scale != 1 and setting.knob.shown_default is None:
            shown = f"{setting.default / setting.knob.flag_scale:g}"
        text += f" (default {shown})"
    return text


def _add_setting(target: Any, setting: Setting, engine: bool) -> None:
    """Add one knob's flags: engine settings default to None (not given: the workers keep their environment's)."""
    knob_info = setting.knob
    dest = ENGINE_DEST + setting.name if engine else setting.name
    default = None if engine else setting.default
    if setting.kind is bool:
        if knob_info.off_flags:
            exclusive = target.add_mutually_exclusive_group()
            exclusive.add_argument(*knob_info.flags, dest=dest, action="store_const", const=True, help=_help(setting, engine))
            exclusive.add_argument(*knob_info.off_flags, dest=dest, action="store_const", const=False, help=knob_info.off_help)
            target.set_defaults(**{dest: default})
            return
        if knob_info.flags:
            target.add_argument(
                *knob_info.flags, dest=dest, action="store_const", const=True, default=default, help=_help(setting, engine)
            )
        for hidden in knob_info.hidden_flags:
            const = not knob_info.flags  # an alias of a flag-less setting turns it on; a negation turns it off
            target.add_argument(hidden, dest=dest, action="store_const", const=const, default=default, help=argparse.SUPPRESS)
        return
    options: dict[str, Any] = {
        "dest": dest,
        "default": default,
        "help": _help(setting, engine),
        "type": knob_info.flag_type or setting.kind,
    }
    if knob_info.choices is not None:
        options["choices"] = knob_info.choices
    else:
        options["metavar"] = knob_info.metavar or knob_info.flags[-1].lstrip("-").upper().replace("-", "_")
    if knob_info.nargs is not None:
        options.update(nargs=knob_info.nargs, metavar=tuple(options["metavar"].split()))
    if setting.kind is list:
        options.update(action="append", default=None)
    target.add_argument(*knob_info.flags, **options)


def build_parser() -> argparse.ArgumentParser:
    """shoalrun's parser, made from ``LaunchConfig``'s and ``EngineConfig``'s knobs (the flag set is frozen by a
    test); engine flags land in ``ENGINE_DEST + field``."""
    parser = _OneLineErrorParser(
        prog="shoalrun",
        description="Launch a Shoal (or Horovod-style) training job: local workers directly, remote ones over ssh.",
        epilog="Example: shoalrun -np 4 -H a:2,b:2 python train.py",
    )
    parser.add_argument("-v", "--version", action="version", version=f"shoalrun {shoal.__version__}")
    groups: dict[str, Any] = {"": parser}
    for cls, engine in ((LaunchConfig, False), (EngineConfig, True)):
        for setting in settings(cls):
            if setting.knob.flags or setting.knob.hidden_flags:
                group = setting.knob.group
                if group not in groups:
                    groups[group] = parser.add_argument_group(group)
                _add_setting(groups[group], setting, engine)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    return parser


def config_from_namespace(args: argparse.Namespace) -> LaunchConfig:
    """The parsed flags as a ``LaunchConfig`` (not yet checked)."""
    config = LaunchConfig(command=list(args.command))
    for setting in settings(LaunchConfig):
        if hasattr(args, setting.name):
            value = getattr(args, setting.name)
            setattr(config, setting.name, [] if value is None and setting.kind is list else value)
    for setting in settings(EngineConfig):
        value = getattr(args, ENGINE_DEST + setting.name, None)
        if value is not None:
            config.engine[setting.name] = setting.from_flag(value)
    return config


def split_command(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """shoalrun's flags, and the command after them: it starts at the first word that is neither one of shoalrun's
    flags (or an unambiguous abbreviation of one) nor a flag's value, or after ``--``. Argparse alone would read the
    command's own options (``python train.py --log x``) as abbreviations of shoalrun's flags."""
    by_flag = {option: action for action in parser._actions for option in action.option_strings}
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return argv[:index], argv[index + 1 :]
        if not word.startswith("-") or word == "-":
            break
        name, equals, _ = word.partition("=")
        action = by_flag.get(name)
        if action is None:
            matches = {by_flag[o] for o in by_flag if o.startswith(name)} if name.startswith("--") else set()
            action = matches.pop() if len(matches) == 1 else None
        index += 1
        if action is None or equals:
            continue  # an unknown flag is argparse's to refuse
        if action.nargs is None:
            index += 1
        elif isinstance(action.nargs, int):
            index += action.nargs
    return argv[:index], argv[index:]


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parse and check shoalrun's flags (and ``--config-file``) into a ``LaunchConfig``; bad flags print one line
    and exit 2."""
    parser = build_parser()
    flags, command = split_command(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args([*flags, "--", *command] if command else flags)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    config = config_from_namespace(args)
    if config.config_file:
        tokens = list(sys.argv[1:] if argv is None else argv)
        flags = tokens[: len(tokens) - len(config.command)]
        given = {
            action.dest.removeprefix(ENGINE_DEST)
            for action in parser._actions
            if any(t == o or t.startswith(o + "=") for t in flags for o in action.option_strings)
        }
        try:
            apply_config(config, load_config(config.config_file), given)
        except ValueError as error:
            parser.error(str(error))
    if config.check_build:
        return config
    if not config.command:
        parser.error("no command given; usage: shoalrun -np N [flags] command [args ...]")
    try:
        config.check()
    except ValueError as error:
        parser.error(str(error))
    return config
