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

from collections.abc import Callable
from typing import Any

from shoal.config import EngineConfig, LaunchConfig, Setting, settings


def _unsupported(what: str, harmless: Callable[[Any], bool] = lambda v: not v) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not harmless(value):
            raise ValueError(f"{what} is not supported by shoalrun (remove it from the config file)")

    return check


_UNSUPPORTED: dict[str, Callable[[Any], None]] = {
    "params.hierarchical_allgather": _unsupported("params.hierarchical_allgather"),
    "params.torus_allreduce": _unsupported("params.torus_allreduce"),
    "library_options.mpi_threads_disable": _unsupported("library_options.mpi_threads_disable"),
    "library_options.num_nccl_streams": _unsupported("library_options.num_nccl_streams", lambda v: v in (None, 0, 1)),
    "library_options.thread_affinity": _unsupported("library_options.thread_affinity", lambda v: v in (None, 0)),
    "logging.with_timestamp": _unsupported("logging.with_timestamp", lambda v: True),
}
"""horovodrun's keys for what Shoal does not have: accepted when they ask for nothing."""


def _keys() -> dict[str, tuple[Setting, bool]]:
    """Every config-file key that sets a knob: ``section.key`` -> (the setting, whether it is an engine setting)."""
    keys: dict[str, tuple[Setting, bool]] = {}
    for cls, engine in ((LaunchConfig, False), (EngineConfig, True)):
        for setting in settings(cls):
            if setting.knob.config_key is not None:
                keys[setting.knob.config_key] = (setting, engine)
    return keys


def _value(setting: Setting, value: Any) -> Any:
    """A config-file value as the field holds it (in the flag's unit, scaled; negated for ``stall_check.enabled``)."""
    if setting.kind is bool:
        return not bool(value) if setting.knob.inverted else bool(value)
    read = setting.knob.flag_type or setting.kind
    return setting.from_flag(read(str(value) if setting.kind is str else value))


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


def apply_config(config: LaunchConfig, file: dict[str, Any], given: set[str]) -> None:
    """Set ``config`` from ``file`` except the settings named in ``given`` (flags on the command line win).

    Raises:
        ValueError: an unknown section or key, an unsupported setting, or a value of the wrong type.
    """
    controller = file.get("controller")
    if controller is not None and str(controller).lower() != "gloo":
        raise ValueError(f"controller {controller!r} is not supported by shoalrun; Shoal runs over gloo (and NCCL)")
    keys = _keys()
    sections = dict.fromkeys(k.partition(".")[0] for k in (*keys, *_UNSUPPORTED))
    for section, values in file.items():
        if section == "controller":
            continue
        if section not in sections:
            raise ValueError(f"unknown config file section {section!r} (known: controller, {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ValueError(f"config file section {section!r} must be a mapping")
        for key, value in values.items():
            name = f"{section}.{key}"
            if name in _UNSUPPORTED:
                _UNSUPPORTED[name](value)
                continue
            if name not in keys:
                known = [k.partition(".")[2] for k in (*keys, *_UNSUPPORTED) if k.startswith(section + ".")]
                raise ValueError(f"unknown key {name} in the config file (known: {', '.join(known)})")
            setting, engine = keys[name]
            if setting.name in given:
                continue
            try:
                converted = _value(setting, value)
            except (TypeError, ValueError):
                raise ValueError(f"config file {name}: bad value {value!r}") from None
            if engine:
                config.engine[setting.name] = converted
            else:
                setattr(config, setting.name, converted)
