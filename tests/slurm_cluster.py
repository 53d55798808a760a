"""A real single-node Slurm for the tests: munged, slurmctld and slurmd, each started in the foreground in a temporary
directory with its own key, configuration, state, spool, log and socket paths, and stopped by pid.

The node is ``localhost`` with this machine's cores (``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``:
no cgroups, no systemd). Client commands find the cluster through ``SLURM_CONF`` in ``SlurmCluster.env()``. Every wait
here is bounded, and a daemon that does not come up fails the fixture with its log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from conftest import clean_env, free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "scontrol", "squeue", "sinfo", "scancel")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
KILL_WAIT_S = 10
"""Seconds between a job's SIGTERM (requeue, cancel, time limit) and its SIGKILL: the checkpoint's window."""


def missing_commands() -> list[str]:
    """The Slurm and munge commands this machine lacks (.ci/run installs ``slurm-wlm`` and ``munge``)."""
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=_SEARCH_PATH) is None]


def _config(root: Path, ctld_port: int, slurmd_port: int) -> str:
    cpus = os.cpu_count() or 1
    return "\n".join(
        [
            "ClusterName=shoaltest",
            "SlurmctldHost=localhost",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmctldParameters=preempt_send_user_signal",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "JobRequeue=1",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=600",
            "InactiveLimit=0",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]
    )


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root``; ``start()`` waits for the node to be idle, ``stop()`` ends them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment (no launcher variables) whose Slurm commands reach this cluster."""
        return {**clean_env(), "SLURM_CONF": str(self.conf), **extra}

    def command(self, argv: list[str], timeout_s: float = 30.0, **options: object) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster, bounded by ``timeout_s``."""
        options.setdefault("env", self.env())
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, **options)  # type: ignore[call-overload]

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # kept open for the daemon's life
        path = shutil.which(argv[0], path=_SEARCH_PATH)
        assert path is not None, f"{argv[0]} is not installed"
        self.daemons[name] = subprocess.Popen([path, *argv[1:]], stdout=log, stderr=subprocess.STDOUT, env=self.env())

    def _logs(self) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def _wait(self, what: str, ready: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            exited = [name for name, process in self.daemons.items() if process.poll() is not None]
            if exited:
                raise RuntimeError(f"{', '.join(exited)} exited while waiting for {what}\n{self._logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self._logs()}")

    def start(self, timeout_s: float = 60.0) -> None:
        """Start munged, slurmctld and slurmd; return once ``sinfo`` shows the node idle."""
        for directory in ("munge", "state", "spool", "log"):
            (self.root / directory).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(_config(self.root, free_port(), free_port()))
        munge = self.root / "munge"
        self._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
                f"--log-file={self.root}/log/munged.log",
            ],
        )
        self._wait("munged's socket", lambda: (munge / "munge.socket").exists(), timeout_s)
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", "localhost"])

        def idle() -> bool:
            done = self.command(["sinfo", "-h", "-N", "-o", "%T"], timeout_s=10)
            return done.returncode == 0 and done.stdout.strip() == "idle"

        self._wait("the node to be idle in sinfo", idle, timeout_s)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``Restarts``, ...)."""
        done = self.command(["scontrol", "-o", "show", "job", job_id], timeout_s=10)
        if done.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {done.stderr.strip()}")
        fields = {}
        for word in done.stdout.split():
            name, _, value = word.partition("=")
            fields.setdefault(name, value)
        return fields

    def wait_job(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; return its fields (raises, with the job's fields, on timeout)."""
        deadline = time.monotonic() + timeout_s
        fields = self.job(job_id)
        while fields["JobState"] not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {fields['JobState']} after {timeout_s:.0f} s, not {states}: {fields}")
            time.sleep(0.2)
            fields = self.job(job_id)
        return fields

    def sbatch(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit a batch job from ``cwd`` (its working directory) with ``env`` (its environment); return its id."""
        done = self.command(["sbatch", "--parsable", *argv], cwd=cwd, env=env or self.env())
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def stop(self) -> None:
        """Cancel every job, then end the daemons this cluster started, by pid (SIGTERM, then SIGKILL)."""
        if self.daemons.get("slurmctld") is not None and self.daemons["slurmctld"].poll() is None:
            self.command(["scancel", "--full", "--user=root"], timeout_s=10)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.daemons.get(name)
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
