"""The schema of a shardpool run: the keys shardpool implements, their types and the rules across them.

Keys shared with axolotl mean what they mean in axolotl. Every model is strict (unknown keys and
wrong types are errors). The rules across keys are :class:`Check` lists; :func:`parse_config`
collects them with every other problem, and a model built directly raises on the first one.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shardpool.config.attention import AttentionName
from shardpool.config.problems import Check, Problem

__all__ = [
    "Config",
    "DatasetSpec",
    "CHAT_TYPES",
    "CHAT_TEMPLATE_NAMES",
    "BUILT_CHAT_TEMPLATES",
    "IMAGE_CHAT_TEMPLATES",
    "UNBUILT_CHAT_TEMPLATES",
    "FALLBACK_PREFIX",
    "BnbConfig",
    "SpecialTokens",
    "ShardpoolSection",
    "COLLECT_PROBLEMS",
    "OPTIMIZERS",
    "LR_SCHEDULERS",
    "MAX_WARMUP_LEAD",
    "MAX_SAMPLE_PROMPTS",
    "MAX_SAMPLE_PROMPT_CHARS",
    "MAX_SAMPLE_NEW_TOKENS",
]

#: Validation context under which the models record rule breaks instead of raising on the first.
COLLECT_PROBLEMS = {"collect_problems": True}

#: The deepest 1F1B warm-up lead (``shardpool.warmup_lead``): here, in the lowest layer, so that the
#: config, the job contract and the schedule (``contract.schedule.MAX_LEAD``) share one bound.
MAX_WARMUP_LEAD = 8

#: ``shardpool.sample_prompts`` / ``sample_max_new_tokens``: the most prompts, characters a prompt
#: and tokens a sample (the config, the job and the samples event share these bounds).
MAX_SAMPLE_PROMPTS = 16
MAX_SAMPLE_PROMPT_CHARS = 4000
MAX_SAMPLE_NEW_TOKENS = 1024

OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
]
SchedulerName = Literal["cosine", "linear", "constant", "constant_with_warmup"]
OPTIMIZERS: tuple[str, ...] = OptimizerName.__args__
LR_SCHEDULERS: tuple[str, ...] = SchedulerName.__args__


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _raise_unless_collecting(checks: list[Check], info: ValidationInfo) -> None:
    """Raise the first broken rule, unless :func:`parse_config` collects them (COLLECT_PROBLEMS)."""
    if checks and not (info.context or {}).get("collect_problems"):
        raise ValueError(checks[0].message)


#: Dataset types whose rows are conversations, rendered through a chat template.
CHAT_TYPES = ("chat_template", "sharegpt")
#: axolotl's named chat templates that shardpool renders (shardpool.data.templates holds them).
BUILT_CHAT_TEMPLATES = (
    "chatml", "llama3", "llama4", "qwen_25", "qwen3", "qwen3_5", "gemma", "gemma3", "gemma3n", "gemma4",
    "gemma4_unified", "phi_3", "phi_35", "phi_4", "cohere", "aya", "deepseek_v2", "deepseek_v3", "exaone",
    "exaone4", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken", "alpaca", "metharme",
    "jamba", "falcon_h1", "command_a", "command_a_tool_use", "command_a_rag", "nemotron_h",
)  # fmt: skip
#: axolotl's templates for conversations with images, which shardpool does not train on.
IMAGE_CHAT_TEMPLATES = ("llava", "pixtral", "qwen2_vl", "llama3_2_vision")
#: axolotl's other named templates: refused until built (none at present).
UNBUILT_CHAT_TEMPLATES: tuple[str, ...] = ()
#: The prefix of ``tokenizer_default_fallback_<name>``: the tokenizer's own template, else ``<name>``.
FALLBACK_PREFIX = "tokenizer_default_fallback_"
#: ``chat_template`` names shardpool resolves itself; any other value must be jinja text.
CHAT_TEMPLATE_NAMES = (
    *BUILT_CHAT_TEMPLATES,
    "tokenizer_default",
    "jinja",
    *(FALLBACK_PREFIX + name for name in BUILT_CHAT_TEMPLATES),
)
#: The dataset keys that only apply to chat datasets.
CHAT_DATASET_KEYS = (
    "field_messages", "message_property_mappings", "message_field_role", "message_field_content",
    "roles", "roles_to_train", "train_on_eos", "train_on_eot", "drop_system_message", "chat_template",
    "chat_template_jinja",
)  # fmt: skip


#: The supervised dataset types (a preference run's are :data:`PREFERENCE_TYPES`).
SFT_TYPES = ("alpaca", "completion", "chat_template", "sharegpt")
#: axolotl's preference dataset types for ``rl: dpo`` and ``rl: ipo``; ``type:`` may also be a
#: mapping (axolotl's ``user_defined.default``: field_prompt, field_system, field_chosen,
#: field_rejected, prompt_format, chosen_format, rejected_format).
PREFERENCE_TYPES = (
    "chat_template.default", "chat_template.argilla_chat", "chat_template.argilla",
    *(f"{style}.{variant}" for style in ("chatml", "llama3")
      for variant in ("default", "intel", "icr", "prompt_pairs", "ultra", "argilla_chat")),
    "user_defined.default",
)  # fmt: skip
#: The keys of a ``type:`` mapping (axolotl's user-defined preference format).
USER_DEFINED_PREFERENCE_KEYS = (
    "field_prompt", "field_system", "field_chosen", "field_rejected", "prompt_format", "chosen_format",
    "rejected_format",
)  # fmt: skip
#: One-part preference types, axolotl's spelling of their ``.default`` (``chat_template`` too, under ``rl``).
SHORT_PREFERENCE_TYPES = ("chatml", "llama3", "user_defined")
#: The ``rl`` values shardpool trains; axolotl's others are refused in one line.
BUILT_RL = ("dpo", "ipo", "orpo", "simpo")
#: The ``rl`` values whose loss compares the policy with a reference model (the adapter disabled).
REFERENCE_RL = ("dpo", "ipo")


#: The dataset types that read ``field_chosen`` / ``field_rejected``.
_CHOSEN_FIELD_TYPES = ("chat_template", "chat_template.default", "chat_template.argilla_chat")
#: ``type`` in the JSON schema: the names shardpool reads, or the user-defined mapping (the
#: field is a plain string in Python so that a wrong name gets :func:`dataset_type_problem`'s line).
_DATASET_TYPE_SCHEMA = [
    {"enum": [*SFT_TYPES, *PREFERENCE_TYPES, *SHORT_PREFERENCE_TYPES]},
    {
        "type": "object",
        "properties": {key: {"type": "string"} for key in USER_DEFINED_PREFERENCE_KEYS},
        "additionalProperties": False,
    },
    {"type": "null"},
]


def dataset_type_problem(kind: str | dict[str, Any] | None) -> str | None:
    """Why a dataset ``type`` is not one shardpool reads (None when it is)."""
    if kind is None or (
        isinstance(kind, str) and kind in (*SFT_TYPES, *PREFERENCE_TYPES, *SHORT_PREFERENCE_TYPES)
    ):
        return None
    if isinstance(kind, dict):
        unknown = sorted(set(kind) - set(USER_DEFINED_PREFERENCE_KEYS))
        if not unknown:
            return None
        return (
            f"a `type:` mapping (axolotl's user-defined preference format) has unknown keys {unknown}; "
            f"use {', '.join(USER_DEFINED_PREFERENCE_KEYS)}"
        )
    return (
        f"dataset type `{kind}` is not built into shardpool; use {', '.join(SFT_TYPES)}, or with `rl` "
        "a preference type (docs/data.md)"
    )


def is_preference_type(kind: str | dict[str, Any] | None, rl: str | None) -> bool:
    """Whether a dataset ``type`` reads preference pairs: a preference name or mapping, or under
    ``rl`` the one-part ``chat_template`` (axolotl's ``chat_template.default``)."""
    if isinstance(kind, dict) or kind in (*PREFERENCE_TYPES, *SHORT_PREFERENCE_TYPES):
        return True
    return kind == "chat_template" and rl is not None


def chat_template_problems(choice: str | None, jinja: str | None) -> list[str]:
    """What is wrong with a ``chat_template`` / ``chat_template_jinja`` pair (top level or dataset)."""
    found: list[str] = []
    if choice == "jinja" and not jinja:
        found.append("`chat_template: jinja` needs the template in `chat_template_jinja`")
    if jinja and choice not in (None, "jinja"):
        found.append(
            f"`chat_template_jinja` is used only with `chat_template: jinja` (or no `chat_template`), "
            f"not `{choice if len(choice or '') < 40 else 'a jinja string'}`; remove one of them"
        )
    if choice and choice not in CHAT_TEMPLATE_NAMES and not looks_like_jinja(choice):
        found.append(_unknown_template_problem(choice))
    return found


def _unknown_template_problem(choice: str) -> str:
    """The one line refusing a ``chat_template`` name shardpool does not render."""
    name = choice.removeprefix(FALLBACK_PREFIX)
    if name in IMAGE_CHAT_TEMPLATES:
        return (
            f"chat_template `{choice}` is for conversations with images, which shardpool does not "
            "support; use a text template (e.g. `tokenizer_default` or `llama3`)"
        )
    return (
        f"chat_template `{choice}` is not built into shardpool; use `tokenizer_default` (the base "
        "model's own template), one of the built names (docs/data.md), or the template's jinja "
        "text in `chat_template_jinja`"
    )


def looks_like_jinja(text: str) -> bool:
    """True for a ``chat_template`` value that is a template itself rather than a name."""
    return "{{" in text or "{%" in text


class DatasetSpec(_Strict):
    """One JSONL (or JSON array) dataset. ``type`` absent means pre-tokenized rows with ``input_ids``."""

    path: str = Field(
        description="a .jsonl/.json/.parquet/.csv file, a directory of them, or a Hugging Face dataset id"
    )
    ds_type: Literal["json", "parquet", "csv", "arrow"] | None = Field(
        default=None, description="the file format when the suffix does not say it"
    )
    data_files: str | list[str] | None = Field(
        default=None, description="which files of a directory or hub dataset to read (glob patterns)"
    )
    split: str | None = Field(
        default=None, description="which split of a directory or hub dataset (default: train)"
    )
    name: str | None = Field(default=None, description="the configuration (subset) of a hub dataset")
    type: str | dict[str, str] | None = Field(
        default=None,
        json_schema_extra=lambda schema: schema.update(anyOf=_DATASET_TYPE_SCHEMA),
        description="alpaca: instruction/input/output; completion: one text field; chat_template / "
        "sharegpt: conversations; absent: pre-tokenized; with `rl`, a preference type "
        "(chatml.intel, chat_template.default, ...: docs/data.md) or a user-defined mapping",
    )
    field_chosen: str | None = Field(
        default=None, description="preference rows: the field of the chosen answer (default: chosen)"
    )
    field_rejected: str | None = Field(
        default=None, description="preference rows: the field of the rejected answer (default: rejected)"
    )
    field: str | None = Field(
        default=None, description="the text field of a completion dataset (default: text)"
    )
    field_messages: str | None = Field(
        default=None,
        description="the row field holding the messages (default: messages; sharegpt: conversations)",
    )
    message_property_mappings: dict[str, str] | None = Field(
        default=None,
        description="message property -> field of the row's messages (default: role: role, content: "
        "content; sharegpt: role: from, content: value)",
    )
    message_field_role: str | None = Field(
        default=None, description="older spelling of message_property_mappings.role"
    )
    message_field_content: str | None = Field(
        default=None, description="older spelling of message_property_mappings.content"
    )
    roles: dict[str, list[str]] | None = Field(
        default=None,
        description="role -> the source values that mean it (default: user: [human, user], "
        "assistant: [gpt, assistant], system: [system], tool: [tool])",
    )
    roles_to_train: list[str] | None = Field(
        default=None, description="roles whose turns are trained (default: [assistant])"
    )
    train_on_eos: Literal["turn", "all", "last", "none"] | None = Field(
        default=None,
        description="which eos tokens are trained: after each trained turn (turn, default), after "
        "every turn (all), after the last trained turn (last), none",
    )
    train_on_eot: Literal["turn", "all", "last", "none"] | None = Field(
        default=None,
        description="which `eot_tokens` are trained, as train_on_eos (default: the train_on_eos setting)",
    )
    drop_system_message: bool | None = Field(default=None, description="leave out a leading system message")
    chat_template: str | None = Field(
        default=None, description="this dataset's chat template (default: the top-level one)"
    )
    chat_template_jinja: str | None = Field(
        default=None, description="this dataset's jinja template text (or a path to a .jinja file)"
    )

    @property
    def is_chat(self) -> bool:
        """Whether the rows are conversations rendered through a chat template."""
        return self.type in CHAT_TYPES

    def checks(self) -> list[Check]:
        """The rules across this dataset's keys that it breaks."""
        found: list[str] = []
        if (problem := dataset_type_problem(self.type)) is not None:
            found.append(problem)
        if (self.field_chosen or self.field_rejected) and self.type not in _CHOSEN_FIELD_TYPES:
            found.append(
                "`field_chosen` and `field_rejected` only apply to `type: chat_template.default` or "
                "`chat_template.argilla_chat`; remove them"
            )
        if self.field is not None and self.type != "completion":
            found.append("`field` only applies to `type: completion`; remove it or set `type: completion`")
        given = [key for key in CHAT_DATASET_KEYS if getattr(self, key) is not None]
        if given and not self.is_chat:
            found.append(
                f"`{given[0]}` only applies to `type: chat_template` or `type: sharegpt`; remove it or set the type"
            )
        mappings = self.message_property_mappings or {}
        for name, legacy in (("role", self.message_field_role), ("content", self.message_field_content)):
            if legacy is not None and mappings.get(name, legacy) != legacy:
                found.append(
                    f"`message_field_{name}: {legacy}` and `message_property_mappings.{name}: "
                    f"{mappings[name]}` disagree; keep one"
                )
        found += chat_template_problems(self.chat_template, self.chat_template_jinja)
        return [Check(("datasets",), message) for message in found]

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> DatasetSpec:
        _raise_unless_collecting(self.checks(), info)
        return self


class BnbConfig(_Strict):
    """bitsandbytes 4-bit settings, as axolotl's ``bnb_config_kwargs``."""

    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field(default="nf4", description="4-bit data type")
    bnb_4bit_use_double_quant: bool = Field(default=True, description="quantize the absmax statistics too")


class SpecialTokens(_Strict):
    """axolotl's ``special_tokens``: which existing tokens serve as bos, eos, pad and unk."""

    bos_token: str | None = Field(default=None, description="beginning-of-sequence token")
    eos_token: str | None = Field(
        default=None, description="end-of-sequence token (appended to trained rows)"
    )
    pad_token: str | None = Field(default=None, description="padding token (masked out of the loss)")
    unk_token: str | None = Field(default=None, description="unknown-token token")
    additional_special_tokens: list[str] | None = Field(
        default=None, description="further tokens of the vocabulary to treat as special"
    )

    def as_settings(self) -> dict[str, str | list[str]]:
        """The tokens that are set, as ``tokenizer.add_special_tokens`` takes them."""
        return {key: value for key, value in self.model_dump().items() if value}


#: ``shardpool.nf4_backend``: how stages compute with NF4 weights (``shardpool.model.nf4``).
NF4BackendSetting = Literal["auto", "bitsandbytes", "torch"]


class ShardpoolSection(_Strict):
    """shardpool's own keys: where the stages run and how they talk."""

    placement: Literal["local", "mesh"] = Field(
        default="local", description="local: stage processes on this machine; mesh: on mesh members"
    )
    stages: int | None = Field(
        default=None, ge=1, description="number of pipeline stages (default: len(devices) or 2)"
    )
    replicas: int = Field(
        default=1, ge=1, description="data-parallel pipelines; LoRA gradients are all-reduced"
    )
    schedule: Literal["1f1b", "gpipe"] = Field(default="1f1b", description="pipeline schedule")
    warmup_lead: Literal["auto"] | int = Field(
        default="auto",
        description=f"1F1B warm-up depth: forwards a stage runs ahead of its neighbour, 1 to {MAX_WARMUP_LEAD} times the "
        "textbook's (auto: the planner's choice for the placement, by the simulated step)",
    )
    rebalance: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: after the warm-up steps, move layer boundaries in place when the measured "
        "step says another split is faster; off: keep the plan",
    )
    on_member_loss: Literal["continue", "stop"] = Field(
        default="continue",
        description="mesh runs: continue: when a member is lost, re-plan over the rest and go on from the "
        "last step; stop: stop the run (resume with --resume)",
    )
    min_members: int = Field(
        default=1, ge=1, description="mesh runs: stop rather than continue on fewer members than this"
    )
    max_replans_per_hour: int = Field(
        default=6, ge=0, description="mesh runs: stop rather than re-plan more often than this in an hour"
    )
    member_timeout_s: float = Field(
        default=30.0,
        ge=5.0,
        le=3600.0,
        description="mesh runs: a member whose agent or stage is silent this long is lost (the stall "
        "bound is 3 steps' time within it)",
    )
    wire_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto", description="dtype of activations between stages (auto: the compute dtype)"
    )
    devices: list[str] | None = Field(
        default=None, description="one device per stage, e.g. [cpu, cuda:0, mps]"
    )
    layers: list[int] | None = Field(
        default=None,
        description="manual split: decoder layers per stage, e.g. [1, 3, 2] (mesh: the planner picks the devices)",
    )
    data_parallel: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="auto: where several devices each hold the whole model and that predicts a shorter "
        "step than any pipeline, train whole-model replicas on them, each on a share of the step's "
        "micro-batches by its speed; on: replicas wherever two devices hold the model; off: always a pipeline",
    )
    shares: list[int] | None = Field(
        default=None,
        description="manual data-parallel split: micro-batches per replica, e.g. [11, 5], adding up to "
        "gradient_accumulation_steps (local: one replica per `devices` entry; mesh: the planner picks them)",
    )
    nf4_backend: NF4BackendSetting | list[NF4BackendSetting] = Field(
        default="auto",
        description="how a stage computes with NF4 weights: bitsandbytes: its kernels; torch: plain PyTorch "
        "on the same stored weights, for a device bitsandbytes has no 4-bit kernels for (a Maxwell card, "
        "a new architecture); auto: bitsandbytes where its 4-bit probe passes on the device, else torch; "
        "a list gives one per stage",
    )
    threads_per_stage: int | None = Field(
        default=None, ge=1, description="torch intra-op threads per CPU stage (default: cores / processes)"
    )
    master_port: int | None = Field(
        default=None, ge=1, le=65535, description="rendezvous TCP port on loopback (default: a free one)"
    )
    sample_prompts: list[str] = Field(
        default_factory=list,
        max_length=MAX_SAMPLE_PROMPTS,
        description=f"up to {MAX_SAMPLE_PROMPTS} prompts the training stages complete greedily at every eval "
        "and at the end of training, logged to metrics.jsonl, the console and the trackers",
    )
    sample_max_new_tokens: int = Field(
        default=32,
        ge=1,
        le=MAX_SAMPLE_NEW_TOKENS,
        description="the most tokens each sample generates (it stops earlier at the model's end-of-sequence token)",
    )

    def checks(self) -> list[Check]:
        """The rules across this section's keys that it breaks."""
        found: list[str] = []
        counts = {
            "shardpool.stages": self.stages,
            "shardpool.devices": None if self.devices is None else len(self.devices),
            "shardpool.layers": None if self.layers is None else len(self.layers),
            "shardpool.nf4_backend": len(self.nf4_backend) if isinstance(self.nf4_backend, list) else None,
        }
        given = {key: count for key, count in counts.items() if count is not None}
        if len(set(given.values())) > 1:
            described = ", ".join(f"{key} gives {count}" for key, count in given.items())
            found.append(f"stage counts disagree ({described}); make them name the same number of stages")
        if self.layers is not None and any(count < 1 for count in self.layers):
            found.append("`shardpool.layers` needs at least 1 layer per stage; remove empty stages")
        found += [problem for device in self.devices or () if (problem := _device_problem(device))]
        if self.placement == "mesh" and self.devices is not None:
            found.append(
                "`shardpool.devices` is for `placement: local`; on the mesh the planner picks devices"
            )
        found += self._share_problems()
        return [Check(("shardpool",), message) for message in found]

    def _share_problems(self) -> list[str]:
        """What a manual data-parallel split (``shares``), or ``data_parallel: on``, conflicts with."""
        pipeline = [
            f"shardpool.{key}"
            for key, given in (
                ("layers", self.layers),
                ("stages", self.stages),
                ("replicas", self.replicas > 1),
            )
            if given
        ]
        if self.shares is None:
            if self.data_parallel == "on" and pipeline:
                return [
                    f"`data_parallel: on` trains whole-model replicas; remove {', '.join(pipeline)} or use auto"
                ]
            return []
        found: list[str] = []
        if len(self.shares) < 2 or min(self.shares) < 1:
            found.append("`shardpool.shares` needs at least 2 replicas of at least 1 micro-batch each")
        if pipeline:
            found.append(f"`shardpool.shares` trains whole-model replicas; remove {', '.join(pipeline)}")
        if self.data_parallel == "off":
            found.append("`shardpool.shares` asks for data parallelism but `data_parallel` is off; keep one")
        if self.placement == "local" and self.devices is not None and len(self.devices) != len(self.shares):
            found.append(
                f"`shardpool.shares` names {len(self.shares)} replicas but `devices` {len(self.devices)}; "
                "give one device per replica"
            )
        return found

    @field_validator("sample_prompts")
    @classmethod
    def _prompts_written(cls, prompts: list[str]) -> list[str]:
        for prompt in prompts:
            if not prompt.strip():
                raise ValueError("a sample prompt is empty; write the text to complete, or remove it")
            if len(prompt) > MAX_SAMPLE_PROMPT_CHARS:
                raise ValueError(
                    f"a sample prompt has {len(prompt)} characters; at most {MAX_SAMPLE_PROMPT_CHARS}"
                )
        return prompts

    @field_validator("warmup_lead", mode="before")
    @classmethod
    def _lead_in_range(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WARMUP_LEAD
        ):
            return value
        raise ValueError(f"the 1F1B warm-up depth is an integer from 1 to {MAX_WARMUP_LEAD}, or auto")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ShardpoolSection:
        _raise_unless_collecting(self.checks(), info)
        return self

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages this section asks for (2 when nothing says; 1 with ``shares``)."""
        if self.shares:
            return 1
        for count in (self.stages, self.devices and len(self.devices), self.layers and len(self.layers)):
            if count:
                return int(count)
        return 2

    def stage_devices(self) -> list[str]:
        """The torch device of each stage, or of each replica with ``shares`` (all ``cpu`` unless
        ``devices`` says otherwise)."""
        if self.devices:
            return list(self.devices)
        return ["cpu"] * (len(self.shares) if self.shares else self.num_stages)


def _device_problem(device: str) -> str | None:
    kind, _, index = device.partition(":")
    if kind not in {"cpu", "cuda", "mps", "xpu"} or (index and not index.isdigit()):
        return f"unknown device `{device}` in shardpool.devices; use cpu, cuda:N, mps or xpu:N"
    return None


class Config(_Strict):
    """A whole run. Field names and meanings follow axolotl where axolotl has them."""

    base_model: str = Field(description="local Hugging Face model directory (config.json + safetensors)")
    adapter: Literal["qlora", "lora"] = Field(
        default="qlora", description="qlora: NF4 base; lora: full-precision base"
    )
    load_in_4bit: bool = Field(
        default=True, description="quantize the base to 4 bits (unset: true for qlora, false for lora)"
    )
    bnb_config_kwargs: BnbConfig = Field(default_factory=BnbConfig, description="bitsandbytes 4-bit settings")
    lora_r: int = Field(default=8, ge=1, description="LoRA rank")
    lora_alpha: float = Field(default=16, gt=0, description="LoRA scaling numerator (scale = alpha / r)")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    lora_target_modules: list[str] | None = Field(
        default=None, description="module names that get LoRA (`all-linear` means lora_target_linear)"
    )
    lora_target_linear: bool = Field(default=False, description="put LoRA on every Linear except lm_head")
    lora_model_dir: str | None = Field(default=None, description="start from this existing PEFT adapter")
    datasets: list[DatasetSpec] = Field(min_length=1, description="JSONL datasets, merged in order")
    val_set_size: float = Field(default=0.0, ge=0.0, description="eval split: a fraction (<1) or a row count")
    sequence_len: int = Field(
        default=512, gt=0, description="rows are truncated or padded to this many tokens"
    )
    sample_packing: bool = Field(default=False, description="pack several short rows into one sequence")
    train_on_inputs: bool = Field(
        default=False,
        description="also train on the prompt tokens of alpaca rows, and on every turn of a conversation",
    )
    shuffle_merged_datasets: bool = Field(default=True, description="shuffle rows (seeded) before batching")
    curriculum_sampling: bool = Field(
        default=False, description="consume rows in file order (needs no shuffle)"
    )
    micro_batch_size: int = Field(default=1, ge=1, description="rows per micro-batch")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    num_epochs: float = Field(default=1.0, gt=0, description="passes over the training rows")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many optimizer steps")
    learning_rate: float = Field(default=2e-4, gt=0, description="peak learning rate")
    lr_scheduler: SchedulerName = Field(
        default="cosine", description="decay after warm-up (constant: constant_with_warmup)"
    )
    cosine_min_lr_ratio: float | None = Field(
        default=None, ge=0.0, le=1.0, description="cosine decays to this fraction of the peak, not to 0"
    )
    warmup_steps: int | None = Field(default=None, ge=0, description="linear warm-up steps")
    warmup_ratio: float | None = Field(
        default=None, ge=0.0, lt=1.0, description="warm-up as a fraction of steps"
    )
    optimizer: OptimizerName = Field(
        default="adamw_torch", description="AdamW: torch, torch fused, or bitsandbytes 8-bit / paged"
    )
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW decoupled weight decay")
    adam_beta1: float = Field(default=0.9, gt=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(default=0.999, gt=0.0, lt=1.0, description="AdamW beta2")
    adam_epsilon: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float = Field(default=1.0, ge=0.0, description="clip the global grad norm (0 disables)")
    seed: int = Field(default=42, description="seed for LoRA init, shuffling and dropout")
    gradient_checkpointing: bool = Field(default=False, description="recompute layer activations in backward")
    attn_implementation: AttentionName = Field(
        default="sdpa",
        description="attention kernel (`flash_attention: true` asks for flash_attention_2); sdpa where a device cannot",
    )
    special_tokens: SpecialTokens | None = Field(
        default=None, description="re-point bos/eos/pad/unk at tokens the tokenizer already has"
    )
    tf32: bool = Field(
        default=False,
        description="let fp32 matmuls use TF32 on NVIDIA Ampere or newer (faster, ~1e-3 relative error)",
    )
    resume_from_checkpoint: str | None = Field(
        default=None, description="continue from this checkpoint directory (`--resume` takes the newest)"
    )
    auto_resume_from_checkpoints: bool = Field(
        default=False, description="continue from the newest checkpoint in output_dir when there is one"
    )
    output_dir: str = Field(default="./outputs/shardpool", description="where the adapter and logs go")
    save_steps: int | None = Field(default=None, ge=1, description="checkpoint every this many steps")
    saves_per_epoch: int | None = Field(
        default=None, ge=1, description="checkpoint this many times per epoch (instead of save_steps)"
    )
    save_total_limit: int | None = Field(
        default=None, ge=1, description="keep only the newest this many checkpoints (default: all)"
    )
    eval_steps: int | float | None = Field(
        default=None, gt=0, description="eval loss every this many steps (below 1: a fraction of all steps)"
    )
    evals_per_epoch: int | None = Field(
        default=None, ge=1, description="eval loss this many times per epoch (instead of eval_steps)"
    )
    use_tensorboard: bool = Field(
        default=False,
        description="also write metrics as TensorBoard events to output_dir/runs (extra: tensorboard)",
    )
    use_wandb: bool | None = Field(
        default=None, description="log to W&B (default: when wandb_project is set)"
    )
    wandb_project: str | None = Field(
        default=None, description="W&B project to log metrics to (extra: wandb)"
    )
    wandb_entity: str | None = Field(default=None, description="W&B team or user")
    wandb_name: str | None = Field(default=None, description="W&B run name")
    wandb_run_id: str | None = Field(default=None, description="W&B run id (to continue a run)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="W&B mode (default: WANDB_MODE, else online)"
    )
    logging_steps: int = Field(default=1, ge=1, description="write metrics every this many steps")
    bf16: bool | Literal["auto"] = Field(
        default=False, description="at most bfloat16: each stage's dtype follows its device (docs/gpu.md)"
    )
    fp16: bool = Field(default=False, description="at most float16, with dynamic loss scaling (docs/gpu.md)")
    rl: str | None = Field(
        default=None,
        description="preference tuning: dpo, ipo, orpo or simpo, on pairs of chosen and rejected answers "
        "(docs/data.md)",
    )
    rl_beta: float | None = Field(
        default=None,
        gt=0,
        description="DPO/IPO/SimPO beta: how far the adapter may move from the base, or SimPO's reward "
        "scale (default 0.1); ORPO's weight when orpo_alpha is not set",
    )
    dpo_beta: float | None = Field(default=None, gt=0, description="older spelling of rl_beta")
    dpo_loss_type: Literal["sigmoid", "ipo"] | list[Literal["sigmoid", "ipo"]] | None = Field(
        default=None, description="rl: dpo's loss: sigmoid (default) or ipo"
    )
    dpo_label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="rl: dpo (sigmoid loss): the chance that a pair's labels are flipped "
        "(conservative DPO); 0 trusts every pair",
    )
    precompute_ref_log_probs: bool = Field(
        default=False,
        description="rl: dpo/ipo: compute the reference log-probabilities of every training pair once "
        "before training instead of in each step",
    )
    orpo_alpha: float | None = Field(
        default=None, gt=0, description="rl: orpo's weight of the odds-ratio term (TRL's beta; default 0.1)"
    )
    simpo_gamma: float = Field(
        default=0.5, ge=0, description="rl: simpo's target reward margin (TRL's simpo_gamma)"
    )
    cpo_alpha: float = Field(
        default=1.0,
        ge=0,
        description="rl: simpo's weight of the chosen answers' next-token loss (TRL's cpo_alpha; 0: none)",
    )
    chat_template: str | None = Field(
        default=None,
        description="chat template of chat datasets: tokenizer_default (the default), a built name "
        "(chatml, llama3, qwen3, gemma3, ...: docs/data.md), tokenizer_default_fallback_<name>, jinja, "
        "or jinja text",
    )
    chat_template_jinja: str | None = Field(
        default=None, description="jinja template text (or a path to a .jinja file) for chat datasets"
    )
    eot_tokens: list[str] | None = Field(
        default=None,
        description="texts that end a turn in the chat template, each one token of the base model's "
        "tokenizer; trained after turns per train_on_eot (default: the tokenizer's eos only)",
    )
    shardpool: ShardpoolSection = Field(default_factory=ShardpoolSection, description="shardpool's own keys")

    def checks(self) -> list[Check]:
        """The rules across top-level keys that this config breaks (nested sections: :meth:`problems`)."""
        rules: list[tuple[bool, tuple[str, ...], str]] = [
            (
                self.adapter == "qlora" and not self.load_in_4bit,
                ("adapter", "load_in_4bit"),
                "`adapter: qlora` needs `load_in_4bit: true`; set it, or use `adapter: lora`",
            ),
            (
                self.adapter == "lora" and self.load_in_4bit,
                ("adapter", "load_in_4bit"),
                "`adapter: lora` trains on a full-precision base; set `load_in_4bit: false` or use qlora",
            ),
            (
                not self.lora_target_linear and not self.lora_target_modules,
                ("lora_target_linear", "lora_target_modules"),
                "no LoRA targets: set `lora_target_modules` (e.g. [q_proj, v_proj]) or `lora_target_linear: true`",
            ),
            (
                self.warmup_steps is not None and self.warmup_ratio is not None,
                ("warmup_steps", "warmup_ratio"),
                "`warmup_steps` and `warmup_ratio` both set; keep one",
            ),
            (self.bf16 is True and self.fp16, ("bf16", "fp16"), "`bf16` and `fp16` both set; keep one"),
            (
                self.curriculum_sampling and self.shuffle_merged_datasets,
                ("curriculum_sampling", "shuffle_merged_datasets"),
                "`curriculum_sampling: true` needs `shuffle_merged_datasets: false` to keep file order",
            ),
            (
                self.val_set_size >= 1 and not float(self.val_set_size).is_integer(),
                ("val_set_size",),
                "`val_set_size` is a fraction below 1 or a whole row count; fix its value",
            ),
            (
                self.max_steps is None and not math.isfinite(self.num_epochs),
                ("num_epochs", "max_steps"),
                "`num_epochs` must be finite; set a number or `max_steps`",
            ),
            (
                self.save_steps is not None and self.saves_per_epoch is not None,
                ("save_steps", "saves_per_epoch"),
                "`save_steps` and `saves_per_epoch` both set; keep one",
            ),
            (
                self.eval_steps is not None and self.evals_per_epoch is not None,
                ("eval_steps", "evals_per_epoch"),
                "`eval_steps` and `evals_per_epoch` both set; keep one",
            ),
            (
                self.eval_steps is not None
                and self.eval_steps >= 1
                and not float(self.eval_steps).is_integer(),
                ("eval_steps",),
                "`eval_steps` is a whole step count or a fraction below 1 of all steps; fix its value",
            ),
            (
                self.shardpool.shares is not None
                and sum(self.shardpool.shares) != self.gradient_accumulation_steps,
                ("shardpool", "gradient_accumulation_steps"),
                f"`shardpool.shares` {self.shardpool.shares} add up to {sum(self.shardpool.shares or [])} but a "
                f"step has {self.gradient_accumulation_steps} micro-batches (`gradient_accumulation_steps`); "
                "make them add up",
            ),
            (
                self.cosine_min_lr_ratio is not None and self.lr_scheduler != "cosine",
                ("cosine_min_lr_ratio", "lr_scheduler"),
                f"`cosine_min_lr_ratio` applies to `lr_scheduler: cosine`, not `{self.lr_scheduler}`; "
                "remove it or use cosine",
            ),
        ]
        found = [Check(keys, message) for broken, keys, message in rules if broken]
        found += [
            Check(("chat_template", "chat_template_jinja"), message)
            for message in chat_template_problems(self.chat_template, self.chat_template_jinja)
        ]
        return found + self._preference_checks()

    def _preference_checks(self) -> list[Check]:
        """The rules of ``rl`` (preference tuning) this config breaks."""
        if self.rl is None:
            if any(is_preference_type(dataset.type, None) for dataset in self.datasets):
                return [
                    Check(("rl", "datasets"), "preference datasets (chosen/rejected pairs) need `rl: dpo`, "
                          "`ipo`, `orpo` or `simpo`; set it, or use a supervised dataset type")
                ]  # fmt: skip
            return []
        rules: list[tuple[bool, tuple[str, ...], str]] = [
            (
                self.rl not in BUILT_RL,
                ("rl",),
                f"`rl: {self.rl}` is not built into shardpool; it trains `rl: dpo` (dpo_loss_type sigmoid "
                "or ipo), `rl: ipo`, `rl: orpo` and `rl: simpo`",
            ),
            (
                any(
                    dataset.type is None or dataset.type in SFT_TYPES[:2] + ("sharegpt",)
                    for dataset in self.datasets
                ),
                ("rl", "datasets"),
                f"`rl: {self.rl}` trains on preference pairs; give every dataset a preference type "
                "(chatml.intel, chat_template.default, ...: docs/data.md)",
            ),
            (
                self.sample_packing,
                ("rl", "sample_packing"),
                "preference pairs are not packed; set `sample_packing: false`",
            ),
            (
                self.rl_beta is not None and self.dpo_beta is not None and self.rl_beta != self.dpo_beta,
                ("rl_beta", "dpo_beta"),
                f"`rl_beta: {self.rl_beta}` and its older spelling `dpo_beta: {self.dpo_beta}` disagree; keep one",
            ),
            (
                self.rl == "ipo" and self.dpo_loss_type not in (None, "ipo", ["ipo"]),
                ("rl", "dpo_loss_type"),
                "`rl: ipo` is the ipo loss; remove `dpo_loss_type`",
            ),
            (
                isinstance(self.dpo_loss_type, list) and len(self.dpo_loss_type) != 1,
                ("dpo_loss_type",),
                "`dpo_loss_type` takes one loss (sigmoid or ipo), not a weighted list",
            ),
            (
                self.rl != "dpo" and self.dpo_loss_type is not None and self.rl != "ipo",
                ("rl", "dpo_loss_type"),
                f"`dpo_loss_type` chooses `rl: dpo`'s loss; `rl: {self.rl}` has its own, remove it",
            ),
            (
                self.dpo_label_smoothing > 0 and self.preference_loss != "sigmoid",
                ("rl", "dpo_label_smoothing"),
                f"`dpo_label_smoothing` smooths `rl: dpo`'s sigmoid loss, not `{self.preference_loss}`; "
                "remove it",
            ),
            (
                self.precompute_ref_log_probs and self.rl not in REFERENCE_RL,
                ("rl", "precompute_ref_log_probs"),
                f"`rl: {self.rl}` has no reference model to precompute; remove `precompute_ref_log_probs`",
            ),
            (
                self.rl != "orpo" and self.orpo_alpha is not None,
                ("rl", "orpo_alpha"),
                f"`orpo_alpha` weighs `rl: orpo`'s odds-ratio term; `rl: {self.rl}` does not read it, remove it",
            ),
        ]
        return [Check(keys, message) for broken, keys, message in rules if broken]

    @property
    def preference_beta(self) -> float:
        """TRL's ``beta`` of this config: ``orpo_alpha`` under ``rl: orpo`` (axolotl passes it as
        beta), else ``rl_beta``, else its older spelling ``dpo_beta``, else TRL's 0.1."""
        for value in (self.orpo_alpha if self.rl == "orpo" else None, self.rl_beta, self.dpo_beta):
            if value is not None:
                return value
        return 0.1

    @property
    def preference_loss(self) -> Literal["sigmoid", "ipo", "orpo", "simpo"]:
        """The preference loss TRL computes for this config: ``rl: ipo``, ``orpo`` and ``simpo``
        name theirs, ``rl: dpo`` takes ``dpo_loss_type`` (sigmoid by default)."""
        if self.rl in ("ipo", "orpo", "simpo"):
            return self.rl  # type: ignore[return-value]
        loss = self.dpo_loss_type[0] if isinstance(self.dpo_loss_type, list) else self.dpo_loss_type
        return loss or "sigmoid"

    def problems(self, source: str) -> list[tuple[Check, Problem]]:
        """Every rule this config breaks, nested sections included, each with its problem line."""
        found = [(check, check.problem(source)) for check in self.checks()]
        for index, dataset in enumerate(self.datasets):
            found += [
                (check, check.problem(source, prefix=f"datasets[{index}]")) for check in dataset.checks()
            ]
        found += [(check, check.problem(source, prefix="shardpool")) for check in self.shardpool.checks()]
        return found

    @model_validator(mode="before")
    @classmethod
    def _quantize_by_adapter(cls, data: Any) -> Any:
        """An unset ``load_in_4bit`` follows the adapter, as in axolotl: qlora quantizes, lora does not."""
        if isinstance(data, dict) and data.get("load_in_4bit") is None:
            return {**data, "load_in_4bit": data.get("adapter", "qlora") != "lora"}
        return data

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Config:
        _raise_unless_collecting(self.checks(), info)
        return self

    @property
    def compute_dtype_name(self) -> str:
        """The dtype layers compute in where no plan chose a stage's own: float32, bfloat16 or float16.

        The planner chooses each stage's dtype from its device under this cap
        (:mod:`shardpool.plan.precision`); this is the dtype of a stage it did not choose one for.
        """
        if self.bf16 is True:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return "float32"

    @property
    def wire_dtype_name(self) -> str:
        """The dtype of activations and their gradients between stages."""
        names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        return names.get(self.shardpool.wire_dtype, self.compute_dtype_name)
