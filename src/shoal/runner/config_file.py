"""horovodrun's ``--config-file``: the same YAML sections and keys, applied under the flags given on the command line.

Example::

    params:        {fusion_threshold_mb: 32, cycle_time_ms: 1, cache_capacity: 1024, hierarchical_allreduce: true}
    timeline:      {filename: timeline.json, mark_cycles: false}
    stall_check:   {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
    library_options: {gloo_timeout_seconds: 600}
    logging:       {level: WARNING}

A flag given on the command line wins over the file. Keys for what Shoal does not have (MPI, NCCL streams, thread
affinity, hierarchical allgather, torus allreduce) are accepted when they ask for nothing (false, 0, or
the default) and refused otherwise, as is any key horovodrun does not know: a typo never passes silently.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Setter = Callable[[argparse.Namespace, Any], None]


def _set(dest: str, kind: type = float) -> Setter:
    def apply(args: argparse.Namespace, value: Any) -> None:
        setattr(args, dest, kind(value))

    return apply


def _hierarchical(args: argparse.Namespace, value: Any) -> None:
    args.hierarchical_allreduce, args.no_hierarchical_allreduce = bool(value), not bool(value)


def _log_level(args: argparse.Namespace, value: Any) -> None:
    args.log_level = str(value).upper()


def _unsupported(what: str, harmless: Callable[[Any], bool] = lambda v: not v) -> Setter:
    def apply(args: argparse.Namespace, value: Any) -> None:
        if not harmless(value):
            raise ValueError(f"{what} is not supported by shoalrun (remove it from the config file)")

    return apply


_SECTIONS: dict[str, dict[str, tuple[str, Setter]]] = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", _set("fusion_threshold_mb")),
        "cycle_time_ms": ("cycle_time_ms", _set("cycle_time_ms")),
        "cache_capacity": ("cache_capacity", _set("cache_capacity", int)),
        "hierarchical_allreduce": ("hierarchical_allreduce", _hierarchical),
        "hierarchical_allgather": ("", _unsupported("params.hierarchical_allgather")),
        "torus_allreduce": ("", _unsupported("params.torus_allreduce")),
    },
    "autotune": {
        "enabled": ("autotune", _set("autotune", bool)),
        "log_file": ("autotune_log_file", _set("autotune_log_file", str)),
        "warmup_samples": ("autotune_warmup_samples", _set("autotune_warmup_samples", int)),
        "steps_per_sample": ("autotune_steps_per_sample", _set("autotune_steps_per_sample", int)),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", _set("autotune_bayes_opt_max_samples", int)),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", _set("autotune_gaussian_process_noise")),
    },
    "timeline": {
        "filename": ("timeline_filename", _set("timeline_filename", str)),
        "mark_cycles": ("timeline_mark_cycles", _set("timeline_mark_cycles", bool)),
    },
    "stall_check": {
        "enabled": ("no_stall_check", lambda args, value: setattr(args, "no_stall_check", not value)),
        "warning_time_seconds": ("stall_check_warning_time_seconds", _set("stall_check_warning_time_seconds")),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", _set("stall_check_shutdown_time_seconds")),
    },
    "library_options": {
        "gloo_timeout_seconds": ("gloo_timeout_seconds", _set("gloo_timeout_seconds")),
        "mpi_threads_disable": ("", _unsupported("library_options.mpi_threads_disable")),
        "num_nccl_streams": ("", _unsupported("library_options.num_nccl_streams", lambda v: v in (None, 0, 1))),
        "thread_affinity": ("", _unsupported("library_options.thread_affinity", lambda v: v in (None, 0))),
    },
    "logging": {
        "level": ("log_level", _log_level),
        "with_timestamp": ("", _unsupported("logging.with_timestamp", lambda v: True)),
    },
}


def load_config(path: str) -> dict[str, Any]:
    """Read a horovodrun config file (YAML; needs PyYAML: ``pip install shoal[config]``)."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError as error:
        raise ValueError("--config-file needs PyYAML: pip install 'shoal[config]' (or pyyaml)") from error
    try:
        with open(path) as source:
            config = yaml.safe_load(source)
    except OSError as error:
        raise ValueError(f"cannot read config file {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path!r} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config file {path!r} must be a mapping of sections")
    return config


def apply_config(args: argparse.Namespace, config: dict[str, Any], given: set[str]) -> None:
    """Set ``args`` from ``config`` except the destinations in ``given`` (flags on the command line win).

    Raises:
        ValueError: an unknown section or key, an unsupported setting, or a value of the wrong type.
    """
    controller = config.get("controller")
    if controller is not None and str(controller).lower() != "gloo":
        raise ValueError(f"controller {controller!r} is not supported by shoalrun; Shoal runs over gloo (and NCCL)")
    for section, values in config.items():
        if section == "controller":
            continue
        known = _SECTIONS.get(section)
        if known is None:
            raise ValueError(f"unknown config file section {section!r} (known: controller, {', '.join(_SECTIONS)})")
        if not isinstance(values, dict):
            raise ValueError(f"config file section {section!r} must be a mapping")
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown key {section}.{key} in the config file (known: {', '.join(known)})")
            dest, setter = known[key]
            if dest and dest in given:
                continue
            try:
                setter(args, value)
            except (TypeError, ValueError) as error:
                if "not supported" in str(error):
                    raise
                raise ValueError(f"config file {section}.{key}: bad value {value!r}") from None
