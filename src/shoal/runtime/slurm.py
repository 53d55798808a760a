"""Slurm node lists: ``gpu[01-04]-ib``, ``a[1,3-5],b2``, ``rack[1-2]-n[01-02]`` expanded to host names.

``hostnames`` asks ``scontrol show hostnames`` when it is on the PATH (Slurm's own parser is the reference) and falls
back to ``expand_nodelist``, which follows the same rules: commas outside brackets separate entries; a bracket holds
comma-separated numbers and ``lo-hi`` ranges, zero-padded to the width written (``[08-10]`` gives 08, 09, 10);
several brackets in one entry give every combination, leftmost varying slowest; text around brackets is kept.
"""

from __future__ import annotations

import re
import shutil
import subprocess

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
