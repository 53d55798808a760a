"""shoalrun: the job launcher (``shoalrun`` or ``python -m shoal.runner``)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from shoal.config import LaunchConfig
from shoal.runner.cli import parse_args
from shoal.runner.hosts import HostSpecError, is_local_host
from shoal.runner.launcher import Job, build_slots, requested_hosts
from shoal.runner.spawners import ssh_argv


def check_build(config: LaunchConfig) -> str:
    """``shoalrun --check-build``: the environment report, then, with -H or --hostfile, each remote host's check."""
    from shoal.runner.env_report import report

    lines = [report()]
    if config.hosts or config.hostfile:
        try:
            hosts = requested_hosts(config)
        except HostSpecError as error:
            return f"{lines[0]}\nhosts: {error}"
        for host in hosts:
            lines.append(f"host {host.hostname}: {check_host(config, host.hostname)}")
    return "\n".join(lines)


def check_host(config: LaunchConfig, hostname: str, timeout_s: float = 20.0) -> str:
    """Whether ``hostname`` is reachable over ssh and has the same Shoal and torch as this machine."""
    import torch

    import shoal

    if is_local_host(hostname):
        return "this machine"
    probe = "import shoal, torch; print(shoal.__version__, torch.__version__)"
    command = ssh_argv(config, hostname, f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}")
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"NOT reachable: ssh did not answer within {timeout_s:.0f} s"
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no error text"])[-1]
        return f"NOT usable: {detail} (exit {result.returncode})"
    remote_shoal, _, remote_torch = result.stdout.strip().partition(" ")
    same = remote_shoal == shoal.__version__ and remote_torch == torch.__version__
    verdict = "same versions" if same else f"DIFFERENT versions (here Shoal {shoal.__version__}, torch {torch.__version__})"
    return f"reachable over ssh, Shoal {remote_shoal}, torch {remote_torch}: {verdict}"


def main(argv: list[str] | None = None) -> int:
    """shoalrun's entry point; returns the exit code (a failed worker's code, 2 for bad flags)."""
    config = parse_args(argv)
    if config.check_build:
        print(check_build(config))
        return 0
    if config.elastic:
        from shoal.runner.elastic_driver import ElasticSupervisor, elastic_hosts

        try:
            hosts = elastic_hosts(config)
            assert config.max_np is not None, "set by LaunchConfig.check()"
            if config.num_proc is None:
                config.num_proc = min(sum(h.slots for h in hosts), config.max_np)
            if config.min_np is None:
                config.min_np = config.num_proc
            return ElasticSupervisor(config, hosts).job_of().run()
        except (HostSpecError, ValueError) as error:
            print(f"shoalrun: error: {error}", file=sys.stderr)
            return 2
    try:
        slots = build_slots(config)
    except HostSpecError as error:
        print(f"shoalrun: error: {error}", file=sys.stderr)
        return 2
    try:
        job = Job(config, slots)
    except ValueError as error:
        print(f"shoalrun: error: {error}", file=sys.stderr)
        return 2
    return job.run()


def console_main() -> None:
    """The ``shoalrun`` console script."""
    sys.exit(main())
