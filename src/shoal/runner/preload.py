"""What a worker's fork server preloads (``shoalrun --preload``), and which worker commands can be forked at all.

``--preload auto`` (the default) reads the script's (or module's, or ``-c`` code's) top-level imports and preloads
torch for torch, Lightning and ``shoal.torch``/``horovod.torch``, TensorFlow for TensorFlow, tf_keras and
``shoal.tensorflow``/``shoal.keras`` (Keras follows ``KERAS_BACKEND``); nothing, and no server, for anything else.
``--preload MODULES`` names them; ``--preload none`` starts every worker afresh. A worker can be forked only when its
command is this Python interpreter running a script, ``-m`` module or ``-c`` code (with at most ``-u``).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.config import LAUNCHER_PID_ENV

FRAMEWORK_MODULES = {
    "torch": ("torch", "torch.distributed", "torch._dynamo"),
    "tensorflow": ("tensorflow",),
}
"""What preloading a framework imports: torch._dynamo too, which torch imports the first time an optimizer steps."""
_FRAMEWORK_OF = {
    "torch": "torch",
    "lightning": "torch",
    "pytorch_lightning": "torch",
    "shoal.torch": "torch",
    "horovod.torch": "torch",
    "tensorflow": "tensorflow",
    "tf_keras": "tensorflow",
    "shoal.tensorflow": "tensorflow",
    "horovod.tensorflow": "tensorflow",
}
_KERAS = ("keras", "shoal.keras", "horovod.keras")


@dataclass(frozen=True)
class PythonCommand:
    """A worker command this interpreter can run from a fork server: ``kind`` is script, module or code."""

    kind: str
    target: str
    args: tuple[str, ...]

    def request(self, env: Mapping[str, str], cwd: str) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "args": list(self.args),
            "env": dict(env),
            "cwd": cwd,
            "launcher_env": LAUNCHER_PID_ENV,
        }


def python_command(command: Sequence[str], env: Mapping[str, str]) -> PythonCommand | None:
    """``command`` as a script, module or code run by this interpreter (``sys.executable``, or another name for it in
    the same directory); None when it is anything else, or passes the interpreter options other than ``-u``."""
    if not command:
        return None
    found = command[0] if os.sep in command[0] else _which(command[0], env)
    if found is None or not _same_interpreter(found):
        return None
    rest = list(command[1:])
    while rest[:1] == ["-u"]:
        rest.pop(0)
    if not rest:
        return None
    first = rest[0]
    if first in ("-m", "-c"):
        if len(rest) < 2:
            return None
        return PythonCommand("module" if first == "-m" else "code", rest[1], tuple(rest[2:]))
    if first.startswith("-") or not os.path.isfile(first):
        return None
    return PythonCommand("script", first, tuple(rest[1:]))


def _which(name: str, env: Mapping[str, str]) -> str | None:
    return shutil.which(name, path=env.get("PATH"))


def _same_interpreter(path: str) -> bool:
    """The same executable, found in the same directory (a virtual environment's ``python`` is a link to the base
    interpreter, with other packages)."""
    ours = os.path.abspath(sys.executable)
    theirs = os.path.abspath(path)
    try:
        return os.path.dirname(theirs) == os.path.dirname(ours) and os.path.samefile(theirs, ours)
    except OSError:
        return False


def preload_modules(setting: str, command: PythonCommand, env: Mapping[str, str]) -> tuple[str, ...]:
    """What the fork server imports for ``command`` under ``--preload setting``: nothing for ``none``, the named
    modules, or (``auto``) the modules of the frameworks its top-level imports name."""
    if setting == "none":
        return ()
    if setting != "auto":
        return tuple(name.strip() for name in setting.split(",") if name.strip())
    frameworks: set[str] = set()
    for name in top_level_imports(command):
        parts = name.split(".")
        for prefix in (".".join(parts[:end]) for end in range(len(parts), 0, -1)):  # the longest known prefix
            if prefix in _KERAS:
                frameworks |= {env.get("KERAS_BACKEND", "tensorflow")} & set(FRAMEWORK_MODULES)
                break
            if prefix in _FRAMEWORK_OF:
                frameworks.add(_FRAMEWORK_OF[prefix])
                break
    return tuple(module for framework in sorted(frameworks) for module in FRAMEWORK_MODULES[framework])


def top_level_imports(command: PythonCommand) -> set[str]:
    """The modules a script's, module's or code's top level imports (also under ``if``, ``try`` and ``with``; not
    inside functions), each also with its ``from`` names (``from shoal import torch`` gives ``shoal.torch``); empty
    when the source cannot be found or read."""
    source = command.target if command.kind == "code" else _source_of(command)
    if source is None:
        return set()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return names


def _source_of(command: PythonCommand) -> str | None:
    path = command.target if command.kind == "script" else _module_file(command.target)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            return source.read()
    except (OSError, UnicodeDecodeError):
        return None


def _module_file(name: str) -> str | None:
    """Where ``python -m name`` would find its source, searched from the working directory without importing any
    package on the way (a package runs its ``__main__``)."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:
        spec = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None
