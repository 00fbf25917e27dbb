"""``shardpool generate``: continue a prompt with the trained model, on stages placed like training's.

The target (a finetune output directory, a config or a base model directory) is resolved by
:func:`shardpool.infer.target.resolve_target`; the stages are placed on this machine's devices
(:func:`local_placements`) and run by a :class:`~shardpool.infer.engine.PipelineEngine`. The
prompt is tokenized as ``AutoTokenizer`` does (with ``--chat``, through the tokenizer's chat
template), the completion decoded without special tokens, cut before the first stop string.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError
from shardpool.host.memory_limit import cpu_memory
from shardpool.model.shape import ModelShape, read_model_info
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device
from shardpool.plan.inference import (
    InferenceDevice,
    InferenceLoad,
    fitting_split,
    inference_device,
    inference_split,
)
from shardpool.plan.splits import even_split

if TYPE_CHECKING:
    from shardpool.infer.rings import Stages
    from shardpool.infer.target import Target
    from shardpool.launch.mesh_members import MeshMember

__all__ = [
    "PLACEMENTS",
    "GenerateOptions",
    "StagesFor",
    "Generation",
    "default_dtype",
    "generate",
    "local_placements",
    "fleet_placements",
    "mesh_placements",
    "parse_devices",
    "read_prompt",
    "ring_stages",
]

#: Where a ring's stages run, given its target, its context (tokens) and its sequence slots.
StagesFor = Callable[["Target", int, int], "Stages"]

#: Where ``generate`` and ``serve`` run their stages: this machine's devices, or the mesh members'.
PLACEMENTS = ("local", "mesh")

#: The dtype each device kind computes in when nothing else is said: fp32 on CPUs (exact, and what
#: their kernels run fastest), bf16 on GPUs.
_DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16", "mps": "float16"}


@dataclass(frozen=True)
class GenerateOptions:
    """How ``shardpool generate`` continues one prompt."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False
    stages: int | None = None
    devices: tuple[str, ...] = ("cpu",)
    placement: str = "local"


@dataclass(frozen=True)
class Generation:
    """One completion: its text, the generated ids (a final eos included, as ``generate`` returns
    it), why it ended, and how long it took."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    time_to_first_token_s: float
    seconds: float

    def as_json(self) -> dict[str, Any]:
        """The object ``generate --json`` prints."""
        generated = len(self.token_ids)
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "time_to_first_token_s": round(self.time_to_first_token_s, 6),
            "tokens_per_s": round(generated / self.seconds, 3) if self.seconds > 0 else None,
        }


def default_dtype(device: str) -> str:
    """The compute dtype generation runs in on ``device`` (``cuda:1`` as ``cuda``): float32 on a
    CPU, bfloat16 on CUDA, float16 on MPS."""
    return _DEFAULT_DTYPE[device.split(":", 1)[0]]


def parse_devices(text: str) -> tuple[str, ...]:
    """``--devices cpu,cuda:0`` as a tuple; one line for an empty or malformed list."""
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise ShardpoolError("--devices is empty; name at least one device, e.g. cpu or cuda:0")
    for device in devices:
        kind = device.split(":", 1)[0]
        if kind not in _DEFAULT_DTYPE:
            raise ShardpoolError(
                f"--devices: {device!r} is not a device shardpool runs on (cpu, cuda:N, mps)"
            )
    return devices


def local_placements(
    model_dir: Any,
    stages: int,
    devices: Sequence[str],
    *,
    max_context: int | None = None,
    max_slots: int = 1,
    free_bytes: Mapping[str, float] | None = None,
) -> list[StagePlacement]:
    """``stages`` contiguous layer ranges of the model, on ``devices``: one device for every stage,
    or one per stage in order.

    The ranges are even unless ``max_context`` is given and the even split does not fit: then
    each stage's memory (its layers, and a KV cache of ``max_context`` tokens for each of
    ``max_slots`` sequences; ``plan.inference``) is checked against its device's free memory
    (``free_bytes`` by device name; a CPU's available RAM within its cgroup when not given; a device
    named for several stages shares it equally), and the split that fits is taken, or a one-line
    error says which device is short. Devices whose memory is unknown are not limited.
    """
    info = read_model_info(model_dir)
    if stages < 1 or stages > info.num_layers:
        raise ShardpoolError(f"--stages {stages} must be between 1 and the model's {info.num_layers} layers")
    if len(devices) not in (1, stages):
        raise ShardpoolError(
            f"--devices names {len(devices)} devices for {stages} stages; give one device, or one per stage"
        )
    chosen = list(devices) * stages if len(devices) == 1 else list(devices)
    dtypes = [default_dtype(device) for device in chosen]
    ranges = even_split(info.num_layers, stages)
    free: Mapping[str, float] = {}
    if max_context is not None:
        free = free_bytes if free_bytes is not None else {"cpu": float(cpu_memory()[1])}
    if max_context is not None and any(device in free for device in chosen):
        load = InferenceLoad(max_context=max_context, max_slots=max_slots)
        unlimited = float(1 << 60)
        slots = [
            InferenceDevice(
                name=device,
                free_bytes=free.get(device, unlimited) / chosen.count(device),
                kind=device.split(":", 1)[0],
                compute_bytes=4 if dtype == "float32" else 2,
            )
            for device, dtype in zip(chosen, dtypes, strict=True)
        ]
        ranges = fitting_split(info.shape, load, slots, ranges)
    return [
        StagePlacement(start=start, stop=stop, device=device, dtype=dtype)  # type: ignore[arg-type]
        for (start, stop), device, dtype in zip(ranges, chosen, dtypes, strict=True)
    ]


def generate(
    target_path: str,
    prompt: str,
    options: GenerateOptions,
    *,
    on_text: Callable[[str], None] | None = None,
    say: Callable[[str], None] = lambda line: None,
    stages_for: StagesFor | None = None,
) -> Generation:
    """Continue ``prompt`` with the model at ``target_path``, on stages placed as ``options`` say
    (or by ``stages_for``: a torchrun launch's); the engine is started and stopped around it.
    ``on_text`` is given each piece of text as soon as it is certain; ``say`` each line of
    progress (the mesh members, the placement)."""
    from shardpool.data.tokenizing import load_tokenizer
    from shardpool.infer.engine import GenerationRequest, PipelineEngine
    from shardpool.infer.sampling import Sampling
    from shardpool.infer.target import resolve_target
    from shardpool.infer.text import TextStream, prompt_ids, stop_ids

    target = resolve_target(target_path)
    tokenizer = load_tokenizer(target.tokenizer_dir)
    ids = prompt_ids(tokenizer, prompt, chat=options.chat)
    seed = options.seed if options.seed is not None else secrets.randbelow(2**31)
    request = GenerationRequest(
        prompt_ids=tuple(ids),
        max_new_tokens=options.max_new_tokens,
        sampling=Sampling(options.temperature, options.top_p, options.top_k, seed),
        stop_token_ids=stop_ids(tokenizer, target.model_dir),
    )
    max_context = len(ids) + options.max_new_tokens
    if stages_for is not None:
        stages = stages_for(target, max_context, 1)
    else:
        stages = ring_stages(
            target,
            options.placement,
            options.stages,
            options.devices,
            max_context=max_context,
            max_slots=1,
            say=say,
        )
    with PipelineEngine(target, stages=stages, max_slots=1, max_context=max_context) as engine:
        started = time.perf_counter()
        stream = engine.submit(request)
        text = TextStream(tokenizer, stop=options.stop, context=ids)
        token_ids: list[int] = []
        for token in stream:
            token_ids.append(token)
            piece = text.push(token)
            if piece and on_text is not None:
                on_text(piece)
            if text.stopped:
                stream.cancel()
                break
        rest = text.finish()
        if rest and on_text is not None:
            on_text(rest)
        seconds = time.perf_counter() - started
        first = (stream.first_token_at or time.perf_counter()) - stream.submitted_at
    reason = "stop" if text.stopped else (stream.finish_reason or "length")
    return Generation(text.text, token_ids, reason, len(ids), first, seconds)


def ring_stages(
    target: Target,
    placement: str,
    stages: int | None,
    devices: Sequence[str],
    *,
    max_context: int,
    max_slots: int,
    say: Callable[[str], None],
    agent_socket: str | None = None,
) -> Stages:
    """Where a ring's stages run: this machine's ``devices`` (``placement`` local; ``stages`` of
    them, default 1), or the mesh members online, through this machine's agent (``placement``
    mesh; ``stages`` of them, default one per device online), placed by :func:`mesh_placements`
    again at each start of the ring."""
    from shardpool.infer.engine import target_inputs
    from shardpool.infer.rings import LocalStages, MeshStages

    if placement not in PLACEMENTS:
        raise ShardpoolError(f"--placement {placement!r} is not one of: {', '.join(PLACEMENTS)}")
    if placement == "local":
        return LocalStages(
            local_placements(
                target.model_dir, stages or 1, devices, max_context=max_context, max_slots=max_slots
            )
        )
    from mesh.node.candidates import interface_addresses
    from shardpool.agent.local_client import LocalAgentClient, agent_socket_path
    from shardpool.launch.mesh_members import online_members

    local = LocalAgentClient(agent_socket_path(agent_socket))

    def members() -> list[MeshMember]:
        online = online_members(local)
        say(f"mesh members online: {', '.join(member.name for member in online)}")
        return online

    def place(online: list[MeshMember]) -> list[StagePlacement]:
        chosen = mesh_placements(
            online,
            target.model_dir,
            stages,
            max_context=max_context,
            max_slots=max_slots,
            lora_r=target.lora_r,
            say=say,
        )
        say("stages: " + ", ".join(f"{p.host} {p.device} layers {p.start}-{p.stop - 1}" for p in chosen))
        return chosen

    def interface_of(address: str) -> str | None:
        return next((name for name, found in interface_addresses() if found == address), None)

    return MeshStages(members, place, target_inputs(target), interface_of=interface_of)


def mesh_placements(
    members: Sequence[MeshMember],
    model_dir: Any,
    stages: int | None,
    *,
    max_context: int,
    max_slots: int,
    lora_r: int,
    say: Callable[[str], None],
) -> list[StagePlacement]:
    """The ring's stages over the members' devices, each profiled on its member for this model
    (:func:`~shardpool.launch.mesh_members.mesh_fleet`), placed by :func:`fleet_placements`."""
    import json
    from pathlib import Path

    from shardpool.launch.mesh_members import mesh_fleet

    model_config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    workload = _inference_workload(max_context, lora_r)
    fleet = mesh_fleet(list(members), model_config=model_config, workload=workload, say=say)
    return fleet_placements(
        fleet.devices, model_dir, stages, max_context=max_context, max_slots=max_slots, lora_r=lora_r, say=say
    )


def fleet_placements(
    devices: Sequence[Device],
    model_dir: Any,
    stages: int | None,
    *,
    max_context: int,
    max_slots: int,
    lora_r: int,
    say: Callable[[str], None],
) -> list[StagePlacement]:
    """``stages`` of ``devices`` in their order (default: every one), the layers split so that the
    slowest stage's per-token time is least with every stage's weights and KV cache
    (``max_context`` tokens × ``max_slots`` sequences) within its device's memory; each stage in
    fp32 on a CPU, bf16 on a GPU that computes it well, fp32 on one that does not, and with the
    NF4 backend its device was given."""
    if not devices:
        raise ShardpoolError("no mesh member offers a device; check `shardpool mesh status`")
    shape = ModelShape.from_config_dir(model_dir)
    count = min(stages or len(devices), shape.num_layers)
    if count > len(devices):
        say(f"only {len(devices)} devices online: placing {len(devices)} stages")
        count = len(devices)
    chosen = list(devices[:count])
    workload = _inference_workload(max_context, lora_r)
    load = InferenceLoad(max_context=max_context, max_slots=max_slots, lora_r=lora_r)
    split = inference_split(shape, load, [inference_device(device, shape, workload, load) for device in chosen])
    return [
        StagePlacement(
            start=start,
            stop=stop,
            device=device.torch_device or device.name,
            host=device.host,
            dtype=_mesh_dtype(device),  # type: ignore[arg-type]
            nf4_backend=device.nf4_backend or None,  # type: ignore[arg-type]
        )
        for (start, stop), device in zip(split.layers, chosen, strict=True)
    ]


def _inference_workload(max_context: int, lora_r: int) -> Workload:
    """What the members profile for a generating stage: one sequence of up to 512 positions."""
    return Workload(micro_batch_size=1, sequence_len=min(max_context, 512), lora_r=lora_r)


def _mesh_dtype(device: Device) -> str:
    """fp32 on a CPU (exact, and fastest there), else bf16 where the device computes it well and
    fp32 where it does not (a V100, an M40), as the planner's ``bf16: auto`` chooses."""
    from shardpool.plan.precision import choose_dtype

    if device.kind == "cpu":
        return "float32"
    return choose_dtype(device.facts(), "bf16-auto").dtype


def read_prompt(path: str) -> str:
    """The prompt in the file at ``path`` (``-``: standard input); one line when it cannot be read."""
    import sys
    from pathlib import Path

    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ShardpoolError(f"cannot read --prompt-file {path}: {error}") from None
