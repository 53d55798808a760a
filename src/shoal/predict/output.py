"""The JSON result line every benchmark and the predictor end with, and its ``--json PATH`` copy."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json PATH``: also write the result object to a file (``python -m shoal.bench.plot`` draws from it)."""
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result to this file")


def emit(result: dict[str, Any], json_path: str | None) -> None:
    """Print the result as the last line (the contract) and, with ``--json``, write it to ``json_path``."""
    print(json.dumps(result), flush=True)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as target:
            json.dump(result, target, indent=1)
