"""One stage process, top to bottom: set-up, the step, eval and save.

Read it like a single-device loop. The process joins the others at the launcher's rendezvous
store, builds its stage (its layers of the NF4 base, with LoRA), loads the tokenized data and the
same step plan as the launcher, and sets up AdamW and the LR schedule over its LoRA parameters.
Then, per optimizer step:
  1. it runs its schedule of forward and backward micro-batches (:mod:`shardpool.train.pipeline`);
     the last stage's loss is divided by the label tokens of the *whole* step;
  2. replicas sum their LoRA gradients; the gradients are clipped on the global norm over all
     stages (:mod:`shardpool.train.loss`); AdamW and the LR schedule step;
  3. every rank's figures of the step are gathered in one all-gather
     (:mod:`shardpool.train.step_report`) and rank 0 reports the step.
It evaluates before, after, and every ``eval_steps`` (:mod:`shardpool.train.evaluate`; the cadence
is :mod:`shardpool.data.cadence`), sends checkpoints and the final LoRA tensors to the launcher
(:mod:`shardpool.train.stage_state`), and reports to it by JSON events on stdout. Because each
stage runs exactly the layers of the single-device model on exactly the same inputs, and gradients
accumulate in micro-batch order, the result is the single-device result.

What a rank does when the run changes while it trains (the re-balance check's re-shard, a growth
in place, the beat and the step-boundary copies) is :class:`shardpool.elastic.rank.ElasticStageWorker`,
which extends this class at the points marked "elastic hook" and is what a stage process runs
(``python -m shardpool.elastic.rank JOB_JSON RANK``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.events import EVENT_PREFIX, STAGE_COPY_FIGURES, StageEvent
from shardpool.contract.job import Job
from shardpool.data.cadence import config_steps_per_epoch, epoch_at, eval_step_set, save_step_set
from shardpool.data.prepared_file import load_prepared
from shardpool.data.rows import PreparedData
from shardpool.data.steps import config_step_batches, consecutive_pairs, pair_rows
from shardpool.host.memory_limit import resident_memory
from shardpool.model.lora import lora_settings, read_adapter_tensors
from shardpool.model.nf4 import DTYPES, nf4_backend_of
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage
from shardpool.train.evaluate import evaluate
from shardpool.train.kernels import apply_tf32, stage_attention
from shardpool.train.loss import label_tokens, reduce_and_clip_gradients
from shardpool.train.loss_scale import LossScale, inject_inf_at
from shardpool.train.optim import build_optimizer, build_scheduler
from shardpool.train.pipeline import StagePipe
from shardpool.train.preference import PreferenceObjective
from shardpool.train.process_group import (
    Groups,
    PeerCheck,
    Wire,
    join_process_group,
    leave_process_group,
    others_in_world,
    select_device,
)
from shardpool.train.runfiles import DATA_INPUT, INIT_ADAPTER_PREFIX, RunFiles
from shardpool.train.samples import report_samples
from shardpool.train.stage_state import (
    StageState,
    restore_stage_state,
    send_checkpoint,
    send_final_lora,
)
from shardpool.train.step_report import GatheredStep, StepReport, gather_step_reports

__all__ = ["StageWorker", "emit", "peak_rss_bytes", "stage_spec"]


def emit(event: dict[str, Any]) -> None:
    """Send one JSON event line to the launcher over stdout."""
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it excludes the parent's)."""
    resident = resident_memory()
    if resident is not None:
        return resident.peak_bytes
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def stage_spec(job: Job, rank: int) -> StageSpec:
    """The StageSpec a global rank builds: its stage's layers and device, from the job's placement."""
    index = job.stage_index(rank)
    placement = job.placement(rank)
    return StageSpec(
        index=index,
        num_stages=job.num_stages,
        start=placement.start,
        stop=placement.stop,
        device=placement.device,
    )


class StageWorker:
    """One stage process of one replica: builds its stage, then trains it step by step."""

    def __init__(
        self,
        job: Job,
        rank: int,
        *,
        job_dir: Path | None = None,
        store: Any | None = None,
        events: Callable[[dict[str, Any]], None] = emit,
    ) -> None:
        self.job = job
        self.rank = rank
        self.job_dir = job_dir
        self.store = store  # a rendezvous store already joined (the elastic rank's sealed one), else the job's is joined
        self.emit = events  # where this rank's events go: stdout lines for a launcher, or a callback
        self.config = job.parsed_config()
        self.spec = stage_spec(job, rank)
        self.replica = job.replica_index(rank)
        self.device = torch.device(self.spec.device)
        # This stage's dtype: the planner's choice for its device, else the config's.
        self.compute_dtype_name = job.rank_dtype(rank)
        self.compute_dtype = DTYPES[self.compute_dtype_name]
        self.data: PreparedData
        self.steps: list[list[list[int]]] = []
        self.epoch_steps = 1.0
        self.eval_at: frozenset[int] = frozenset()
        self.save_at: frozenset[int] = frozenset()
        self.groups: Groups
        self.pipe: StagePipe
        self.state: StageState
        self.rendezvous: Any = None  # the joined rendezvous store
        self.eval_before: float | None = job.eval_before
        self.reference_pass_s: float | None = None  # precompute_ref_log_probs: its passes' seconds

    # ----- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        """Join the process group, build the stage, load the data and the optimizer."""
        select_device(self.device)  # before anything touches it: a joining rank builds its stage first
        torch.set_num_threads(self._threads())
        torch.manual_seed(self.config.seed + self.rank)
        timeout = timedelta(seconds=self.job.timeout_s)
        store = self.store
        if store is None and self.job.world_size > 1:  # a lone stage joins no group (process_group)
            store = dist.TCPStore(
                self.job.master_addr, self.job.master_port, is_master=False, timeout=timeout
            )
        self.rendezvous = store
        if self._joins_group_at_setup():
            self._join_group(store)
        self.files = RunFiles(self.job, job_dir=self.job_dir)
        lora = lora_settings(self.config, check_init_adapter=False)
        self.base = BaseSettings(
            quantize=self.config.adapter == "qlora",
            quant_type=self.config.bnb_config_kwargs.bnb_4bit_quant_type,
            double_quant=self.config.bnb_config_kwargs.bnb_4bit_use_double_quant,
            compute_dtype=self.compute_dtype_name,
            gradient_checkpointing=self.config.gradient_checkpointing,
            attn_implementation=stage_attention(self.config, self.device, self.compute_dtype_name),
            nf4_backend=self.job.rank_nf4_backend(self.rank),
        )
        apply_tf32(self.config, self.device)
        if lora.init_from:
            lora = replace(lora, init_from=str(self.files.adapter_dir(INIT_ADAPTER_PREFIX)))
        self.lora = lora
        stage = self._load_stage(self.spec)
        self.data = load_prepared(self.files.path(DATA_INPUT))
        self.steps = config_step_batches(
            self.config, len(self.data.train), replicas=self.config.shardpool.replicas
        )
        self._set_cadence()
        self._stage_built(stage)

    def _joins_group_at_setup(self) -> bool:
        """Whether :meth:`setup` joins the process group (elastic hook: a joining rank joins later)."""
        return True

    def _stage_built(self, stage: PipelineStage) -> None:
        """Train ``stage`` from here (elastic hook: a joining rank first takes its state)."""
        self._train_stage(stage, loss_scale=LossScale() if self.job.scales_loss else None)

    def _join_group(self, store: Any) -> None:
        """Join this job's process group and make the wire."""
        self.groups = join_process_group(
            store=self._group_store(store),
            rank=self.rank,
            world_size=self.job.world_size,
            num_stages=self.job.num_stages,
            replicas=self.job.replicas,
            device=self.device,
            places=[self._place(rank) for rank in range(self.job.world_size)],
            timeout=timedelta(seconds=self.job.timeout_s),
            peers=self._peer_check(store),
        )
        self.wire = Wire.for_rank(
            self.groups,
            rank=self.rank,
            is_first=self.spec.is_first,
            is_last=self.spec.is_last,
            device=self.device,
            wire_dtype=DTYPES[self.config.wire_dtype_name],
            compute_dtype=self.compute_dtype,
        )

    def _group_store(self, store: Any) -> Any:
        """The store this job's process group meets at (elastic hook: a grown job's has a prefix)."""
        return store

    def _peer_check(self, store: Any) -> PeerCheck | None:
        """How the ranks of this job's groups prove the run's key to each other (elastic hook:
        the key of the sealed store; None: no check)."""
        return None

    def _load_stage(
        self, spec: StageSpec, *, reuse: dict[str, torch.nn.Module] | None = None
    ) -> PipelineStage:
        """Build the layers of ``spec`` (NF4 base from the model files or the launcher, fresh LoRA).

        ``reuse``: base modules this process already holds, taken as they are (a re-shard).
        """
        with self.files.weight_reader() as reader:
            return build_stage(
                self.files.model_dir(),
                spec,
                self.base,
                self.lora,
                seed=self.config.seed,
                reader=reader,
                reuse=reuse,
            )

    def _train_stage(self, stage: PipelineStage, *, loss_scale: LossScale | None) -> None:
        """Put ``stage`` in the pipe and give its LoRA parameters a fresh AdamW and LR schedule."""
        self.pipe = StagePipe(
            stage,
            self.spec,
            self.wire,
            self.device,
            int(stage.hf_config.hidden_size),
            packed=self.data.packed,
            objective=PreferenceObjective.of(self.config),
            reference_adapter=self._reference_adapter(stage),
        )
        named_params = stage.named_lora_parameters()
        optimizer = build_optimizer(self.config, [param for _, param in named_params], self.device)
        scheduler = build_scheduler(self.config, optimizer, len(self.steps))
        self.state = StageState(named_params, optimizer, scheduler, loss_scale=loss_scale, device=self.device)

    def _reference_adapter(self, stage: PipelineStage) -> dict[str, torch.Tensor] | None:
        """A preference run's reference LoRA tensors of ``stage``: the starting adapter's
        (``lora_model_dir``, read from its files so that a resumed or re-sharded stage gets the same),
        or None (the reference is the base alone)."""
        if self.config.rl is None or not self.lora.init_from:
            return None
        tensors = read_adapter_tensors(self.lora.init_from)
        return {
            key: tensors[key].to(param.device, param.dtype) for key, param in stage.named_lora_parameters()
        }

    def _set_cadence(self) -> None:
        """Which steps evaluate and save, and how many steps an epoch takes (for ``epoch``)."""
        total = len(self.steps)
        self.epoch_steps = config_steps_per_epoch(
            self.config, len(self.data.train), replicas=self.config.shardpool.replicas
        )
        self.eval_at = eval_step_set(
            self.config, total_steps=total, epoch_steps=self.epoch_steps, num_eval_rows=len(self.data.eval)
        )
        self.save_at = save_step_set(self.config, total_steps=total, epoch_steps=self.epoch_steps)

    def _threads(self) -> int:
        """Intra-op threads: the configured count, else the agent's or launcher's usable CPUs over its stage processes."""
        if self.config.shardpool.threads_per_stage:
            return self.config.shardpool.threads_per_stage
        agent_threads = os.environ.get("SHARDPOOL_THREADS")  # the agent's: usable CPUs over its ranks
        if agent_threads:
            return max(1, int(agent_threads))
        return self.job.threads_per_process

    def _place(self, rank: int) -> str:
        """The physical device of ``rank``: its host and torch device, as the job places it."""
        placement = self.job.placement(rank)
        return f"{placement.host}/{torch.device(placement.device)}"

    # ----- the run ------------------------------------------------------------------------
    def run(self) -> None:
        """Train from the start or from a checkpoint, evaluate, and write the adapter."""
        self._before_setup()
        self.setup()
        first_step = self._first_step()
        total_steps = len(self.steps)
        for step in range(first_step, total_steps):
            self.train_step(step)
            done = step + 1
            if done in self.eval_at and done < total_steps:
                self.report_eval(done, self.evaluate())
                self.report_samples(done)
            if done in self.save_at:
                self.save_checkpoint(done, eval_before=self.eval_before)
            self._at_step_boundary(done, total_steps)
        self._training_over()
        eval_after = self.evaluate(save_logits=True)
        if total_steps in self.eval_at:
            self.report_eval(total_steps, eval_after)  # the final eval is the last step's
        self.report_samples(total_steps)
        self.write_final_adapter()
        self.emit(
            {
                "event": StageEvent.STAGE_DONE,
                "rank": self.rank,
                "stage": self.spec.index,
                "peak_rss_bytes": peak_rss_bytes(),
                "peak_device_bytes": self._peak_device_bytes(),
                "peak_device_reserved_bytes": self._peak_device_reserved_bytes(),
                "nf4_backend": nf4_backend_of(self.pipe.stage),
                "reference_pass_s": self.reference_pass_s,
            }
        )
        if self.rank == 0:
            self.emit({"event": StageEvent.DONE, "eval_before": self.eval_before, "eval_after": eval_after})
        self._after_run()
        leave_process_group()

    def _first_step(self) -> int:
        """Restore the checkpoint to resume from (or start at 0 and evaluate before training); tell
        the launcher the stages are ready; return the first step to train (elastic hook: a joining
        rank starts where the running ones grew)."""
        first_step = (
            restore_stage_state(self.files, self.job, self.state, rank=self.rank)
            if self.job.resume_step
            else 0
        )
        if self.rank == 0:
            self.emit({"event": StageEvent.READY, "total_steps": len(self.steps), "first_step": first_step})
        if first_step == 0:
            self.eval_before = self.evaluate()
        return first_step

    def _before_setup(self) -> None:
        """Before anything is built (elastic hook: the beat starts here)."""

    def _at_step_boundary(self, done: int, total_steps: int) -> None:
        """After step ``done`` was reported, evaluated and saved (elastic hook: re-shard, grow, copy)."""

    def _training_over(self) -> None:
        """After the last step, before the final eval (elastic hook: the last copy is waited for)."""

    def _after_run(self) -> None:
        """After the last event, before the process group is left (elastic hook: the beat stops)."""

    def _extend_report(self, step: int, report: StepReport) -> StepReport:
        """This rank's report of ``step`` as gathered (elastic hook: copy figures, room, grow flag)."""
        return report

    def _gathered(self, gathered: GatheredStep) -> None:
        """Every rank's report of the step just trained (elastic hook: whether the job grows now)."""

    def _peak_device_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    def _peak_device_reserved_bytes(self) -> int | None:
        """What the CUDA caching allocator held at most (allocated plus its cache), for gpu_check's ratios."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device))
        return None

    def train_step(self, step: int) -> None:
        """One optimizer step: the schedule's micro-batches, gradient sync, clip, AdamW."""
        if self.config.precompute_ref_log_probs and self.pipe.reference_table is None:
            self._precompute_reference()
        started = time.perf_counter()
        wire = self.pipe.wire
        wire.wait_seconds = 0.0
        all_microbatches = [self.data.train.select(rows) for rows in self.steps[step]]
        if self.pipe.objective is not None:  # the loss is a mean over the step's pairs
            step_label_tokens = sum(len(batch) // 2 for batch in all_microbatches)
        else:
            step_label_tokens = sum(label_tokens(batch.labels) for batch in all_microbatches)
        first, stop = self.job.microbatch_range(self.replica, self.config.gradient_accumulation_steps)
        mine = all_microbatches[first:stop]
        pairs = [rows[: len(rows) // 2] for rows in self.steps[step][first:stop]]
        scale = self.state.loss_scale
        self.pipe.loss_scale = scale.scale if scale else None
        totals = self.pipe.run_schedule(
            self.config.shardpool.schedule, mine, step_label_tokens, lead=self.job.warmup_lead, pairs=pairs
        )
        wire.flush()
        grads = [param.grad for _, param in self.state.named_params]
        if scale and self.spec.index == 0 and inject_inf_at() == step + 1:
            grads[0].fill_(float("inf"))  # the test hook: an overflow on one stage only
        sync_started = time.perf_counter()
        grad_norm, step_loss, finite = reduce_and_clip_gradients(
            grads,
            self.groups.replicas(self.spec.index),
            loss=totals.loss_value(),
            replicas=self.job.replicas,
            max_grad_norm=self.config.max_grad_norm,
            loss_scale=scale.scale if scale else None,
        )
        preference = self._preference_metrics(totals.preference_sums, step_label_tokens)
        sync_seconds = time.perf_counter() - sync_started
        if finite:
            self.state.optimizer.step()
            self.state.scheduler.step()
        self.state.optimizer.zero_grad(set_to_none=True)
        if scale:
            scale.update(finite=finite)
        report = self._extend_report(
            step,
            StepReport(
                compute_s=totals.compute_seconds,
                wait_s=wire.wait_seconds,
                bytes_sent=wire.bytes_sent,
                sync_s=sync_seconds,
                in_flight=totals.peak_in_flight,
            ),
        )
        gathered = gather_step_reports(report, self.job.world_size)
        self._gathered(gathered)
        wire.bytes_sent = 0
        if self.rank == 0:
            step_seconds = time.perf_counter() - started
            tokens = sum(int(batch.attention_mask.sum()) for batch in all_microbatches)
            self.emit(
                {
                    "event": StageEvent.STEP,
                    "step": step + 1,
                    "epoch": epoch_at(step + 1, self.epoch_steps),
                    "loss": step_loss,
                    "learning_rate": self.state.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens / step_seconds,
                    "step_seconds": step_seconds,
                    "stage_compute_s": gathered.compute_s,
                    "stage_wait_s": gathered.wait_s,
                    "bytes_sent": gathered.bytes_sent,
                    "stage_sync_s": gathered.sync_s,
                    "stage_in_flight": gathered.in_flight,
                }
                | (
                    dict(zip(STAGE_COPY_FIGURES, gathered.copy_figures, strict=True))
                    if gathered.copy_figures is not None
                    else {}
                )
                | ({"loss_scale": scale.scale, "skipped_step": not finite} if scale else {})
                | ({"stage_room_bytes": gathered.rooms} if gathered.rooms is not None else {})
                | ({"preference": preference} if preference else {})
            )

    def _precompute_reference(self) -> None:
        """``precompute_ref_log_probs``: every training pair through this pipeline once, in pair order
        and micro-batches of ``micro_batch_size`` pairs, with the reference policy (the first step
        of every rank of the pipeline runs it, so the stages meet; a rebuilt stage runs it again)."""
        started = time.perf_counter()
        num_pairs = len(self.data.train) // 2
        pairs = consecutive_pairs(num_pairs, self.config.micro_batch_size)
        batches = [self.data.train.select(pair_rows(indices, num_pairs)) for indices in pairs]
        self.pipe.precompute_reference(batches, pairs)
        self.reference_pass_s = (self.reference_pass_s or 0.0) + time.perf_counter() - started

    def _preference_metrics(self, sums: torch.Tensor | None, pairs: int) -> dict[str, float]:
        """A preference step's metrics (TRL's names), means over the step's pairs: the last stages'
        sums, added over the world (every rank joins; the others add zeros). Empty for SFT."""
        if self.pipe.objective is None:
            return {}
        names = self.pipe.objective.metrics
        total = sums if sums is not None else torch.zeros(len(names), dtype=torch.float64)
        if others_in_world():
            dist.all_reduce(total)
        return {name: float(value) / pairs for name, value in zip(names, total.tolist(), strict=True)}

    def evaluate(self, *, save_logits: bool = False) -> float | None:
        """Mean next-token loss over the eval split through replica 0's pipeline (None if no split)."""
        return evaluate(
            self.pipe,
            self.data.eval,
            micro_batch_size=self.config.micro_batch_size,
            replica=self.replica,
            logits_to=self.files if save_logits else None,
        )

    def report_eval(self, step: int, eval_loss: float | None) -> None:
        """Send the eval loss after ``step`` to the launcher (rank 0), which writes its metrics line."""
        if self.rank == 0 and eval_loss is not None:
            self.emit(
                {
                    "event": StageEvent.EVAL,
                    "step": step,
                    "epoch": epoch_at(step, self.epoch_steps),
                    "eval_loss": eval_loss,
                }
            )

    def report_samples(self, step: int) -> None:
        """Complete ``shardpool.sample_prompts`` greedily on replica 0's pipeline after ``step``; rank
        0 reports them (:mod:`shardpool.train.samples`)."""
        report_samples(self.pipe, self.job, step=step, rank=self.rank, emit=self.emit)

    # ----- saving -----------------------------------------------------------------------------
    def save_checkpoint(self, step: int, *, eval_before: float | None) -> None:
        """Send every stage's part of a checkpoint to the launcher, which then renames it into place."""
        partial = send_checkpoint(
            self.files, self.state, step, rank=self.rank, stage=self.spec.index, replica=self.replica
        )
        if self.rank == 0:
            self.emit(
                {
                    "event": StageEvent.CHECKPOINT_WRITTEN,
                    "step": step,
                    "partial": partial,
                    "eval_before": eval_before,
                }
            )

    def write_final_adapter(self) -> None:
        """Send every stage's LoRA tensors to the launcher, which merges them into one PEFT adapter."""
        directory = send_final_lora(self.files, self.state, stage=self.spec.index, replica=self.replica)
        if self.rank == 0:
            self.emit({"event": StageEvent.FINAL_WRITTEN, "directory": directory})
