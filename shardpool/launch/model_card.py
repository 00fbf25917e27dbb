"""The model card ``README.md`` written beside the adapter: what was trained, how, where, and how well.

It has the Hugging Face model card shape: YAML front matter (``base_model``, ``library_name:
peft``, ``tags``) that the Hub and ``huggingface_hub.ModelCard`` read, then Markdown for people.
Torch-free: it renders plain values the launcher already holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from mesh.files import atomic_write
from shardpool.config import Config
from shardpool.contract.job import StagePlacement

__all__ = ["MODEL_CARD_FILE", "TrainingOutcome", "earlier_splits", "render_model_card", "write_model_card"]

MODEL_CARD_FILE = "README.md"


@dataclass(frozen=True)
class TrainingOutcome:
    """What a finished run reports on its card: steps taken and losses (None where not measured)."""

    steps: int
    final_train_loss: float | None
    eval_loss_before: float | None
    eval_loss_after: float | None


def render_model_card(
    config: Config,
    *,
    base_model: str,
    target_modules: Sequence[str],
    placements: Sequence[StagePlacement],
    outcome: TrainingOutcome,
    earlier: Sequence[str] = (),
    shares: Sequence[int] = (),
) -> str:
    """The card's text. ``base_model`` is the reference the adapter stores (an absolute path or hub id).

    ``placements`` is the split the run ended with; ``earlier`` the splits it trained with before a
    re-balance or a re-plan changed it, one line each (:func:`earlier_splits`). With ``shares`` the
    placements are data-parallel replicas, each training that share of the step's micro-batches.
    """
    tags = ["shardpool", "lora"] + (["qlora"] if config.adapter == "qlora" else [])
    front_matter = yaml.safe_dump(
        {"base_model": base_model, "library_name": "peft", "tags": tags},
        sort_keys=False,
        default_flow_style=None,
    )
    adapter_kind = "QLoRA (NF4 base)" if config.adapter == "qlora" else "LoRA"
    adapter_dir = str(Path(config.output_dir).resolve())
    sections = [
        f"---\n{front_matter}---",
        f"# {Path(config.output_dir).name}",
        f"A {adapter_kind} adapter for `{base_model}`, trained with shardpool.",
        "## Datasets\n\n" + "\n".join(_dataset_line(spec.path, spec.type) for spec in config.datasets),
        "## Hyperparameters\n\n"
        + _table(("hyperparameter", "value"), _hyperparameters(config, target_modules, outcome.steps)),
        "## Results\n\n" + _table(("metric", "value"), _results(outcome)),
        "## Plan\n\n" + _plan_summary(config, placements, earlier, shares),
        "## Usage\n\n```python\nfrom peft import AutoPeftModelForCausalLM\n"
        "from transformers import AutoTokenizer\n\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({json.dumps(adapter_dir)})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(adapter_dir)})\n```",
    ]
    return "\n\n".join(sections) + "\n"


def write_model_card(output_dir: str | Path, text: str) -> Path:
    """Write the card into ``output_dir`` atomically; return its path."""
    path = Path(output_dir) / MODEL_CARD_FILE
    atomic_write(path, text.encode("utf-8"))
    return path


def _dataset_line(path: str, kind: str | None) -> str:
    return f"- `{path}` ({kind or 'pre-tokenized'})"


def _hyperparameters(config: Config, target_modules: Sequence[str], steps: int) -> list[tuple[str, str]]:
    return [
        ("adapter", config.adapter),
        ("lora_r", str(config.lora_r)),
        ("lora_alpha", f"{config.lora_alpha:g}"),
        ("lora_dropout", f"{config.lora_dropout:g}"),
        ("lora_target_modules", ", ".join(target_modules)),
        ("learning_rate", f"{config.learning_rate:g}"),
        ("lr_scheduler", config.lr_scheduler),
        ("optimizer", config.optimizer),
        ("steps", str(steps)),
        ("micro_batch_size", str(config.micro_batch_size)),
        ("gradient_accumulation_steps", str(config.gradient_accumulation_steps)),
        ("replicas", str(config.shardpool.replicas)),
        ("sequence_len", str(config.sequence_len)),
        ("seed", str(config.seed)),
    ]


def _results(outcome: TrainingOutcome) -> list[tuple[str, str]]:
    return [
        ("final train loss", _loss(outcome.final_train_loss)),
        ("eval loss before training", _loss(outcome.eval_loss_before)),
        ("eval loss after training", _loss(outcome.eval_loss_after)),
    ]


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in rows])


def _plan_summary(
    config: Config, placements: Sequence[StagePlacement], earlier: Sequence[str], shares: Sequence[int] = ()
) -> str:
    replicas = config.shardpool.replicas
    ended = ", at the end of training" if earlier else ""
    if shares:
        header = (
            f"data parallel: {len(shares)} replicas of the whole model, each training its share of the "
            f"step's {sum(shares)} micro-batches{ended}:"
        )
        rows = [
            f"| {index} | {place.device} | {place.host} | [{place.start}, {place.stop}) | {share} |"
            for index, (place, share) in enumerate(zip(placements, shares, strict=True))
        ]
        columns = "| replica | device | host | layers | micro-batches a step |"
    else:
        header = (
            f"{len(placements)} pipeline stage{'s' if len(placements) != 1 else ''}"
            f" × {replicas} replica{'s' if replicas != 1 else ''}, schedule {config.shardpool.schedule}{ended}:"
        )
        rows = [
            f"| {index} | {stage.device} | {stage.host} | [{stage.start}, {stage.stop}) | {stage.stop - stage.start} |"
            for index, stage in enumerate(placements)
        ]
        columns = "| stage | device | host | layers | layer count |"
    table = [header, "", columns, "|---|---|---|---|---|", *rows]
    if earlier:
        table += ["", "Earlier splits of this run:", "", *(f"- {line}" for line in earlier)]
    return "\n".join(table)


def earlier_splits(history: object) -> list[str]:
    """One line per plan a run trained with before its last, from ``plan.json``'s ``history``:
    its split, what made it and how it ended (``[0, 5) on b, [5, 16) on a (planner), until step 3``).
    Entries that are not plans are skipped; anything but a list gives none."""
    if not isinstance(history, list):
        return []
    lines = []
    for entry in history:
        if not isinstance(entry, Mapping) or not isinstance(stages := entry.get("stages"), list):
            continue
        replicas, shares = entry.get("data_parallel"), entry.get("shares")
        if isinstance(replicas, list) and isinstance(shares, list) and len(replicas) == len(shares):
            ranges = ", ".join(
                f"{share} micro-batches on {replica.get('host', '?')}"
                for replica, share in zip(replicas, shares, strict=True)
                if isinstance(replica, Mapping)
            )
        else:
            ranges = ", ".join(_stage_range(stage) for stage in stages if isinstance(stage, Mapping))
        ended = _how_it_ended(entry)
        lines.append(f"{ranges} ({entry.get('source', 'planner')}){ended}")
    return lines


def _stage_range(stage: Mapping[str, object]) -> str:
    layers = stage.get("layers")
    start, stop = layers if isinstance(layers, list) and len(layers) == 2 else ("?", "?")
    return f"[{start}, {stop}) on {stage.get('host', '?')}"


def _how_it_ended(entry: Mapping[str, object]) -> str:
    if "ended_at_step" in entry:
        return f", until step {entry['ended_at_step']}"
    if "resumed_from_step" in entry:
        return f", interrupted; resumed from step {entry['resumed_from_step']}"
    return ""
