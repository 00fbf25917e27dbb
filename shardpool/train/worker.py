"""One stage process, top to bottom: ``python -m shardpool.train.worker JOB_JSON RANK``.

Read it like a single-device loop. The process joins the others at the launcher's rendezvous
store, builds its stage (its layers of the NF4 base, with LoRA), loads the tokenized data and the
same step plan as the launcher, and sets up AdamW and the LR schedule over its LoRA parameters.
Then, per optimizer step:
  1. it runs its schedule of forward and backward micro-batches (:mod:`shardpool.train.pipeline`);
     the last stage's loss is divided by the label tokens of the *whole* step;
  2. replicas sum their LoRA gradients; the gradients are clipped on the global norm over all
     stages (:mod:`shardpool.train.loss`); AdamW and the LR schedule step.
After the job's re-balance check step every rank waits for the launcher's decision and, if it
moves the layer boundaries, re-shards in place (:meth:`StageWorker.reshard`). With
``job.keep_state``, rank 0 also looks for the launcher's grow decision after every step (a member
joined: :mod:`shardpool.contract.grow`), and every rank moves to the grown job in place after the
same step (:meth:`StageWorker.grow`); a rank started ``joining`` builds its stage first and then
takes its state from the running ones (:meth:`StageWorker.join_running`).
It evaluates before, after, and every ``eval_steps`` (:mod:`shardpool.train.evaluate`; the cadence
is :mod:`shardpool.data.cadence`), sends checkpoints and the final
LoRA tensors to the launcher (:mod:`shardpool.train.stage_state`), and reports to it by JSON
events on stdout. Because each stage runs exactly the layers of the single-device model on
exactly the same inputs, and gradients accumulate in micro-batch order, the result is the
single-device result.

With ``job.keep_state`` (mesh runs with ``on_member_loss: continue``; contract in
:mod:`shardpool.contract.liveness`, stage side in :mod:`shardpool.train.liveness`) the process also
beats on the rendezvous store from its first moment, before the model is built, and after every
step (after that step's re-shard, if any) hands CPU clones of its checkpoint files to a background
thread that writes them into ``live_dir(step)`` and counts them on ``live_key(step)`` while the
next step computes; the last copy is waited for before the final eval. Without it neither runs.
``SHARDPOOL_TEST_KEEP_STATE=1`` turns it on in a local run (a bench and test hook).

A failure is reported to the launcher as one JSON ``error`` event naming the stage, with the full
traceback in the stage's log (stderr), and the process exits at once with status 1 so that no
collective is left waiting on it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.events import EVENT_PREFIX, STAGE_COPY_FIGURES, StageEvent
from shardpool.contract.grow import (
    decode_growth,
    group_prefix,
    grow_key,
    job_growth_moves,
    ready_key,
    schedule_key,
    step_key,
)
from shardpool.contract.job import Job
from shardpool.contract.liveness import beat_key
from shardpool.contract.rebalance import decode_decision, decode_shares
from shardpool.data.cadence import config_steps_per_epoch, epoch_at, eval_step_set, save_step_set
from shardpool.data.prepared_file import load_prepared
from shardpool.data.rows import PreparedData
from shardpool.data.steps import config_step_batches
from shardpool.errors import ShardpoolError
from shardpool.host.memory_limit import resident_memory
from shardpool.model.lora import lora_settings
from shardpool.model.nf4 import DTYPES, nf4_backend_of
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage, reusable_modules
from shardpool.train import checkpoint as ckpt
from shardpool.train.evaluate import evaluate
from shardpool.train.kernels import apply_tf32, stage_attention
from shardpool.train.liveness import StateCopier, cpu_clones, start_beat, store_client
from shardpool.train.loss import gather_timings, label_tokens, reduce_and_clip_gradients
from shardpool.train.loss_scale import LossScale, inject_inf_at
from shardpool.train.optim import build_optimizer, build_scheduler
from shardpool.train.pipeline import StagePipe
from shardpool.train.process_group import Groups, Wire, join_process_group, leave_process_group, select_device
from shardpool.train.reshard import (
    await_decision,
    await_key,
    exchange_by_position,
    exchange_state,
    kept_state,
    module_layer,
    room_bytes,
    state_position,
)
from shardpool.train.runfiles import DATA_INPUT, INIT_ADAPTER_PREFIX, RunFiles
from shardpool.train.stage_state import (
    StageState,
    checkpoint_files,
    load_lora_and_optimizer,
    restore_stage_state,
    send_checkpoint,
    send_final_lora,
)

__all__ = [
    "stage_spec",
    "StageWorker",
    "emit",
    "main",
    "peak_rss_bytes",
    "run_stage_process",
]


def main(argv: list[str]) -> int:
    """Run one stage process and report how it ended."""
    job_path, rank = argv[0], int(argv[1])
    try:
        run_stage_process(job_path, rank)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the launcher
        traceback.print_exc(file=sys.stderr)
        message = str(error) if isinstance(error, ShardpoolError) else f"{type(error).__name__}: {error}"
        emit(
            {
                "event": StageEvent.ERROR,
                "rank": rank,
                "message": message.splitlines()[0] if message else type(error).__name__,
            }
        )
        sys.stderr.flush()
        os._exit(1)
    return 0


#: Bench and test hook: ``1`` turns on the job's ``keep_state`` in a local run (beat and step-boundary copies).
KEEP_STATE_HOOK = "SHARDPOOL_TEST_KEEP_STATE"


def run_stage_process(job_path: str, rank: int) -> None:
    """Train rank ``rank`` of the job in ``job_path`` to the end, then delete what it fetched."""
    job = Job.read(job_path)
    if os.environ.get(KEEP_STATE_HOOK) == "1":
        job = job.model_copy(update={"keep_state": True})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker = StageWorker(job, rank, job_dir=Path(job_path).resolve().parent)
    try:
        worker.run()
    finally:
        if hasattr(worker, "files"):
            worker.files.close()


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
        self.store = store  # a rendezvous store already joined (torchrun's), else the job's is joined
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
        self.rendezvous: Any = None  # the joined rendezvous store: where the re-balance decision arrives
        self.layers = [(placement.start, placement.stop) for placement in job.stages]  # every stage's, now
        # keep_state: the step-boundary copies' writer, and what stops the beat.
        self.keeps_state = job.keep_state and job.world_size > 1
        self.copier: StateCopier | None = None
        self.stop_beat: Any = None
        #: Set in a step whose timing all-gather said the launcher grew the job (contract.grow).
        self.grow_due = False
        self.eval_before: float | None = job.eval_before

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
        if not self.job.joining:  # a joining rank meets the others once they move to its generation
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
        if self.job.joining:
            self._built = stage  # trained once the running ranks hand over its state (join_running)
            return
        self._train_stage(stage, loss_scale=LossScale() if self.job.scales_loss else None)

    def _join_group(self, store: Any) -> None:
        """Join this job's process group (its generation's, under its store prefix) and make the wire."""
        generation = self.job.generation
        if generation and store is not None:
            store = dist.PrefixStore(group_prefix(generation), store)
        self.groups = join_process_group(
            store=store,
            rank=self.rank,
            world_size=self.job.world_size,
            num_stages=self.job.num_stages,
            replicas=self.job.replicas,
            device=self.device,
            places=[self._place(rank) for rank in range(self.job.world_size)],
            timeout=timedelta(seconds=self.job.timeout_s),
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
        )
        named_params = stage.named_lora_parameters()
        optimizer = build_optimizer(self.config, [param for _, param in named_params], self.device)
        scheduler = build_scheduler(self.config, optimizer, len(self.steps))
        self.state = StageState(named_params, optimizer, scheduler, loss_scale=loss_scale, device=self.device)

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
        if self.keeps_state:  # before the model is built: a slow start must not look like a lost member
            _, self.stop_beat = start_beat(
                store_client(self.job.master_addr, self.job.master_port),
                self.rank,
                key=lambda: beat_key(self.rank, self.job.generation),
            )
        self.setup()
        if self.keeps_state:
            self.copier = StateCopier(
                self.files, store_client(self.job.master_addr, self.job.master_port), rank=self.rank
            )
        if self.job.joining:
            first_step = self.join_running()
            self.copy_state(first_step)  # the grown job copies the step it grew after: this rank too
        else:
            first_step = (
                restore_stage_state(self.files, self.job, self.state, rank=self.rank)
                if self.job.resume_step
                else 0
            )
            if self.rank == 0:
                self.emit(
                    {"event": StageEvent.READY, "total_steps": len(self.steps), "first_step": first_step}
                )
            if first_step == 0:
                self.eval_before = self.evaluate()
        total_steps = len(self.steps)
        for step in range(first_step, total_steps):
            self.train_step(step)
            done = step + 1
            if done in self.eval_at and done < total_steps:
                self.report_eval(done, self.evaluate())
            if done in self.save_at:
                self.save_checkpoint(done, eval_before=self.eval_before)
            if done == self.job.rebalance_at and done < total_steps:
                self.check_rebalance(done)
            if self.grow_due and done < total_steps:
                self.grow(done)
            self.copy_state(done)
        if self.copier is not None:
            self.copier.close()
        eval_after = self.evaluate(save_logits=True)
        if total_steps in self.eval_at:
            self.report_eval(total_steps, eval_after)  # the final eval is the last step's
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
            }
        )
        if self.rank == 0:
            self.emit({"event": StageEvent.DONE, "eval_before": self.eval_before, "eval_after": eval_after})
        if self.stop_beat is not None:
            self.stop_beat.set()
        leave_process_group()

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
        started = time.perf_counter()
        wire = self.pipe.wire
        wire.wait_seconds = 0.0
        all_microbatches = [self.data.train.select(rows) for rows in self.steps[step]]
        step_label_tokens = sum(label_tokens(batch.labels) for batch in all_microbatches)
        first, stop = self.job.microbatch_range(self.replica, self.config.gradient_accumulation_steps)
        mine = all_microbatches[first:stop]
        scale = self.state.loss_scale
        self.pipe.loss_scale = scale.scale if scale else None
        totals = self.pipe.run_schedule(
            self.config.shardpool.schedule, mine, step_label_tokens, lead=self.job.warmup_lead
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
        sync_seconds = time.perf_counter() - sync_started
        if finite:
            self.state.optimizer.step()
            self.state.scheduler.step()
        self.state.optimizer.zero_grad(set_to_none=True)
        if scale:
            scale.update(finite=finite)
        copier = self.copier
        copy_figures = (
            () if copier is None else (copier.copy_seconds, copier.blocked_seconds, copier.cpu_seconds)
        )
        grow_flag = (self._grow_announced(),) if copier is not None else ()
        # the re-balance check's split, and a growth in place (a job that copies its state), respect each rank's room
        measures_room = step + 1 == self.job.rebalance_at or copier is not None
        room = (float(room_bytes(self.device, rank=self.rank)),) if measures_room else ()
        timings = gather_timings(
            totals.compute_seconds, wire.wait_seconds, wire.bytes_sent, self.job.world_size,
            sync_seconds, totals.peak_in_flight, *copy_figures, *room, *grow_flag,
        )  # fmt: skip
        if grow_flag:
            self.grow_due = max(timings.pop()) > 0
        rooms = [int(value) for value in timings.pop()] if room else None
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
                    "stage_compute_s": timings[0],
                    "stage_wait_s": timings[1],
                    "bytes_sent": timings[2],
                    "stage_sync_s": timings[3],
                    "stage_in_flight": [int(count) for count in timings[4]],
                }
                | (dict(zip(STAGE_COPY_FIGURES, timings[5:], strict=True)) if copy_figures else {})
                | ({"loss_scale": scale.scale, "skipped_step": not finite} if scale else {})
                | ({"stage_room_bytes": rooms} if rooms is not None else {})
            )

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

    # ----- re-balancing -------------------------------------------------------------------
    def check_rebalance(self, step: int) -> None:
        """Wait for the launcher's decision after ``step`` (every rank reads the same key); re-shard if asked."""
        answer = await_decision(self.rendezvous, step, timeout_s=self.job.timeout_s)
        if self.job.shares is not None:  # replicas on shares of the step: nothing moves but the shares
            shares = decode_shares(answer, current=self.job.shares)
            if shares is not None:
                self.job = self.job.model_copy(update={"shares": shares})
            return
        new = decode_decision(answer, current=self.layers)
        if new is not None:
            self.reshard(new)

    def reshard(self, new: list[tuple[int, int]]) -> None:
        """Move to the layers ``new`` gives this stage, in place: same process, rank, device and groups.

        The LoRA tensors and AdamW state at this step boundary go by global key to the stage that
        now owns their layer (:func:`shardpool.train.reshard.exchange_state`); this stage then drops
        the layers it no longer holds, builds those it gains (from the model files, or on the mesh
        from the launcher through the weight cache) around the base modules it keeps, and restores
        the state, the LR schedule's position and the learning rate as they were.
        """
        started = time.perf_counter()
        index = self.spec.index
        old = self.layers
        tensors = ckpt.stage_state_tensors(
            named_parameters=self.state.named_params, optimizer=self.state.optimizer
        )
        received = exchange_state(
            tensors, old=old, new=new, stage=index, replica=self.replica, rank=self.rank
        )
        wanted = kept_state(tensors, old=old[index], new=new[index]) | received
        wanted = {name: tensor.detach().clone() for name, tensor in wanted.items()}
        schedule = self.state.scheduler.state_dict()
        rates = [group["lr"] for group in self.state.optimizer.param_groups]
        del tensors, received
        start, stop = new[index]
        self.spec = replace(self.spec, start=start, stop=stop)
        self.layers = list(new)
        self._rebuild_stage()
        keys = [key for key, _ in self.state.named_params]
        load_lora_and_optimizer(self.state, *ckpt.lora_and_optimizer_from(wanted, keys))
        self.state.scheduler.load_state_dict(schedule)
        for group, rate in zip(self.state.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        dist.barrier()
        print(
            f"shardpool: re-sharded layers [{old[index][0]}, {old[index][1]}) -> "
            f"[{self.spec.start}, {self.spec.stop}) in {time.perf_counter() - started:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    # ----- growing in place (a member joined) ---------------------------------------------------
    def _grow_announced(self) -> float:
        """1.0 when rank 0 finds the launcher's grow decision for the next generation, else 0.0.

        Only rank 0 asks the store; the step's timing all-gather tells every rank, so all of them
        grow after the same step.
        """
        if self.rank != 0 or self.rendezvous is None:
            return 0.0
        return 1.0 if self.rendezvous.check([grow_key(self.job.generation + 1)]) else 0.0

    def grow(self, step: int) -> None:
        """Move to the grown job after ``step``, in place (:mod:`shardpool.contract.grow`).

        Rank 0 tells the joining ranks the step and the schedule's position. Every rank then
        leaves the process group, joins the grown one with its new rank, hands the state of the
        layers it loses to their new owner, and rebuilds its stage around the base layers it keeps.
        """
        started = time.perf_counter()
        generation = self.job.generation + 1
        store = self.rendezvous
        schedule = self._schedule_state()
        if self.rank == 0:
            store.set(schedule_key(generation), json.dumps(schedule))
            store.set(step_key(generation), str(step))
        growth = decode_growth(store.get(grow_key(generation)))
        grown = self._grown(growth.job, generation)
        tensors = ckpt.stage_state_tensors(
            named_parameters=self.state.named_params, optimizer=self.state.optimizer
        )
        old_rank, old_layers, old_range = self.rank, self.layers, (self.spec.start, self.spec.stop)
        if self.copier is not None:
            self.copier.wait()
        leave_process_group()
        self._adopt(grown, growth.ranks[old_rank])
        self._join_group(store)
        received = exchange_by_position(
            tensors,
            job_growth_moves(old_layers, self.layers, replicas=grown.replicas, renumber=growth.ranks),
            rank=self.rank,
            num_layers=self.layers[-1][1],
        )
        mine = self._positions()
        wanted = {name: tensor for name, tensor in tensors.items() if self._position(name) in mine} | received
        wanted = {name: tensor.detach().clone() for name, tensor in wanted.items()}
        del tensors, received
        self._rebuild_stage()
        self._restore_state(wanted, schedule)
        dist.barrier()
        print(
            f"shardpool: grew in place after step {step}: rank {old_rank} -> {self.rank}, layers "
            f"[{old_range[0]}, {old_range[1]}) -> [{self.spec.start}, {self.spec.stop}) "
            f"in {time.perf_counter() - started:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    def join_running(self) -> int:
        """A joining rank: say it is ready, wait for the step the running ranks grow after, join
        their grown process group and take its layers' state from them; return that step."""
        generation = self.job.generation
        store = self.rendezvous
        store.add(ready_key(generation), 1)
        timeout_s = self.job.timeout_s
        step = int(await_key(store, step_key(generation), timeout_s=timeout_s, what="step to join after"))
        schedule = json.loads(
            await_key(store, schedule_key(generation), timeout_s=timeout_s, what="schedule")
        )
        growth = decode_growth(
            await_key(store, grow_key(generation), timeout_s=timeout_s, what="grow decision")
        )
        self._join_group(store)
        self._train_stage(self._built, loss_scale=LossScale() if self.job.scales_loss else None)
        del self._built
        received = exchange_by_position(
            {},
            job_growth_moves(
                growth.old_layers, self.layers, replicas=self.job.replicas, renumber=growth.ranks
            ),
            rank=self.rank,
            num_layers=self.layers[-1][1],
        )
        self._restore_state(received, schedule)
        self.eval_before = schedule["eval_before"]
        dist.barrier()
        print(
            f"shardpool: joined the running job after step {step} as rank {self.rank}",
            file=sys.stderr,
            flush=True,
        )
        return step

    def _grown(self, decided: dict[str, Any], generation: int) -> Job:
        """This rank's job grown as the decision says: only the stages change (and the generation);
        everything else (config, inputs, where files go) stays as the job this process was started with."""
        try:
            stages = decided["stages"]
        except (KeyError, TypeError):
            raise ShardpoolError("the grow decision holds no stages") from None
        return Job.model_validate(
            self.job.model_dump(mode="json")
            | {"stages": stages, "generation": generation, "joining": False, "rebalance_at": None}
        )

    def _adopt(self, job: Job, rank: int) -> None:
        """Become rank ``rank`` of ``job`` (a grown job): its stage, replica, dtype and layers."""
        spec = stage_spec(job, rank)
        if torch.device(spec.device) != self.device:
            raise ShardpoolError(f"the grown job moves rank {self.rank} from {self.device} to {spec.device}")
        self.job, self.rank, self.spec = job, rank, spec
        self.replica = job.replica_index(rank)
        self.compute_dtype_name = job.rank_dtype(rank)
        self.compute_dtype = DTYPES[self.compute_dtype_name]
        self.layers = [(placement.start, placement.stop) for placement in job.stages]
        if self.copier is not None:
            self.copier.rank = rank

    def _position(self, name: str) -> int:
        return state_position(name, self.layers[-1][1])

    def _positions(self) -> set[int]:
        """The state positions this rank's stage holds (contract.grow): its layers, and the ends it has."""
        positions = set(range(self.spec.start, self.spec.stop))
        if self.spec.is_first:
            positions.add(-1)
        if self.spec.is_last:
            positions.add(self.layers[-1][1])
        return positions

    def _schedule_state(self) -> dict[str, Any]:
        """What a joining rank cannot know: the LR schedule's position and rates, the loss scale, the eval loss before."""
        scale = self.state.loss_scale
        return {
            "scheduler_steps": int(self.state.scheduler.last_epoch),
            "rates": [float(group["lr"]) for group in self.state.optimizer.param_groups],
            "loss_scale": [float(value) for value in scale.state_tensor().tolist()] if scale else None,
            "eval_before": self.eval_before,
        }

    def _restore_state(self, tensors: dict[str, torch.Tensor], schedule: dict[str, Any]) -> None:
        """Load LoRA and optimizer state by key, and the schedule's position, rates and loss scale."""
        keys = [key for key, _ in self.state.named_params]
        load_lora_and_optimizer(self.state, *ckpt.lora_and_optimizer_from(tensors, keys))
        for _ in range(int(schedule["scheduler_steps"]) - int(self.state.scheduler.last_epoch)):
            self.state.scheduler.step()
        for group, rate in zip(self.state.optimizer.param_groups, schedule["rates"], strict=True):
            group["lr"] = rate
        if self.state.loss_scale is not None and schedule["loss_scale"] is not None:
            self.state.loss_scale.load_state_tensor(torch.tensor(schedule["loss_scale"], dtype=torch.float64))

    def _rebuild_stage(self) -> None:
        """Rebuild this rank's stage for ``self.spec``'s layers (a re-shard or a growth): keep the
        base modules it still owns, drop the rest with the old LoRA and optimizer, build the layers it
        gains, and give its LoRA a fresh AdamW (the caller restores the state), same loss scale."""
        start, stop = self.spec.start, self.spec.stop
        reuse = {
            path: module
            for path, module in reusable_modules(self.pipe.stage).items()
            if (layer := module_layer(path)) is None or start <= layer < stop
        }
        loss_scale = self.state.loss_scale
        self._drop_stage()
        with _rng_kept(self.device):  # building a stage draws from the global RNG; dropout must not see it
            stage = self._load_stage(self.spec, reuse=reuse)
        del reuse
        self._train_stage(stage, loss_scale=loss_scale)

    def _drop_stage(self) -> None:
        """Free the stage's layers, LoRA and optimizer state before the new ones are built."""
        del self.pipe, self.state
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----- saving -----------------------------------------------------------------------------
    def copy_state(self, step: int) -> None:
        """With keep_state: hand CPU clones of this rank's checkpoint files after ``step`` to the copier.

        Called after the step's re-shard (if any), so the copy holds the layers step + 1 trains.
        The clones are taken here, between steps; the writing and the store count happen in the
        copier's thread while the next step computes.
        """
        if self.copier is None:
            return
        started = time.perf_counter()
        files = checkpoint_files(self.state, rank=self.rank, stage=self.spec.index, replica=self.replica)
        self.copier.submit(
            step, {name: cpu_clones(tensors) for name, tensors in files.items()}, since=started
        )

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


@contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """Restore this process's torch RNG state (and the CUDA device's) after the block."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
