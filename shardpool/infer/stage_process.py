"""One inference stage process: build the stage, join the ring, and serve messages until STOP.

``python -m shardpool.infer.stage_process SPEC RANK``. The stage is built as for training (its
layers only, NF4, the adapter loaded unmerged) and kept in eval mode. It then loops: receive a
header from the previous rank (the driver, for stage 0), do what it asks for one sequence slot,
pass the result on. Each slot has its own KV cache (:meth:`PipelineStage.forward_cached`); the
last stage also keeps each slot's sampling settings and random stream and answers the driver with
the chosen token. Messages are handled in the order they arrive, so with several sequences in
flight every stage works on a different one.

Every value it reads at the rendezvous is sealed with the engine's control key, and every pair
of the gloo world proves that key before any prompt flows (as training's ranks do). Any failure
writes one line on stderr and exits 1; the driver reports that line.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardpool.contract.job import CONTROL_SECRET_ENV
from shardpool.elastic.group_store import GroupStore
from shardpool.elastic.messages import ControlStore, control_key
from shardpool.errors import ShardpoolError
from shardpool.infer.messages import HEADER_LEN, SAMPLING_LEN, Header, Kind
from shardpool.infer.sampling import Sampling, next_token, seeded_generator
from shardpool.infer.spec import InferenceSpec
from shardpool.model.lora import LoraSettings
from shardpool.model.nf4 import DTYPES
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage
from shardpool.train.process_group import prove_peers, select_device

__all__ = ["main", "StageLoop", "join_ring", "build_inference_stage"]

#: What hidden states cross the ring in: fp32 holds every compute dtype exactly.
WIRE_DTYPE = torch.float32


def main(argv: list[str]) -> int:
    """Run one stage until the driver stops the ring; one line on stderr and exit 1 on failure."""
    spec_path, rank = Path(argv[0]), int(argv[1])
    try:
        spec = InferenceSpec.read(spec_path)
        torch.set_num_threads(spec.threads_per_process)
        join_ring(spec, rank)
        stage = build_inference_stage(spec, rank)
        StageLoop(stage, spec, rank).run()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the driver
        traceback.print_exc(file=sys.stderr)
        message = str(error) if isinstance(error, ShardpoolError) else f"{type(error).__name__}: {error}"
        print(f"error: {message.splitlines()[0] if message else type(error).__name__}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def join_ring(spec: InferenceSpec, rank: int) -> None:
    """Join the driver's gloo world through its sealed store and prove the control key to every rank."""
    secret = os.environ.get(CONTROL_SECRET_ENV, "")
    if not secret:
        raise ShardpoolError(
            f"{CONTROL_SECRET_ENV} is not set: an inference stage is started by shardpool generate or serve"
        )
    store = ControlStore(
        dist.TCPStore(
            spec.master_addr, spec.master_port, is_master=False, timeout=timedelta(seconds=spec.timeout_s)
        ),
        control_key(secret, addr=spec.master_addr, port=spec.master_port),
    )
    world = spec.num_stages + 1
    select_device(torch.device(spec.stages[rank].device))
    dist.init_process_group(
        backend="gloo",
        store=GroupStore(store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    prove_peers(store.peer_key(0), group=None, name="world", rank=rank, ranks=range(world))


def build_inference_stage(spec: InferenceSpec, rank: int) -> PipelineStage:
    """Stage ``rank`` of the spec, with the adapter loaded (or a no-op LoRA for the base alone), in eval mode."""
    placement = spec.stages[rank]
    stage_spec = StageSpec(rank, spec.num_stages, placement.start, placement.stop, placement.device)
    base = BaseSettings(
        compute_dtype=placement.dtype or "float32", nf4_backend=placement.nf4_backend or "bitsandbytes"
    )
    lora = LoraSettings(
        r=spec.lora_r,
        alpha=spec.lora_alpha,
        dropout=0.0,
        target_modules=spec.lora_targets,
        init_from=spec.adapter_dir,
        all_linear=not spec.lora_targets,
    )
    stage = build_stage(spec.model_dir, stage_spec, base, lora, seed=0)
    if spec.adapter_dir is None:  # the base alone: LoRA's B stays zero, so it adds exactly nothing
        for name, param in stage.named_lora_parameters():
            if ".lora_B." in name:
                param.data.zero_()
    stage.eval()
    for param in stage.parameters():
        param.requires_grad_(False)
    return stage


class StageLoop:
    """What one stage does with each message of the ring."""

    def __init__(self, stage: PipelineStage, spec: InferenceSpec, rank: int) -> None:
        self.stage = stage
        self.rank = rank
        self.device = torch.device(spec.stages[rank].device)
        self.compute_dtype = DTYPES[spec.stages[rank].dtype or "float32"]
        self.hidden_size = int(stage.hf_config.hidden_size)
        self.previous = spec.driver_rank if rank == 0 else rank - 1
        self.next = spec.driver_rank if stage.spec.is_last else rank + 1
        self.caches: dict[int, object] = {}
        self.samplings: dict[int, tuple[Sampling, torch.Generator]] = {}

    def run(self) -> None:
        """Handle messages until STOP; READY first, once the previous rank (the driver, for stage 0) is ready too."""
        self._expect(Kind.READY)
        self._send_header(Header(Kind.READY))
        while True:
            header = self._recv_header()
            if header.kind is Kind.STOP:
                self._send_header(header)
                return
            if header.kind is Kind.RELEASE:
                self.caches.pop(header.slot, None)
                self.samplings.pop(header.slot, None)
                if not self.stage.spec.is_last:
                    self._send_header(header)
            elif header.kind in (Kind.PREFILL, Kind.DECODE):
                self._forward(header)
            else:
                raise ShardpoolError(f"stage {self.rank} got an unexpected {header.kind.name} message")

    def _forward(self, header: Header) -> None:
        sampling = None
        if header.kind is Kind.PREFILL:
            sampling = self._recv_sampling()
            self.caches[header.slot] = self.stage.new_cache()
        elif header.slot not in self.caches:
            raise ShardpoolError(f"stage {self.rank} got a token for slot {header.slot}, which holds no sequence")
        inputs = self._inputs(header)
        positions = torch.arange(header.position, header.position + header.length, device=self.device)
        output = self.stage.forward_cached(inputs, cache=self.caches[header.slot], position_ids=positions[None])
        if not self.stage.spec.is_last:
            self._send_header(header)
            if sampling is not None:
                self._send_sampling(sampling)
            dist.send(output.detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous(), dst=self.next)
            return
        if sampling is not None:
            self.samplings[header.slot] = (sampling, seeded_generator(sampling))
        chosen, generator = self.samplings[header.slot]
        token = next_token(output[0, -1].to("cpu"), chosen, generator)
        self._send_header(Header(Kind.TOKEN, header.slot, 1, header.position + header.length, token))

    def _inputs(self, header: Header) -> torch.Tensor:
        if self.stage.spec.is_first:
            if header.kind is Kind.DECODE:
                return torch.tensor([[header.token]], device=self.device)
            ids = torch.empty(header.length, dtype=torch.int64)
            dist.recv(ids, src=self.previous)
            return ids[None].to(self.device)
        hidden = torch.empty((1, header.length, self.hidden_size), dtype=WIRE_DTYPE)
        dist.recv(hidden, src=self.previous)
        return hidden.to(device=self.device, dtype=self.compute_dtype)

    def _expect(self, kind: Kind) -> None:
        header = self._recv_header()
        if header.kind is not kind:
            raise ShardpoolError(f"stage {self.rank} expected {kind.name}, got {header.kind.name}")

    def _recv_header(self) -> Header:
        values = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(values, src=self.previous)
        return Header.decode(values.tolist())

    def _send_header(self, header: Header) -> None:
        dist.send(torch.tensor(header.encode(), dtype=torch.int64), dst=self.next)

    def _recv_sampling(self) -> Sampling:
        values = torch.empty(SAMPLING_LEN, dtype=torch.float64)
        dist.recv(values, src=self.previous)
        return Sampling.decode(values.tolist())

    def _send_sampling(self, sampling: Sampling) -> None:
        dist.send(torch.tensor(sampling.encode(), dtype=torch.float64), dst=self.next)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
