"""``--config-file``: elasticrun's flags from a YAML file, horovodrun's keys included.

The file's settings come first and the command line's after them, so a flag
given on the command line wins (as with horovodrun). Two kinds of keys:

* horovodrun's sections (``params``, ``autotune``, ``timeline``, ``stall_check``,
  ``library_options``, ``logging``, ``controller``, ``verbose``): each key maps
  onto the horovodrun flag elasticrun takes for it (a flag that means nothing
  here prints its warning, as on the command line);
* ours: any elasticrun flag by its long name, with ``-`` or ``_``
  (``min-np: 2``, ``host_discovery_script: ./discover.sh``,
  ``blacklist-cooldown-range: [10, 100]``, ``verbose: true``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    from elastic.usage import Flag

# (section, key) -> the horovodrun flag it stands for
HOROVOD_KEYS = {
    ("params", "fusion_threshold_mb"): "--fusion-threshold-mb",
    ("params", "cycle_time_ms"): "--cycle-time-ms",
    ("params", "cache_capacity"): "--cache-capacity",
    ("params", "hierarchical_allreduce"): "--hierarchical-allreduce",
    ("params", "hierarchical_allgather"): "--hierarchical-allgather",
    ("autotune", "enabled"): "--autotune",
    ("autotune", "log_file"): "--autotune-log-file",
    ("autotune", "warmup_samples"): "--autotune-warmup-samples",
    ("autotune", "steps_per_sample"): "--autotune-steps-per-sample",
    ("autotune", "bayes_opt_max_samples"): "--autotune-bayes-opt-max-samples",
    ("autotune", "gaussian_process_noise"): "--autotune-gaussian-process-noise",
    ("timeline", "filename"): "--timeline-filename",
    ("timeline", "mark_cycles"): "--timeline-mark-cycles",
    ("stall_check", "warning_time_seconds"): "--stall-check-warning-time-seconds",
    ("stall_check", "shutdown_time_seconds"): "--stall-check-shutdown-time-seconds",
    ("library_options", "mpi_threads_disable"): "--mpi-threads-disable",
    ("library_options", "num_nccl_streams"): "--num-nccl-streams",
    ("library_options", "ccl_bgt_affinity"): "--ccl-bgt-affinity",
    ("library_options", "gloo_timeout_seconds"): "--gloo-timeout-seconds",
    ("logging", "level"): "--log-level",
    ("logging", "hide_timestamp"): "--log-hide-timestamp",
}
NOT_IN_A_FILE = {"--config-file", "--help", "--version", "--join", "--check-build"}


class ConfigFileError(ElasticError):
    """The file cannot be used; str() is the one line the user sees."""


def load(path: str) -> dict[Any, Any]:
    """The file's top-level mapping."""
    try:
        import yaml
    except ImportError:
        raise ConfigFileError("--config-file needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as f:
            value = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"--config-file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigFileError(f"--config-file {path!r} is not YAML{line}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigFileError(f"--config-file {path!r}: expected a mapping of settings")
    return value


def to_argv(path: str, options: Mapping[str, Flag]) -> list[str]:
    """The flags the file stands for. ``options`` maps each option string to its
    usage.Flag (``parser.flags``)."""
    argv: list[str] = []
    for key, value in load(path).items():
        key = str(key)
        if isinstance(value, dict):
            for inner, inner_value in value.items():
                argv += _horovod_entry(path, key, str(inner), inner_value, options)
        elif key == "controller":
            if str(value) not in ("gloo", "mpi"):
                raise ConfigFileError(f"--config-file {path}: controller must be gloo or mpi, "
                                      f"got {value!r}")
            argv.append(f"--{value}")
        else:
            flag = "--" + key.replace("_", "-")
            if flag not in options or flag in NOT_IN_A_FILE:
                raise ConfigFileError(f"--config-file {path}: {key!r} is not an elasticrun "
                                      "flag or a horovodrun setting")
            argv += _flag(path, key, flag, value, options[flag])
    return argv


def _horovod_entry(path: str, section: str, key: str, value: object,
                   options: Mapping[str, Flag]) -> list[str]:
    if section == "stall_check" and key == "enabled":
        return [] if value else ["--no-stall-check"]
    flag = HOROVOD_KEYS.get((section, key))
    if flag is None:
        raise ConfigFileError(f"--config-file {path}: '{section}.{key}' is not a horovodrun "
                              "setting elasticrun knows")
    if flag == "--log-level":
        value = str(value).upper()
    return _flag(path, f"{section}.{key}", flag, value, options[flag])


def _flag(path: str, name: str, flag: str, value: object, action: Flag) -> list[str]:
    """``action``: the flag's usage.Flag."""
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config-file {path}: {name} must be true or false, "
                                  f"got {value!r}")
        return [flag] if value else []
    if value is None or isinstance(value, dict):
        raise ConfigFileError(f"--config-file {path}: {name} needs a value")
    values = value if isinstance(value, list) else [value]
    if isinstance(action.nargs, int):
        if len(values) != action.nargs:
            raise ConfigFileError(f"--config-file {path}: {name} needs {action.nargs} values")
        return [flag] + [str(v) for v in values]
    if len(values) != 1 and not action.repeatable:
        raise ConfigFileError(f"--config-file {path}: {name} takes one value")
    out = []
    for v in values:
        out += [flag, str(v)]
    return out
