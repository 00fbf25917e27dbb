"""The config's JSON Schema (draft 2020-12), for editors: ``shardpool schema``.

Built from the code that validates, so the two agree: shardpool's keys and types from
:class:`~shardpool.config.schema.Config`, and every axolotl key of
:mod:`~shardpool.config.axolotl_keys` with the values it is accepted with (any value where it
is ignored; null, empty, ``false`` and its listed values where it is accepted only when off).
axolotl's spellings that parsing accepts are allowed too (``learning_rate: 2e-4`` read by YAML as a
string, ``lora_target_modules: all-linear``, the boolean attention keys, an empty ``fp16:``). The rules across keys
(``warmup_steps`` with ``warmup_ratio``, ...) and the files a config names are beyond a schema:
``shardpool validate`` checks those.
"""

from __future__ import annotations

from typing import Any

from shardpool.config.attention import ATTENTION_FLAGS
from shardpool.config.axolotl_keys import AXOLOTL_KEYS, AxolotlKey
from shardpool.config.parsing import AXOLOTL_DATASET_KEYS, FLOAT_KEYS, NULL_MEANS_DEFAULT
from shardpool.config.schema import Config

__all__ = ["DRAFT", "config_json_schema"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
#: A number as Python's float() reads a YAML string such as ``2e-4``.
_NUMBER_TEXT = {"type": "string", "pattern": r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"}
_OFF = [
    {"type": "null"},
    {"const": ""},
    {"type": "array", "maxItems": 0},
    {"type": "object", "maxProperties": 0},
]
_META_KEYS = ("default", "description", "title")


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema of a shardpool config file: every key shardpool reads or accepts from axolotl."""
    schema = Config.model_json_schema()
    properties: dict[str, Any] = schema["properties"]
    for key in FLOAT_KEYS & properties.keys():
        properties[key] = _also(properties[key], _NUMBER_TEXT)
    for key in NULL_MEANS_DEFAULT & properties.keys():
        properties[key] = _also(properties[key], {"type": "null"})
    properties["lora_target_modules"] = _also(properties["lora_target_modules"], {"const": "all-linear"})
    for flag, implementation in ATTENTION_FLAGS.items():
        properties.setdefault(
            flag,
            {
                "type": ["boolean", "null"],
                "description": f"true asks for `attn_implementation: {implementation}`",
            },
        )
    for rule in AXOLOTL_KEYS.values():
        properties.setdefault(rule.name, _axolotl_key(rule))
    dataset = schema["$defs"]["DatasetSpec"]["properties"]
    for key, why in AXOLOTL_DATASET_KEYS.items():
        accepted = [{"const": "json"}] if key == "ds_type" else []
        dataset.setdefault(key, {"anyOf": [*_OFF, *accepted], "description": f"accepted when off: {why}"})
    return {
        "$schema": DRAFT,
        "$id": "https://shardpool.dev/schema/config.json",
        "title": "shardpool config",
        "description": (
            "An axolotl-style QLoRA fine-tuning config with a `shardpool:` block (docs/config.md). "
            "Rules across keys and the files it names are checked by `shardpool validate`."
        ),
        **{key: value for key, value in schema.items() if key not in ("title", "description")},
    }


def _also(field: dict[str, Any], alternative: dict[str, Any]) -> dict[str, Any]:
    """``field``'s schema that also accepts ``alternative``, keeping its default and description."""
    meta = {key: field[key] for key in _META_KEYS if key in field}
    rest = {key: value for key, value in field.items() if key not in _META_KEYS}
    choices = rest["anyOf"] if list(rest) == ["anyOf"] else [rest]
    return {"anyOf": [*choices, alternative], **meta}


def _axolotl_key(rule: AxolotlKey) -> dict[str, Any]:
    """An axolotl key shardpool does not implement: any value where ignored, else only what is off."""
    if rule.treatment == "ignored":
        return {"description": f"axolotl key, accepted with no effect: {rule.why}"}
    choices = list(_OFF)
    if rule.false_is_off:
        choices.append({"const": False})
    choices += [{"const": value} for value in rule.accepted]
    return {"anyOf": choices, "description": f"axolotl key, accepted when {rule.accepted_text()}: {rule.why}"}
