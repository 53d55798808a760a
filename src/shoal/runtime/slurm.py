"""Slurm node lists: ``gpu[01-04]-ib``, ``a[1,3-5],b2``, ``rack[1-2]-n[01-02]`` expanded to host names.

``hostnames`` asks ``scontrol show hostnames`` when it is on the PATH (Slurm's own parser is the reference) and falls
back to ``expand_nodelist``, which follows the same rules: commas outside brackets separate entries; a bracket holds
comma-separated numbers and ``lo-hi`` ranges, zero-padded to the width written (``[08-10]`` gives 08, 09, 10);
several brackets in one entry give every combination, leftmost varying slowest; text around brackets is kept.

``allocation`` reads the allocation a process runs in (``salloc``, ``sbatch``): its nodes and tasks per node, which
shoalrun uses as its hosts and slots when no ``-H`` or hostfile is given.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

SCONTROL_TIMEOUT_S = 10.0
"""How long ``scontrol show hostnames`` may take before the built-in parser is used instead."""


class NodeListError(ValueError):
    """A Slurm node list that cannot be parsed."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise NodeListError(f"nested brackets in the Slurm node list {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise NodeListError(f"unbalanced ']' in the Slurm node list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise NodeListError(f"unclosed '[' in the Slurm node list {text!r}")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _bracket_values(body: str, whole: str) -> list[str]:
    """The values of one bracket, ``01-03,7`` -> ['01', '02', '03', '7']."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise NodeListError(f"bad range {item!r} in the Slurm node list {whole!r}")
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            values.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if high < low:
            raise NodeListError(f"descending range {item!r} in the Slurm node list {whole!r}")
        values.extend(f"{number:0{len(low_text)}d}" for number in range(low, high + 1))  # padded as written
    return values


def _expand_entry(entry: str, whole: str) -> list[str]:
    names = [""]
    for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", entry):
        names = [name + literal for name in names]
        if body:
            names = [name + value for name in names for value in _bracket_values(body, whole)]
    if "[]" in entry:
        raise NodeListError(f"empty brackets in the Slurm node list {whole!r}")
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host name of a Slurm node list, in Slurm's order, with duplicates kept out.

    Raises:
        NodeListError: unbalanced or nested brackets, a bad or descending range, an empty list.
    """
    text = nodelist.strip()
    if not text:
        raise NodeListError("the Slurm node list is empty")
    hosts: list[str] = []
    for entry in _split_top_level(text):
        entry = entry.strip()
        if not entry:
            raise NodeListError(f"empty entry in the Slurm node list {nodelist!r}")
        for name in _expand_entry(entry, nodelist):
            if name not in hosts:
                hosts.append(name)
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """The node list's hosts: from ``scontrol show hostnames`` when available, else from ``expand_nodelist``."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            done = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=SCONTROL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_nodelist(nodelist)


_TASK_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_counts(text: str) -> list[int]:
    """A Slurm per-node count list, ``2(x3),1`` -> [2, 2, 2, 1] (``SLURM_TASKS_PER_NODE``'s form).

    Raises:
        NodeListError: a malformed list.
    """
    counts: list[int] = []
    for item in text.split(","):
        match = _TASK_COUNT.fullmatch(item.strip())
        if match is None:
            raise NodeListError(f"bad per-node count {item!r} in {text!r}; expected forms such as 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation (``salloc``, ``sbatch``) this process runs in: its job id and tasks per node."""

    job_id: str
    nodes: tuple[tuple[str, int], ...]
    """Each node's host name and how many tasks the allocation has there, in Slurm's order."""

    @property
    def tasks(self) -> int:
        """The allocation's tasks on all its nodes."""
        return sum(count for _, count in self.nodes)

    def describe(self) -> str:
        """``localhost:2,node2:2``: the nodes as shoalrun's ``-H`` would write them."""
        return ",".join(f"{host}:{count}" for host, count in self.nodes)


def allocation(env: Mapping[str, str]) -> Allocation | None:
    """The Slurm allocation described by ``env`` (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``;
    inside an ``srun`` step, the step's node list and tasks), or None outside one. Without a task count, one task a
    node.

    Raises:
        NodeListError: a node list or count list that cannot be read, or counts that do not match the nodes.
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    counts_text = env.get("SLURM_TASKS_PER_NODE")
    if env.get("SLURM_STEP_NODELIST") and env.get("SLURM_STEP_TASKS_PER_NODE"):  # inside an srun step: the step's
        nodelist, counts_text = env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"]
    if not job_id or not nodelist:
        return None
    hosts = hostnames(nodelist)
    counts = expand_counts(counts_text) if counts_text else [1] * len(hosts)
    if len(counts) != len(hosts):
        raise NodeListError(
            f"Slurm job {job_id}: SLURM_TASKS_PER_NODE={counts_text!r} gives {len(counts)} counts for the "
            f"{len(hosts)} nodes of {nodelist!r}"
        )
    return Allocation(job_id, tuple(zip(hosts, counts, strict=True)))
