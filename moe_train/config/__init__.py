"""Run configuration: frozen dataclasses, TOML presets, dotted ``--set`` overrides.

A run's config is built in three layers: the dataclass defaults (``moe_train.config.schema``,
re-exported here), a preset file from
``moe_train/config/presets/<name>.toml``, then ``--set section.key=value`` overrides and command-line
flags (``build(..., flags=)``; one key given twice with different values is an error). Unknown
presets, sections and keys are rejected with the list of valid choices; ``validate`` checks
every field's range, the size limits and the cross-field rules (``moe_train.config.checks``)
before anything is compiled. The resolved config is written to ``<out>/config.json``.
A ``tuple[float, ...]`` field (``moe.capacity_buckets``) is a TOML array, a JSON list or, on
``--set``, comma-separated numbers, and is kept sorted; config.json files written when it was
a comma-separated string still load.

The ``[study]`` section (``StudyConfig``) holds the keys that exist for benchmarks and
studies only (forced-balance routing, the token-dropping baseline); a real training run
leaves them at their defaults (``study_changes`` lists those that are not).

``parallel.cluster`` names a cluster preset (``topology.presets``): it is checked where the
preset is read, when the trainer builds its mesh (``topology.device_mesh``), exit 2 naming
the key, before anything is written.

May import: ``moe_train.base`` and nothing else of the kit, no JAX either: ``make plan`` and
the launcher build configs without it, ``moe_train.parallel.jobplan`` builds on ``checks``
and ``schema``, and ``topology`` builds on the config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from moe_train.base.tomlfile import read_toml
from moe_train.config import checks
from moe_train.config.checks import ConfigError, some_divisors  # noqa: F401 (API)
from moe_train.config.schema import (  # noqa: F401 (API: the sections, choices, derived sizes)
    ATTENTION,
    ATTENTION_KINDS,
    BACKENDS,
    CHOICES,
    COMPUTE,
    DATA_SOURCES,
    DISPATCHERS,
    DTYPES,
    FP8_BACKENDS,
    FP8_RECIPES,
    ON_NONFINITE,
    REMAT_POLICIES,
    ROPE_LAYOUTS,
    ROPE_SCALINGS,
    SCORE_FUNCTIONS,
    TOKEN_DTYPES,
    WEIGHT_GATHERS,
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RopeConfig,
    StudyConfig,
    TrainConfig,
    attention_dims,
    compute_dtype,
    head_dim,
    moe_layer_count,
    study_changes,
)

PRESET_DIR = Path(__file__).parent / "presets"


def section_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _is_floats(typ: Any) -> bool:
    """Whether ``typ`` is ``tuple[float, ...]``: a set of factors, kept sorted."""
    return get_origin(typ) is tuple and get_args(typ) == (float, ...)


def _parse_value(text: str, typ: type, key: str) -> Any:
    if _is_floats(typ):  # --set key=1.0,1.25
        return checks.parse_floats(text, key)
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {typ.__name__}, got {text!r}") from None


def _check_floats(value: Any, key: str) -> tuple[float, ...]:
    """A TOML array or JSON list of numbers, or the comma-separated text of config.json files
    written before the field was a tuple, as a sorted tuple of floats."""
    if isinstance(value, str):
        return checks.parse_floats(value, key)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        return tuple(sorted(float(v) for v in value))
    raise ConfigError(f"{key}: expected a list of numbers such as [1.0, 1.25, 1.5, 2.0], got {value!r}")


def _check_type(value: Any, typ: type, key: str) -> Any:
    if _is_floats(typ):
        return _check_floats(value, key)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")
    return value


def _section_update(section: Any, name: str, values: dict[str, Any], parse: bool) -> Any:
    hints = get_type_hints(type(section))
    valid = [f.name for f in dataclasses.fields(section)]
    changes = {}
    for key, value in values.items():
        if key not in valid:
            raise ConfigError(f"unknown key {name}.{key}; valid keys in [{name}]: {', '.join(valid)}")
        typ = hints[key]
        dotted = f"{name}.{key}"
        changes[key] = _parse_value(value, typ, dotted) if parse else _check_type(value, typ, dotted)
    return dataclasses.replace(section, **changes)


def apply_tables(cfg: Config, tables: dict[str, Any], parse: bool = False) -> Config:
    """Overlay ``{section: {key: value}}`` onto ``cfg``; unknown names raise ConfigError."""
    changes = {}
    for name, values in tables.items():
        if name not in section_names():
            raise ConfigError(f"unknown section {name!r}; valid sections: {', '.join(section_names())}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys")
        changes[name] = _section_update(getattr(cfg, name), name, values, parse)
    return dataclasses.replace(cfg, **changes)


def load_preset(name: str) -> Config:
    """A shipped preset by name, or a preset file by path (``*.toml``, e.g. the
    ``preset.toml`` of ``python -m moe_train.convert from-hf``)."""
    path = Path(name) if name.endswith(".toml") else PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset {name!r}; valid presets: {', '.join(list_presets())} or the path of a .toml file"
        )
    return apply_tables(Config(), read_toml(path, ConfigError, what="preset "))


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """``["moe.top_k=4", ...]`` -> ``{"moe": {"top_k": "4"}}``."""
    tables: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not field:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        tables.setdefault(section, {})[field] = value
    return tables


def _same_value(key: str, a: str, b: str) -> bool:
    """Whether two value texts of ``key`` mean the same (``2`` and ``2.0`` for a float)."""
    if a.strip() == b.strip():
        return True
    section, _, field = key.partition(".")
    typ = get_type_hints(type(getattr(Config(), section, None))).get(field)
    try:
        return typ is not None and _parse_value(a, typ, key) == _parse_value(b, typ, key)
    except ConfigError:
        return False


def merge_flags(overrides: list[str], flags: dict[str, tuple[str, str]] | None = None) -> list[str]:
    """``flags`` (``{"--devices": ("parallel.devices", "2")}``) then ``--set`` items, as one
    list of overrides; a key given twice with different values is a ConfigError naming both."""
    flags = flags or {}
    given = [(f"{flag} {value}", key, value) for flag, (key, value) in flags.items()]
    given += [
        (f"--set {item}", item.partition("=")[0].strip(), item.partition("=")[2])
        for item in overrides
        if "=" in item
    ]
    seen: dict[str, tuple[str, str]] = {}  # key -> (how it was first given, value text)
    for how, key, value in given:
        if key in seen and not _same_value(key, seen[key][1], value):
            raise ConfigError(f"{seen[key][0]} and {how} disagree; give one")
        seen.setdefault(key, (how, value))
    return [f"{key}={value}" for key, value in flags.values()] + list(overrides)


def build(
    preset: str,
    overrides: Sequence[str] = (),
    *,
    flags: dict[str, tuple[str, str]] | None = None,
    **sections: dict[str, Any],
) -> Config:
    """Preset + typed section overrides (from code) + textual ``--set`` overrides and
    command-line ``flags`` (flag -> (dotted key, value text)), validated.

    A command line passes ``flags`` (``{}`` when it has none): then a key given twice with
    different values is one error (``merge_flags``). Code composing overrides leaves it
    None: a later override of the same key wins."""
    cfg = load_preset(preset)
    if sections:
        cfg = apply_tables(cfg, sections)
    overrides = list(overrides) if flags is None else merge_flags(list(overrides), flags)
    cfg = apply_tables(cfg, parse_overrides(overrides), parse=True)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Every field's range or choices, the size limits and the cross-field rules, before
    compiling; ConfigError (one line: key, value, what is valid) for the first problem."""
    checks.check_ranges(cfg)
    checks.check_sizes(cfg)
    for key, choices in CHOICES.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")
    checks.check_rules(cfg)


def for_devices(cfg: Config, devices: int) -> Config:
    """``cfg`` on a job of ``devices`` (batch-sharded) devices: ``train.micro_batch_size``
    turned into the ``train.micro_batches`` it means there. ``batch_size`` must already
    divide over the devices."""
    t = cfg.train
    if not t.micro_batch_size:
        return cfg
    per = t.batch_size // devices
    if per % t.micro_batch_size:
        raise checks.micro_batch_size_error(cfg, per, devices)
    train = dataclasses.replace(t, micro_batches=per // t.micro_batch_size, micro_batch_size=0)
    return dataclasses.replace(cfg, train=train)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> Config:
    """A stored config (``to_dict``'s); unknown sections and keys raise ConfigError."""
    return apply_tables(Config(), d)


def save_json(cfg: Config, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
