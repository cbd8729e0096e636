"""The config key inventory (tests/data/config_keys.toml): every ``section.key`` of the schema,
each marked ``user`` (real training runs) or ``study`` (benchmarks and studies only). Adding,
removing or moving a key means updating the inventory in the same change, and a study key
lives in the ``[study]`` section (``StudyConfig``), never beside the user keys."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from moe_train import config

INVENTORY = Path(__file__).parent / "data" / "config_keys.toml"
WHERE = "tests/data/config_keys.toml"  # in failure messages
KINDS = ("user", "study")
STUDY = "study"  # the section of the benchmark-only keys


def schema_keys() -> dict[str, str]:
    """``section.key`` -> the dataclass that declares it, for every field of every section."""
    keys = {}
    for section in dataclasses.fields(config.Config):
        cls = type(getattr(config.Config(), section.name))
        keys |= {f"{section.name}.{f.name}": cls.__name__ for f in dataclasses.fields(cls)}
    return keys


def inventory() -> dict[str, str]:
    """``section.key`` -> ``user`` | ``study``, as the inventory file lists them."""
    tables = tomllib.loads(INVENTORY.read_text())
    return {f"{section}.{key}": kind for section, keys in tables.items() for key, kind in keys.items()}


def test_the_inventory_lists_exactly_the_schemas_keys():
    schema, listed = schema_keys(), inventory()
    missing = sorted(set(schema) - set(listed))
    extra = sorted(set(listed) - set(schema))
    problems = [
        f"{key} (a field of {schema[key]}) is not in {WHERE}: add "
        f'`{key.split(".")[1]} = "user"` (or "study", benchmark-only keys) under [{key.split(".")[0]}] there'
        for key in missing
    ] + [
        f"{key} is in {WHERE} but not in the schema: remove it there, or add the field to its "
        f"section in moe_train/config/schema.py"
        for key in extra
    ]
    assert not problems, "\n".join(problems)


def test_every_inventory_entry_is_user_or_study():
    bad = {key: kind for key, kind in inventory().items() if kind not in KINDS}
    assert not bad, f"{WHERE}: each key is one of {KINDS}, not: {bad}"


def test_study_keys_live_in_the_study_section_and_only_there():
    listed = inventory()
    outside = sorted(k for k, kind in listed.items() if kind == "study" and not k.startswith(f"{STUDY}."))
    inside = sorted(k for k, kind in listed.items() if kind == "user" and k.startswith(f"{STUDY}."))
    problems = [
        f"{key} is a study key outside [{STUDY}]: move the field to StudyConfig (study.{key.split('.')[1]}) "
        f"in moe_train/config/schema.py and its readers, or mark it user"
        for key in outside
    ] + [
        f"{key} is in [{STUDY}] but marked user: a key real runs set belongs in another section"
        for key in inside
    ]
    assert not problems, "\n".join(problems)


def test_a_real_run_leaves_the_study_keys_at_their_defaults():
    assert config.study_changes(config.Config()) == []
    for preset in config.list_presets():  # presets are real runs
        assert config.study_changes(config.load_preset(preset)) == [], preset


@pytest.mark.parametrize(
    "overrides, changed",
    [
        (["study.router=balanced"], ["study.router=balanced"]),
        (["study.capacity_factor=1.25"], ["study.capacity_factor=1.25"]),
        (["study.router=learned", "study.capacity_factor=0"], []),
    ],
)
def test_study_changes_names_each_key_off_its_default(overrides, changed):
    assert config.study_changes(config.build("tiny", overrides)) == changed
