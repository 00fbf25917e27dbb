"""The training loop of one stage process: forward and backward micro-batches over torch.distributed.

Read it top to bottom like a single-device loop. Per optimizer step a stage:
  1. runs its schedule (1F1B or GPipe): receives activations from the previous stage, runs its
     layers, sends activations on; receives their gradients back, runs backward, sends gradients
     back. The last stage computes the loss, summed over tokens and divided by the label tokens of
     the *whole* step (all micro-batches, all replicas), as transformers' ``num_items_in_batch``;
  2. all-reduces its LoRA gradients across replicas (when ``replicas > 1``);
  3. clips on the global gradient norm over all stages, then steps AdamW and the LR schedule.
Because each stage runs exactly the layers of the single-device model on exactly the same inputs,
and gradients accumulate in micro-batch order, the result is the single-device result.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import get_scheduler

from shardpool.config import Config
from shardpool.contract.jobfile import Job
from shardpool.contract.spec import EVENT_PREFIX, RESUME_PREFIX, StageEvent
from shardpool.data.prepared_file import load_prepared
from shardpool.data.rows import PreparedData, TokenRows
from shardpool.data.steps import step_batches
from shardpool.model.lora import lora_settings
from shardpool.model.nf4 import DTYPES
from shardpool.model.stage import BaseSettings, PipelineStage, build_stage
from shardpool.train import checkpoint as ckpt
from shardpool.train.process_group import Groups, Wire, join_process_group
from shardpool.train.runfiles import RunFiles
from shardpool.train.schedule import schedule_for

__all__ = [
    "StageWorker",
    "emit",
    "peak_rss_bytes",
    "EVENT_PREFIX",
    "token_loss_sum",
    "label_tokens",
    "scheduler_name",
    "warmup_steps",
]

DATA_INPUT = "data.safetensors"
INIT_ADAPTER_PREFIX = "init_adapter/"
FINAL_DIR = "checkpoints/final.partial"
_FORWARD_TAG, _BACKWARD_TAG = 1, 2


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it excludes the parent's)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def emit(event: dict[str, Any]) -> None:
    """Send one JSON event line to the launcher over stdout."""
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the label tokens, computed as transformers does."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(
        logits.float().view(-1, logits.shape[-1]),
        shifted.view(-1).to(logits.device),
        ignore_index=-100,
        reduction="sum",
    )


def label_tokens(labels: torch.Tensor) -> int:
    """How many positions of ``labels`` contribute to the next-token loss."""
    return int((labels[..., 1:] != -100).sum())


def scheduler_name(config: Config) -> str:
    """The transformers scheduler for an axolotl ``lr_scheduler`` value."""
    return {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[config.lr_scheduler]


def warmup_steps(config: Config, total_steps: int) -> int:
    """Warm-up steps from ``warmup_steps`` or ``warmup_ratio`` (rounded up, as transformers does)."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return math.ceil(total_steps * (config.warmup_ratio or 0.0))


@dataclass
class _StepTotals:
    loss: float = 0.0
    compute_seconds: float = 0.0
    tokens: int = 0


class StageWorker:
    """One stage process of one replica: builds its stage, then trains it step by step."""

    def __init__(self, job: Job, rank: int, *, job_dir: Path | None = None) -> None:
        self.job = job
        self.rank = rank
        self.job_dir = job_dir
        self.config = job.parsed_config()
        self.spec = job.stage_spec(rank)
        self.replica = job.replica_index(rank)
        self.device = torch.device(self.spec.device)
        self.compute_dtype = DTYPES[self.config.compute_dtype_name]
        self.hidden_size = 0
        self.stage: PipelineStage
        self.data: PreparedData
        self.steps: list[list[list[int]]] = []
        self.groups: Groups
        self.wire: Wire

    # ----- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        """Join the process group, build the stage, load the data and the optimizer."""
        torch.set_num_threads(self._threads())
        torch.manual_seed(self.config.seed + self.rank)
        timeout = timedelta(seconds=self.job.timeout_s)
        store = dist.TCPStore(self.job.master_addr, self.job.master_port, is_master=False, timeout=timeout)
        self.groups = join_process_group(
            store=store,
            rank=self.rank,
            world_size=self.job.world_size,
            num_stages=self.job.num_stages,
            replicas=self.job.replicas,
            device=self.device,
            places=[self._place(rank) for rank in range(self.job.world_size)],
            timeout=timeout,
        )
        self.files = RunFiles(self.job, job_dir=self.job_dir)
        self.wire = Wire.for_rank(
            self.groups,
            rank=self.rank,
            is_first=self.spec.is_first,
            is_last=self.spec.is_last,
            device=self.device,
            wire_dtype=DTYPES[self.config.wire_dtype_name],
            compute_dtype=self.compute_dtype,
        )
        self.lora = lora_settings(self.config, check_init_adapter=False)
        base = BaseSettings(
            quantize=self.config.adapter == "qlora",
            quant_type=self.config.bnb_config_kwargs.bnb_4bit_quant_type,
            double_quant=self.config.bnb_config_kwargs.bnb_4bit_use_double_quant,
            compute_dtype=self.config.compute_dtype_name,
            gradient_checkpointing=self.config.gradient_checkpointing,
        )
        if self.lora.init_from:
            self.lora = replace(self.lora, init_from=str(self.files.adapter_dir(INIT_ADAPTER_PREFIX)))
        with self.files.weight_reader() as reader:
            self.stage = build_stage(
                self.files.model_dir(), self.spec, base, self.lora, seed=self.config.seed, reader=reader
            )
        self.hidden_size = int(self.stage.hf_config.hidden_size)
        self.data = load_prepared(self.files.path(DATA_INPUT))
        self.steps = step_batches(
            len(self.data.train),
            micro_batch_size=self.config.micro_batch_size,
            micro_batches_per_step=self.config.gradient_accumulation_steps * self.job.replicas,
            num_epochs=self.config.num_epochs,
            max_steps=self.config.max_steps,
            shuffle_each_epoch=self.config.shuffle_merged_datasets,
            seed=self.config.seed,
        )
        self.named_params = self.stage.named_lora_parameters()
        self.optimizer = torch.optim.AdamW(
            [param for _, param in self.named_params],
            lr=self.config.learning_rate,
            betas=(self.config.adam_beta1, self.config.adam_beta2),
            eps=self.config.adam_epsilon,
            weight_decay=self.config.weight_decay,
        )
        self.scheduler = get_scheduler(
            scheduler_name(self.config),
            self.optimizer,
            num_warmup_steps=warmup_steps(self.config, len(self.steps)),
            num_training_steps=len(self.steps),
        )

    def _threads(self) -> int:
        """Intra-op threads: the configured count, else this machine's cores over its stage processes."""
        if self.config.shardpool.threads_per_stage:
            return self.config.shardpool.threads_per_stage
        local_ranks = os.environ.get("SHARDPOOL_LOCAL_RANKS")
        if local_ranks:
            return max(1, (os.cpu_count() or 1) // int(local_ranks))
        return self.job.threads_per_process

    def _place(self, rank: int) -> str:
        """The physical device of ``rank``: its host and torch device, as the job places it."""
        placement = self.job.stages[self.job.stage_index(rank)]
        return f"{placement.host}/{torch.device(placement.device)}"

    # ----- the run ------------------------------------------------------------------------
    def run(self) -> None:
        """Train from the start or from a checkpoint, evaluate, and write the adapter."""
        self.setup()
        first_step = self._resume() if self.job.resume_step else 0
        if self.rank == 0:
            emit({"event": StageEvent.READY, "total_steps": len(self.steps), "first_step": first_step})
        eval_before = self.job.eval_before
        if first_step == 0:
            eval_before = self.evaluate()
        for step in range(first_step, len(self.steps)):
            self.train_step(step)
            if (
                self.config.save_steps
                and (step + 1) % self.config.save_steps == 0
                and step + 1 < len(self.steps)
            ):
                self.save_checkpoint(step + 1, eval_before=eval_before)
        eval_after = self.evaluate(save_logits=True)
        self.write_final_adapter()
        emit(
            {
                "event": StageEvent.STAGE_DONE,
                "rank": self.rank,
                "stage": self.spec.index,
                "peak_rss_bytes": peak_rss_bytes(),
                "peak_device_bytes": self._peak_device_bytes(),
            }
        )
        if self.rank == 0:
            emit({"event": StageEvent.DONE, "eval_before": eval_before, "eval_after": eval_after})
        dist.barrier()
        dist.destroy_process_group()

    def _peak_device_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    def train_step(self, step: int) -> None:
        """One optimizer step: the schedule's micro-batches, gradient sync, clip, AdamW."""
        started = time.perf_counter()
        self.wire.wait_seconds = 0.0
        all_microbatches = [self.data.train.select(rows) for rows in self.steps[step]]
        step_label_tokens = sum(label_tokens(batch.labels) for batch in all_microbatches)
        per_replica = self.config.gradient_accumulation_steps
        mine = all_microbatches[self.replica * per_replica : (self.replica + 1) * per_replica]
        totals = self._run_schedule(mine, step_label_tokens)
        self.wire.flush()
        grad_norm, step_loss = self._synchronize_and_clip_gradients(totals)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        timings = self._gather_timings(totals.compute_seconds, self.wire.wait_seconds)
        if self.rank == 0:
            step_seconds = time.perf_counter() - started
            tokens = sum(int(batch.attention_mask.sum()) for batch in all_microbatches)
            emit(
                {
                    "event": StageEvent.STEP,
                    "step": step + 1,
                    "loss": step_loss,
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens / step_seconds,
                    "step_seconds": step_seconds,
                    "stage_compute_s": timings[0],
                    "stage_wait_s": timings[1],
                    "bytes_sent": timings[2],
                }
            )

    def _run_schedule(self, microbatches: list[TokenRows], step_label_tokens: int) -> _StepTotals:
        totals = _StepTotals()
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        actions = schedule_for(
            self.config.shardpool.schedule,
            stage=self.spec.index,
            num_stages=self.spec.num_stages,
            num_microbatches=len(microbatches),
        )
        for kind, index in actions:
            if kind == "F":
                saved[index] = self._forward(microbatches[index], step_label_tokens, totals)
            else:
                self._backward(*saved.pop(index), totals)
        return totals

    def _forward(
        self, rows: TokenRows, step_label_tokens: int, totals: _StepTotals
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self._stage_inputs(rows, tag=_FORWARD_TAG)
        if not self.spec.is_first:
            inputs.requires_grad_(True)
        started = time.perf_counter()
        output = self.stage(inputs, **self._positions(rows))
        if self.spec.is_last:
            output = token_loss_sum(output, rows.labels) / step_label_tokens
            totals.loss += float(output.detach())
        totals.compute_seconds += time.perf_counter() - started
        if not self.spec.is_last:
            self.wire.send(output, self.wire.next, tag=_FORWARD_TAG)
        return inputs, output

    def _backward(self, inputs: torch.Tensor, output: torch.Tensor, totals: _StepTotals) -> None:
        gradient = None
        if not self.spec.is_last:
            gradient = self.wire.recv(tuple(output.shape), self.wire.next, tag=_BACKWARD_TAG)
        started = time.perf_counter()
        output.backward(gradient)
        totals.compute_seconds += time.perf_counter() - started
        if not self.spec.is_first:
            self.wire.send(inputs.grad, self.wire.previous, tag=_BACKWARD_TAG)

    def _stage_inputs(self, rows: TokenRows, *, tag: int) -> torch.Tensor:
        if self.spec.is_first:
            return rows.input_ids.to(self.device)
        shape = (rows.input_ids.shape[0], rows.input_ids.shape[1], self.hidden_size)
        return self.wire.recv(shape, self.wire.previous, tag=tag)

    def _positions(self, rows: TokenRows) -> dict[str, torch.Tensor | None]:
        attention_mask = None if self.data.packed else rows.attention_mask.to(self.device)
        return {"attention_mask": attention_mask, "position_ids": rows.position_ids.to(self.device)}

    def _synchronize_and_clip_gradients(self, totals: _StepTotals) -> tuple[float, float]:
        """Sum gradients over replicas, clip on the global norm; return (norm before clipping, step loss).

        The replica all-reduce runs on the device when the replicas share a native group, else on
        the host over gloo; the norm and loss sums always run on the host over the gloo world.
        """
        grads = [param.grad for _, param in self.named_params]
        replicas = self.groups.replicas(self.spec.index)
        if replicas is not None:
            group, native = replicas
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            flat = flat if native else flat.to("cpu")
            dist.all_reduce(flat, group=group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        norms = torch.stack([torch.linalg.vector_norm(grad, 2.0) for grad in grads]).to("cpu")
        summary = torch.tensor([float((norms.double() ** 2).sum()), totals.loss], dtype=torch.float64)
        dist.all_reduce(summary)
        grad_norm = math.sqrt(float(summary[0]) / self.job.replicas)
        if self.config.max_grad_norm > 0:
            coefficient = min(1.0, self.config.max_grad_norm / (grad_norm + 1e-6))
            torch._foreach_mul_(
                grads, torch.tensor(coefficient, dtype=grads[0].dtype, device=grads[0].device)
            )
        return grad_norm, float(summary[1])

    def _gather_timings(self, compute: float, wait: float) -> list[list[float]]:
        mine = torch.tensor([compute, wait, float(self.wire.bytes_sent)], dtype=torch.float64)
        self.wire.bytes_sent = 0
        gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(self.job.world_size)]
        dist.all_gather(gathered, mine)
        return [[float(row[column]) for row in gathered] for column in range(3)]

    # ----- eval -------------------------------------------------------------------------------
    def evaluate(self, *, save_logits: bool = False) -> float | None:
        """Mean next-token loss over the eval split through replica 0's pipeline (None if no split)."""
        rows = self.data.eval
        if len(rows) == 0:
            return None
        size = self.config.micro_batch_size
        loss_sum, token_count = 0.0, 0
        self.stage.eval()
        with torch.no_grad():
            for start in range(0, len(rows) if self.replica == 0 else 0, size):
                batch = rows.select(range(start, min(start + size, len(rows))))
                inputs = self._stage_inputs(batch, tag=_FORWARD_TAG)
                output = self.stage(inputs, **self._positions(batch))
                if not self.spec.is_last:
                    self.wire.send(output, self.wire.next, tag=_FORWARD_TAG)
                    continue
                loss_sum += float(token_loss_sum(output, batch.labels))
                token_count += label_tokens(batch.labels)
                if save_logits and start == 0:
                    self._save_eval_logits(batch, output)
        self.wire.flush()
        self.stage.train()
        summary = torch.tensor([loss_sum, float(token_count)], dtype=torch.float64)
        dist.all_reduce(summary)
        return float(summary[0] / summary[1]) if summary[1] > 0 else None

    def _save_eval_logits(self, batch: TokenRows, logits: torch.Tensor) -> None:
        self.files.save_tensors(
            "eval_logits.safetensors",
            {
                "input_ids": batch.input_ids,
                "attention_mask": batch.attention_mask,
                "position_ids": batch.position_ids,
                "logits": logits.float(),
            },
        )

    # ----- saving -----------------------------------------------------------------------------
    def save_checkpoint(self, step: int, *, eval_before: float | None) -> None:
        """Send every stage's part of a checkpoint to the launcher, which then renames it into place."""
        partial = f"checkpoints/{ckpt.partial_dir('', step).name}"
        self._send_state(partial)
        self.files.save_tensors(f"{partial}/{ckpt.rng_file(self.rank)}", ckpt.rng_state_tensors())
        dist.barrier()
        if self.rank == 0:
            emit(
                {
                    "event": StageEvent.CHECKPOINT_WRITTEN,
                    "step": step,
                    "partial": partial,
                    "eval_before": eval_before,
                }
            )

    def _send_state(self, directory: str) -> None:
        if self.replica == 0:
            tensors = ckpt.stage_state_tensors(named_parameters=self.named_params, optimizer=self.optimizer)
            self.files.save_tensors(f"{directory}/{ckpt.stage_file(self.spec.index)}", tensors)

    def _resume(self) -> int:
        step = self.job.resume_step
        stage_files = [
            self.files.path(name) for name in self.job.inputs if name.startswith(RESUME_PREFIX + "stage-")
        ]
        keys = [key for key, _ in self.named_params]
        lora, optim_state = ckpt.read_lora_and_optimizer(stage_files, keys)
        with torch.no_grad():
            for key, param in self.named_params:
                param.copy_(lora[key].to(device=param.device, dtype=param.dtype))
        state = self.optimizer.state_dict()
        state["state"] = {
            index: {field: value.to(param.device) for field, value in optim_state[key].items()}
            for index, (key, param) in enumerate(self.named_params)
            if optim_state[key]
        }
        self.optimizer.load_state_dict(state)
        for _ in range(step):
            self.scheduler.step()
        rng_input = RESUME_PREFIX + ckpt.rng_file(self.rank)
        if self.files.has(rng_input):
            torch.set_rng_state(ckpt.read_rng_state(self.files.path(rng_input)))
        return step

    def write_final_adapter(self) -> None:
        """Send every stage's LoRA tensors to the launcher, which merges them into one PEFT adapter."""
        self._send_state(FINAL_DIR)
        dist.barrier()
        if self.rank == 0:
            emit({"event": StageEvent.FINAL_WRITTEN, "directory": FINAL_DIR})


def run_stage_process(job_path: str, rank: int) -> None:
    """Entry of a stage process (see :mod:`shardpool.train.worker`)."""
    job = Job.read(job_path)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker = StageWorker(job, rank, job_dir=Path(job_path).resolve().parent)
    try:
        worker.run()
    finally:
        if hasattr(worker, "files"):
            worker.files.close()
