"""Metrics to TensorBoard and Weights & Biases, as axolotl's ``use_tensorboard`` and ``wandb_*`` keys ask.

metrics.jsonl is always written; these are extra sinks for the same lines, under Hugging Face
Trainer's names (``train/loss``, ``train/learning_rate``, ``eval/loss``, ...), so dashboards built
for axolotl runs read them. A ``samples`` line (``shardpool.sample_prompts``) goes to TensorBoard
as text (``samples``) and to W&B as a table (``samples``: step, prompt, completion). Both libraries are optional extras (``pip install
'shardpool[tensorboard]'`` / ``'shardpool[wandb]'``): a config that asks for one that is not
installed is refused in one line before anything runs, and so is W&B online without a login
(wandb would otherwise prompt, or end in a traceback once the run is set up). W&B honours
``WANDB_MODE`` (``offline`` writes the run under ``output_dir/wandb`` to sync later), as wandb
itself does.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardpool.config import Config
from shardpool.contract.events import PREFERENCE_METRICS
from shardpool.errors import ShardpoolError

__all__ = ["SAMPLE_COLUMNS", "Trackers", "check_trackers", "hf_scalars", "open_trackers", "sample_rows"]

_STEP_FIELDS = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "epoch")
#: The columns of the samples table (W&B) and of the samples text (TensorBoard).
SAMPLE_COLUMNS = ("step", "prompt", "completion")


def hf_scalars(record: dict[str, Any]) -> dict[str, float]:
    """One metrics.jsonl line as Hugging Face Trainer's scalar names (``train/loss``, ``eval/loss``)."""
    if "eval_loss" in record:
        return {"eval/loss": float(record["eval_loss"])}
    names = (*_STEP_FIELDS, *PREFERENCE_METRICS)
    return {f"train/{name}": float(record[name]) for name in names if record.get(name) is not None}


def sample_rows(record: dict[str, Any]) -> list[list[Any]]:
    """A ``samples`` metrics line as table rows (:data:`SAMPLE_COLUMNS`); a sample without text
    (no tokenizer decoded it) shows its token ids."""
    return [
        [
            record["step"],
            sample["prompt"],
            sample["completion"] if sample["completion"] is not None else str(sample["token_ids"]),
        ]
        for sample in record["samples"]
    ]


def _wants_wandb(config: Config) -> bool:
    return bool(config.use_wandb) if config.use_wandb is not None else bool(config.wandb_project)


_NO_LOGIN = (
    "`wandb_project` logs to W&B online, but no W&B login was found: run `wandb login` (or set "
    "WANDB_API_KEY), or log offline with WANDB_MODE=offline (or `wandb_mode: offline`) and "
    "`wandb sync` later"
)


def check_trackers(config: Config) -> None:
    """Refuse, in one line, a tracker the config asks for that cannot start: its library is not
    installed, or W&B is to log online and no login is found."""
    for wanted, module, extra, key in (
        (config.use_tensorboard, "tensorboard", "tensorboard", "use_tensorboard"),
        (_wants_wandb(config), "wandb", "wandb", "wandb_project"),
    ):
        if wanted and importlib.util.find_spec(module) is None:
            raise ShardpoolError(
                f"`{key}` needs the {module} package: pip install 'shardpool[{extra}]', or remove `{key}`"
            )
    if _wants_wandb(config) and _wandb_mode(config) == "online" and not _wandb_logged_in():
        raise ShardpoolError(_NO_LOGIN)


def _wandb_mode(config: Config) -> str:
    """The mode wandb will run in: the config's ``wandb_mode``, else ``WANDB_MODE``, else online."""
    mode = config.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    return "offline" if mode == "dryrun" else mode


def _wandb_logged_in() -> bool:
    """Whether wandb finds credentials (``WANDB_API_KEY``, its netrc entry, its settings) without
    prompting or reaching the server. True where this wandb cannot be asked: its own error then says."""
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:
        return True
    try:
        found = authenticate_session(
            host=wandb_setup.singleton().settings.base_url,
            source="shardpool",
            prompt=False,
            update_session=False,
        )
    except AuthenticationError as error:  # a key that is set but malformed
        raise ShardpoolError(
            f"the W&B login is broken ({_first_line(error)}); run `wandb login --relogin`"
        ) from None
    return found is not None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class Trackers:
    """The open sinks of one run; :meth:`log` takes each metrics.jsonl line, :meth:`close` ends them."""

    def __init__(self) -> None:
        self.sinks: list[Callable[[int, dict[str, float]], None]] = []
        self.sample_sinks: list[Callable[[int, list[list[Any]]], None]] = []
        self.closers: list[Callable[[], None]] = []

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics line (a step, a periodic eval, or a round of samples) to every sink."""
        if record.get("event") == "samples":
            rows = sample_rows(record)
            for sample_sink in self.sample_sinks:
                sample_sink(int(record["step"]), rows)
            return
        scalars = hf_scalars(record)
        for sink in self.sinks:
            sink(int(record["step"]), scalars)

    def close(self) -> None:
        """Flush and close every sink (W&B marks the run finished)."""
        for close in self.closers:
            close()
        self.sinks.clear()
        self.sample_sinks.clear()
        self.closers.clear()


def _tensorboard(trackers: Trackers, output_dir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(output_dir / "runs"))

    def log(step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, global_step=step)

    def log_samples(step: int, rows: list[list[Any]]) -> None:
        writer.add_text("samples", _markdown_table(rows), global_step=step)

    trackers.sinks.append(log)
    trackers.sample_sinks.append(log_samples)
    trackers.closers.append(writer.close)


def _markdown_table(rows: list[list[Any]]) -> str:
    """Rows as the Markdown table TensorBoard's text tab renders (``|`` and line breaks escaped)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _wandb(trackers: Trackers, config: Config, output_dir: Path) -> None:
    import wandb

    try:
        run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.wandb_name,
            id=config.wandb_run_id,
            resume="allow" if config.wandb_run_id else None,
            mode=config.wandb_mode,
            dir=str(output_dir),
            config=config.model_dump(mode="json"),
        )
    except wandb.Error as error:
        raise ShardpoolError(
            f"W&B could not start the run ({_first_line(error)}); check `wandb login`, or log offline "
            "with WANDB_MODE=offline"
        ) from None
    trackers.sinks.append(lambda step, scalars: run.log(scalars, step=step))
    trackers.sample_sinks.append(
        lambda step, rows: run.log(
            {"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step
        )
    )
    trackers.closers.append(run.finish)


def open_trackers(config: Config, output_dir: Path) -> Trackers:
    """The sinks ``config`` asks for, opened; an empty :class:`Trackers` when it asks for none."""
    check_trackers(config)
    trackers = Trackers()
    output_dir.mkdir(parents=True, exist_ok=True)
    if config.use_tensorboard:
        _tensorboard(trackers, output_dir)
    if _wants_wandb(config):
        _wandb(trackers, config, output_dir)
    return trackers
