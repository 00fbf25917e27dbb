"""A stage process of a run that changes while it trains: ``python -m shardpool.elastic.rank JOB_JSON RANK``.

:class:`ElasticStageWorker` is the :class:`~shardpool.train.worker.StageWorker` every stage process
runs, with what a rank does when its run changes:

* after the job's re-balance check step every rank waits for the launcher's answer
  (:mod:`shardpool.elastic.messages`) and, if it moves the layer boundaries, re-shards in place
  (:meth:`ElasticStageWorker.reshard`; the hand-over is :mod:`shardpool.elastic.reshard`);
* with ``job.keep_state`` (mesh runs with ``on_member_loss: continue``) the process beats on the
  rendezvous store from its first moment, before the model is built, and after every step (after
  that step's re-shard, if any) hands CPU clones of its checkpoint files to a background thread
  that writes them into ``live_dir(step)`` and counts them while the next step computes
  (:mod:`shardpool.elastic.rank_liveness`); the last copy is waited for before the final eval;
* with ``job.keep_state`` rank 0 also looks for the launcher's grow decision after every step (a
  member joined: :mod:`shardpool.elastic.growth`) and says so in the step's gather, and every rank
  moves to the grown job in place after the same step (:meth:`ElasticStageWorker.grow`); a rank
  started ``joining`` builds its stage first and then takes its state from the running ones
  (:meth:`ElasticStageWorker.join_running`).

Every value a rank reads from the rendezvous store, torch's own process-group rendezvous
included, must carry the MAC of the job's control key (:func:`control_store`,
:class:`~shardpool.elastic.messages.ControlStore`): a value written by a process outside the job
is refused in one logged line and waited past. Every process group it joins (at the start, and
when the job grows in place) first has each pair of its ranks prove that key to each other
(:class:`~shardpool.elastic.messages.PeerKey`, :func:`~shardpool.train.process_group.prove_peers`).

``SHARDPOOL_TEST_KEEP_STATE=1`` turns ``keep_state`` on in a local run (a bench and test hook).

A failure is reported to the launcher as one JSON ``error`` event naming the stage, with the full
traceback in the stage's log (stderr), and the process exits at once with status 1 so that no
collective is left waiting on it.
"""

from __future__ import annotations

import gc
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

from shardpool.contract.events import StageEvent
from shardpool.contract.job import CONTROL_SECRET_ENV, Job
from shardpool.elastic.group_store import GroupStore
from shardpool.elastic.handover_plan import job_growth_moves, state_position
from shardpool.elastic.messages import (
    ControlStore,
    GrowSchedule,
    PeerKey,
    await_decision,
    await_key,
    beat_key,
    control_key,
    decode_decision,
    decode_growth,
    decode_shares,
    decode_step,
    encode_ready,
    group_prefix,
    grow_key,
    ready_key,
    schedule_key,
    step_key,
)
from shardpool.elastic.rank_liveness import StateCopier, cpu_clones, start_beat, store_client
from shardpool.elastic.reshard import (
    exchange_by_position,
    exchange_state,
    kept_state,
    module_layer,
    room_bytes,
)
from shardpool.errors import ShardpoolError
from shardpool.model.nf4 import DTYPES
from shardpool.model.stage import PipelineStage, reusable_modules
from shardpool.train import checkpoint as ckpt
from shardpool.train.loss_scale import LossScale
from shardpool.train.process_group import leave_process_group
from shardpool.train.runfiles import read_files_secret
from shardpool.train.stage_state import checkpoint_files, load_lora_and_optimizer
from shardpool.train.step_report import GatheredStep, StepReport
from shardpool.train.worker import StageWorker, emit, stage_spec

__all__ = ["KEEP_STATE_HOOK", "ElasticStageWorker", "control_store", "main", "run_stage_process"]


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
    job_dir = Path(job_path).resolve().parent
    worker = ElasticStageWorker(job, rank, job_dir=job_dir, store=control_store(job, job_dir))
    try:
        worker.run()
    finally:
        if hasattr(worker, "files"):
            worker.files.close()


def control_store(job: Job, job_dir: Path) -> ControlStore | None:
    """This rank's client of the launcher's rendezvous store, sealing and checking every value with
    the job's control key (None for a lone stage, which meets no one).

    The secret is the one only the job's processes hold: on a mesh the file-server secret the
    agent wrote 0600 into the job directory, in a local run the one the launcher put in this
    process's environment (:data:`~shardpool.contract.job.CONTROL_SECRET_ENV`).
    """
    if job.world_size == 1:
        return None
    if job.files_url is not None:
        secret = read_files_secret(job_dir)
    else:
        secret = os.environ.get(CONTROL_SECRET_ENV, "")
        if not secret:
            raise ShardpoolError(
                f"{CONTROL_SECRET_ENV} is not set: a local stage takes the job's control secret from its "
                "launcher; start it through shardpool finetune"
            )
    inner = dist.TCPStore(
        job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=job.timeout_s)
    )
    return ControlStore(inner, control_key(secret, addr=job.master_addr, port=job.master_port))


class ElasticStageWorker(StageWorker):
    """A :class:`~shardpool.train.worker.StageWorker` that re-shards, grows, beats and copies its state."""

    def __init__(
        self,
        job: Job,
        rank: int,
        *,
        job_dir: Path | None = None,
        store: ControlStore | None = None,
        events: Callable[[dict[str, Any]], None] = emit,
    ) -> None:
        super().__init__(job, rank, job_dir=job_dir, store=store, events=events)
        self.layers = [(placement.start, placement.stop) for placement in job.stages]  # every stage's, now
        # keep_state: the step-boundary copies' writer, and what stops the beat.
        self.keeps_state = job.keep_state and job.world_size > 1
        self.copier: StateCopier | None = None
        self.stop_beat: Any = None
        #: Set in a step whose gather said the launcher grew the job (:mod:`shardpool.elastic.growth`).
        self.grow_due = False

    # ----- the hooks of the step loop -----------------------------------------------------------
    def _before_setup(self) -> None:
        if self.keeps_state:  # before the model is built: a slow start must not look like a lost member
            if not isinstance(self.store, ControlStore):
                raise ShardpoolError("a rank beats only through the job's sealed rendezvous store")
            sealed, connect = self.store, store_client(self.job.master_addr, self.job.master_port)
            _, self.stop_beat = start_beat(
                lambda: sealed.over(connect()),
                self.rank,
                key=lambda: beat_key(self.rank, self.job.generation),
            )

    def _joins_group_at_setup(self) -> bool:
        return not self.job.joining  # a joining rank meets the others once they move to its generation

    def _stage_built(self, stage: PipelineStage) -> None:
        if self.job.joining:
            self._built = stage  # trained once the running ranks hand over its state (join_running)
            return
        super()._stage_built(stage)

    def _group_store(self, store: Any) -> Any:
        """torch's rendezvous of the process group goes through the sealed store too (a grown
        job's under its generation's prefix)."""
        if store is None and self.job.world_size == 1:
            return None  # a lone stage meets no one
        if not isinstance(store, ControlStore):
            raise ShardpoolError(
                "a rank joins its process group only through the job's sealed rendezvous store"
            )
        generation = self.job.generation
        return GroupStore(store.prefixed(group_prefix(generation)) if generation else store)

    def _peer_check(self, store: Any) -> PeerKey | None:
        """Every pair of this generation's groups proves it holds the run's control key
        (:class:`~shardpool.elastic.messages.PeerKey`), before any training data flows."""
        if store is None and self.job.world_size == 1:
            return None  # a lone stage meets no one
        if not isinstance(store, ControlStore):
            raise ShardpoolError(
                "a rank's peers prove the run's key only through its sealed rendezvous store"
            )
        return store.peer_key(self.job.generation)

    def _first_step(self) -> int:
        if self.keeps_state:
            self.copier = StateCopier(
                self.files, store_client(self.job.master_addr, self.job.master_port), rank=self.rank
            )
        if not self.job.joining:
            return super()._first_step()
        first_step = self.join_running()
        self.copy_state(first_step)  # the grown job copies the step it grew after: this rank too
        return first_step

    def _at_step_boundary(self, done: int, total_steps: int) -> None:
        if done == self.job.rebalance_at and done < total_steps:
            self.check_rebalance(done)
        if self.grow_due and done < total_steps:
            self.grow(done)
        self.copy_state(done)

    def _training_over(self) -> None:
        if self.copier is not None:
            self.copier.close()

    def _after_run(self) -> None:
        if self.stop_beat is not None:
            self.stop_beat.set()

    def _extend_report(self, step: int, report: StepReport) -> StepReport:
        copier = self.copier
        if copier is None and step + 1 != self.job.rebalance_at:
            return report
        # the re-balance check's split, and a growth in place (a job that copies its state), respect each rank's room
        room = float(room_bytes(self.device, rank=self.rank))
        if copier is None:
            return replace(report, room_bytes=room)
        figures = (copier.copy_seconds, copier.blocked_seconds, copier.cpu_seconds)
        return replace(report, copy_figures=figures, room_bytes=room, grow_due=self._grow_announced())

    def _gathered(self, gathered: GatheredStep) -> None:
        if gathered.grow_due is not None:
            self.grow_due = gathered.grow_due

    # ----- re-balancing -------------------------------------------------------------------
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
        now owns their layer (:func:`shardpool.elastic.reshard.exchange_state`); this stage then drops
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
    def _grow_announced(self) -> bool:
        """Whether rank 0 finds the launcher's grow decision for the next generation (other ranks: False).

        Only rank 0 asks the store; the step's gather tells every rank, so all of them
        grow after the same step.
        """
        if self.rank != 0 or self.rendezvous is None:
            return False
        return self.rendezvous.peek(grow_key(self.job.generation + 1)) is not None

    def grow(self, step: int) -> None:
        """Move to the grown job after ``step``, in place (:mod:`shardpool.elastic.growth`).

        Rank 0 tells the joining ranks the step and the schedule's position. Every rank then
        leaves the process group, joins the grown one with its new rank, hands the state of the
        layers it loses to their new owner, and rebuilds its stage around the base layers it keeps.
        """
        started = time.perf_counter()
        generation = self.job.generation + 1
        store = self.rendezvous
        schedule = self._schedule_state()
        if self.rank == 0:
            store.set(schedule_key(generation), schedule.encode())
            store.set(step_key(generation), str(step))
        growth = decode_growth(
            await_key(store, grow_key(generation), timeout_s=self.job.timeout_s, what="grow decision")
        )
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
        store.set(ready_key(generation, self.rank), encode_ready(self.rank))
        timeout_s = self.job.timeout_s
        step = decode_step(
            await_key(store, step_key(generation), timeout_s=timeout_s, what="step to join after")
        )
        schedule = GrowSchedule.decode(
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
        self.eval_before = schedule.eval_before
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
        """The state positions this rank's stage holds (:mod:`shardpool.elastic.handover_plan`): its layers, and the ends it has."""
        positions = set(range(self.spec.start, self.spec.stop))
        if self.spec.is_first:
            positions.add(-1)
        if self.spec.is_last:
            positions.add(self.layers[-1][1])
        return positions

    def _schedule_state(self) -> GrowSchedule:
        """What a joining rank cannot know: the LR schedule's position and rates, the loss scale, the eval loss before."""
        scale = self.state.loss_scale
        return GrowSchedule(
            scheduler_steps=int(self.state.scheduler.last_epoch),
            rates=[float(group["lr"]) for group in self.state.optimizer.param_groups],
            loss_scale=[float(value) for value in scale.state_tensor().tolist()] if scale else None,
            eval_before=self.eval_before,
        )

    def _restore_state(self, tensors: dict[str, torch.Tensor], schedule: GrowSchedule) -> None:
        """Load LoRA and optimizer state by key, and the schedule's position, rates and loss scale."""
        keys = [key for key, _ in self.state.named_params]
        load_lora_and_optimizer(self.state, *ckpt.lora_and_optimizer_from(tensors, keys))
        for _ in range(schedule.scheduler_steps - int(self.state.scheduler.last_epoch)):
            self.state.scheduler.step()
        for group, rate in zip(self.state.optimizer.param_groups, schedule.rates, strict=True):
            group["lr"] = rate
        if self.state.loss_scale is not None and schedule.loss_scale is not None:
            self.state.loss_scale.load_state_tensor(torch.tensor(schedule.loss_scale, dtype=torch.float64))

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

    # ----- the step-boundary copies ------------------------------------------------------------
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
