"""Reading a config: YAML to a validated :class:`Config`, with every problem reported at once.

Order: axolotl keys shardpool does not implement are accepted when they change nothing, else
refused (:mod:`shardpool.config.axolotl_keys`), and a key left empty whose default is false
(``fp16:``) is unset; axolotl spellings are normalized (``2e-4``,
``lora_target_modules: all-linear``); then the schema validates types and the rules across keys.
Every problem found on the way is collected and raised as one :class:`ShardpoolError`. Nothing
here imports torch: a config is validated in well under a second.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardpool.config.attention import ATTENTION_FLAGS
from shardpool.config.axolotl_keys import AXOLOTL_KEYS, is_off
from shardpool.config.problems import Problem, problems_error
from shardpool.config.schema import COLLECT_PROBLEMS, Config, DatasetSpec
from shardpool.errors import ShardpoolError

__all__ = [
    "load_config",
    "parse_config",
    "sequence_len_refusal",
    "AXOLOTL_DATASET_KEYS",
    "FLOAT_KEYS",
    "NULL_MEANS_DEFAULT",
]

#: Keys of an axolotl dataset entry that DatasetSpec lacks: accepted when null or empty, else refused.
AXOLOTL_DATASET_KEYS: dict[str, str] = dict.fromkeys(
    (
        "input_transform shards shards_idx preprocess_shards input_format "
        "trust_remote_code revision logprobs_field temperature"
    ).split(),
    "not built in shardpool yet; datasets are files, directories or hub datasets read whole (docs/data.md)",
)
AXOLOTL_DATASET_KEYS.update(
    dict.fromkeys(
        (
            "field_human field_model field_tools field_thinking template_thinking_key "
            "message_field_training message_field_training_detail split_thinking"
        ).split(),
        "not built for chat datasets yet; turns are trained by `roles_to_train` and `train_on_eos` "
        "(docs/data.md)",
    )
)
AXOLOTL_DATASET_KEYS["conversation"] = (
    "fastchat conversation templates are not built; set `chat_template: chatml` (or another template) instead"
)

#: Float keys that also take a YAML int or a number written as a string (``2e-4``).
FLOAT_KEYS = frozenset(
    {
        "lora_alpha", "lora_dropout", "val_set_size", "num_epochs", "learning_rate", "warmup_ratio",
        "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "cosine_min_lr_ratio",
    }
)  # fmt: skip

#: Top-level keys whose default is false: left empty (null), as axolotl's examples write ``fp16:``,
#: they are unset, which is what axolotl reads an empty key as.
NULL_MEANS_DEFAULT = frozenset(name for name, field in Config.model_fields.items() if field.default is False)

# Placeholders for required keys whose value is broken, so the rest of the config is still checked.
_PLACEHOLDERS: dict[str, Any] = {"base_model": "-", "datasets": [{"path": "-"}]}
_DEFAULT_SEQUENCE_LEN: int = Config.model_fields["sequence_len"].default


def load_config(path: str | Path, *, model_config: str | Path | None = None) -> Config:
    """Read and validate a YAML config file, raising ShardpoolError that lists every problem.

    ``model_config`` is the model's ``config.json`` (or its directory) when it is not base_model's
    (``shardpool plan --model``); ``sequence_len`` is checked against it.
    """
    config_path = Path(path)
    if not config_path.is_file():
        raise ShardpoolError(f"config file {str(config_path)!r} does not exist; check the path")
    try:
        raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ShardpoolError(f"{config_path} is not valid YAML{where}; fix the syntax") from None
    except UnicodeDecodeError as error:
        raise ShardpoolError(f"{config_path} is not UTF-8 (byte {error.start}); save it as UTF-8") from None
    return parse_config(raw, source=str(config_path), model_config=model_config)


def parse_config(raw: Any, *, source: str = "config", model_config: str | Path | None = None) -> Config:
    """Validate an already-parsed config mapping (the YAML's top level), reporting every problem.

    ``model_config``: as for :func:`load_config`.
    """
    if not isinstance(raw, dict):
        raise ShardpoolError(f"{source} must be a mapping of keys to values at the top level")
    problems: list[Problem] = []
    data = _without_axolotl_noops(raw, problems)
    data = _normalized(data, problems)
    config = _validated(data, source, problems)
    problems += _sequence_len_problems(data, source, model_config)
    if problems or config is None:
        raise problems_error(problems, source)
    return config


def _sequence_len_problems(
    data: dict[str, Any], source: str, model_config: str | Path | None
) -> list[Problem]:
    """``sequence_len`` above the model's ``max_position_embeddings``, which training cannot use.

    Reads only the model's ``config.json`` (base_model's unless ``model_config`` names another;
    no torch). A model that is missing, broken or a hub id is checked later, when the model is
    read (:func:`shardpool.model.shape.check_sequence_len`).
    """
    base_model, sequence_len = data.get("base_model"), data.get("sequence_len", _DEFAULT_SEQUENCE_LEN)
    if not isinstance(sequence_len, int) or isinstance(sequence_len, bool):
        return []
    if model_config is not None:
        config_json = Path(model_config)
        config_json = config_json / "config.json" if config_json.is_dir() else config_json
    elif isinstance(base_model, str):
        config_json = Path(base_model) / "config.json"
    else:
        return []
    message = sequence_len_refusal(sequence_len, config_json, defaulted="sequence_len" not in data)
    return [] if message is None else [Problem("sequence_len", f"{source}: {message}", message)]


def sequence_len_refusal(sequence_len: int, config_json: Path, *, defaulted: bool = False) -> str | None:
    """The line refusing ``sequence_len`` above the ``max_position_embeddings`` of ``config_json``.

    None when it fits, or when the file or the key is absent or broken (nothing to compare).
    ``defaulted`` says the config left ``sequence_len`` at its default.
    """
    limit = _max_position_embeddings(config_json)
    if limit is None or sequence_len <= limit:
        return None
    shown = f"`sequence_len` {sequence_len}" + (" (the default)" if defaulted else "")
    return (
        f"{shown} is above the model's max_position_embeddings {limit} ({config_json}); "
        f"lower `sequence_len` to {limit} or less"
    )


def _max_position_embeddings(config_json: Path) -> int | None:
    """The model's ``max_position_embeddings``, or None where the file or the key is absent or broken."""
    try:
        model_config = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    limit = model_config.get("max_position_embeddings") if isinstance(model_config, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        return None
    return limit


def _refused(key: str, why: str) -> Problem:
    line = f"`{key}` is not supported by shardpool: {why}"
    return Problem(key, line, line)


def _without_axolotl_noops(raw: dict[Any, Any], problems: list[Problem]) -> dict[str, Any]:
    """``raw`` without the axolotl keys that change nothing; the others become problems."""
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key)
        rule = None if name in Config.model_fields else AXOLOTL_KEYS.get(name)
        if value is None and name in NULL_MEANS_DEFAULT:
            continue
        if rule is None:
            kept[name] = value
        elif not rule.accepts(value):
            problems.append(_refused(name, rule.why))
    if isinstance(kept.get("datasets"), list):
        kept["datasets"] = [
            _dataset_without_noops(entry, index, problems) for index, entry in enumerate(kept["datasets"])
        ]
    return kept


def _dataset_without_noops(entry: Any, index: int, problems: list[Problem]) -> Any:
    if not isinstance(entry, dict):
        return entry
    kept: dict[str, Any] = {}
    for key, value in entry.items():
        name = str(key)
        if name in DatasetSpec.model_fields or name not in AXOLOTL_DATASET_KEYS:
            kept[name] = value
        elif not (is_off(value)):
            problems.append(_refused(f"datasets[{index}].{name}", AXOLOTL_DATASET_KEYS[name]))
    return kept


def _normalized(data: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """axolotl spellings in shardpool's form: numbers written as strings, ``all-linear``."""
    normalized = _attention_flags_folded(_coerce_numbers(data), problems)
    targets = normalized.get("lora_target_modules")
    if targets == "all-linear" or targets == ["all-linear"]:
        if normalized.get("lora_target_linear") is False:
            message = "`lora_target_modules: all-linear` and `lora_target_linear: false` disagree; remove one"
            problems.append(Problem("lora_target_modules", message, message))
        del normalized["lora_target_modules"]
        normalized["lora_target_linear"] = True
    elif isinstance(targets, str):
        message = (
            f"`lora_target_modules` is a list of module names or `all-linear`, got {targets!r}; "
            f"write [{targets}] or all-linear"
        )
        problems.append(Problem("lora_target_modules", message, message))
        del normalized["lora_target_modules"]
    return normalized


def _attention_flags_folded(data: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """axolotl's boolean attention keys (``flash_attention: true``) as one ``attn_implementation``."""
    folded = {key: value for key, value in data.items() if key not in ATTENTION_FLAGS}
    asked = {flag: data[flag] for flag in ATTENTION_FLAGS if flag in data and not is_off(data[flag])}
    for flag, value in asked.items():
        if value is not True and value is not False:
            message = f"`{flag}` is true or false, got {value!r}; fix its value"
            problems.append(Problem(flag, message, message))
    wanted = {ATTENTION_FLAGS[flag] for flag, value in asked.items() if value is True}
    if "attn_implementation" in data and not is_off(data["attn_implementation"]):
        wanted.add(data["attn_implementation"])
    if len(wanted) > 1:
        keys = [flag for flag, value in asked.items() if value is True]
        keys += ["attn_implementation"] if "attn_implementation" in data else []
        message = f"{', '.join(f'`{key}`' for key in keys)} ask for different attention kernels; keep one"
        problems.append(Problem(keys[0], message, message))
    elif wanted:
        folded["attn_implementation"] = wanted.pop()
    return folded


def _coerce_numbers(raw: dict[str, Any]) -> dict[str, Any]:
    """Accept YAML ints where floats are expected (``learning_rate: 1``) and strings like ``2e-4``.

    PyYAML reads ``2e-4`` (no dot) as a string; axolotl users write it that way all the time.
    """
    coerced = dict(raw)
    for key in FLOAT_KEYS & coerced.keys():
        value = coerced[key]
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            coerced[key] = float(value)
        elif isinstance(value, str):
            try:
                coerced[key] = float(value)
            except ValueError:
                pass
    return coerced


def _validated(data: dict[str, Any], source: str, problems: list[Problem]) -> Config | None:
    """The Config of ``data``, adding every type and rule problem to ``problems``.

    When a value has the wrong type, the rules across keys are still checked: once more, without
    the broken keys (placeholders for required ones), skipping rules that read a broken key.
    """
    broken: set[str] = set()
    for _ in range(2):
        try:
            config = Config.model_validate(data, context=COLLECT_PROBLEMS)
        except ValidationError as error:
            seen = {problem.key for problem in problems}
            for item in error.errors():
                problem = _describe(item, source)
                if problem.key not in seen:
                    problems.append(problem)
                    seen.add(problem.key)
            data, newly_broken = _without_broken(data, error)
            if newly_broken <= broken:
                return None
            broken |= newly_broken
            continue
        problems += [problem for check, problem in config.problems(source) if not broken & set(check.keys)]
        return config
    return None


def _without_broken(data: dict[str, Any], error: ValidationError) -> tuple[dict[str, Any], set[str]]:
    """``data`` with each key that failed validation removed (or replaced by a placeholder)."""
    repaired = dict(data)
    broken: set[str] = set()
    for item in error.errors():
        loc = item["loc"]
        if not loc:
            continue
        top = str(loc[0])
        broken.add(top)
        datasets = repaired.get("datasets")
        if top == "datasets" and len(loc) > 1 and isinstance(loc[1], int) and isinstance(datasets, list):
            repaired["datasets"] = [*datasets]
            repaired["datasets"][loc[1]] = {"path": "-"}
        elif top in _PLACEHOLDERS:
            repaired[top] = _PLACEHOLDERS[top]
        else:
            repaired.pop(top, None)
    return repaired, broken


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        annotation = model.model_fields.get(str(part))
        if annotation is None:
            break
        candidate = _model_in(annotation.annotation)
        if candidate is None:
            break
        model = candidate
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts[-1] = f"{parts[-1]}[{part}]" if parts else f"[{part}]"
        else:
            parts.append(str(part))
    return ".".join(parts)


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the member type of a union (``bool``, ``literal['auto']``) into the error path."""
    return isinstance(part, str) and ("[" in part or part in {"bool", "int", "float", "str", "list", "dict"})


def _describe(item: Any, source: str) -> Problem:
    """One pydantic error as a problem that names the key and the fix."""
    loc = tuple(part for part in item["loc"] if not _is_union_tag(part))
    kind = item["type"]
    key = _dotted(loc)
    if kind == "extra_forbidden":
        unknown = str(loc[-1])
        close = difflib.get_close_matches(unknown, _known_keys(loc), n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else "remove it (see docs/config.md for the keys)"
        return Problem(key, f"unknown key `{key}` in {source}; {hint}", f"unknown key `{key}`; {hint}")
    if kind == "missing":
        return Problem(
            key, f"missing required key `{key}` in {source}; add it", f"missing required key `{key}`; add it"
        )
    message = str(item["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
        if not key:
            return Problem(key, f"{source}: {message}", message)
        return Problem(key, f"{source}: `{key}`: {message}", f"`{key}`: {message}")
    got = item.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    text = f"{message.lower()} (got {shown}); fix its value"
    return Problem(key, f"`{key}` in {source}: {text}", f"`{key}`: {text}")
