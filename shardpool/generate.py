"""``shardpool generate``: continue a prompt with the trained model, on stages placed like training's.

The target (a finetune output directory, a config or a base model directory) is resolved by
:func:`shardpool.infer.target.resolve_target`; the stages are placed on this machine's devices
(:func:`local_placements`) and run by a :class:`~shardpool.infer.engine.PipelineEngine`. The
prompt is tokenized as ``AutoTokenizer`` does (with ``--chat``, through the tokenizer's chat
template), the completion decoded without special tokens, cut before the first stop string.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError
from shardpool.host.memory_limit import cpu_memory
from shardpool.model.shape import read_model_info
from shardpool.plan.inference import InferenceDevice, InferenceLoad, fitting_split
from shardpool.plan.splits import even_split

__all__ = ["GenerateOptions", "Generation", "generate", "local_placements", "parse_devices", "read_prompt"]

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
    stages: int = 1
    devices: tuple[str, ...] = ("cpu",)


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


def parse_devices(text: str) -> tuple[str, ...]:
    """``--devices cpu,cuda:0`` as a tuple; one line for an empty or malformed list."""
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise ShardpoolError("--devices is empty; name at least one device, e.g. cpu or cuda:0")
    for device in devices:
        kind = device.split(":", 1)[0]
        if kind not in _DEFAULT_DTYPE:
            raise ShardpoolError(f"--devices: {device!r} is not a device shardpool runs on (cpu, cuda:N, mps)")
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
    dtypes = [_DEFAULT_DTYPE[device.split(":", 1)[0]] for device in chosen]
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
    target_path: str, prompt: str, options: GenerateOptions, *, on_text: Callable[[str], None] | None = None
) -> Generation:
    """Continue ``prompt`` with the model at ``target_path``, on local stages; the engine is started
    and stopped around it. ``on_text`` is given each piece of text as soon as it is certain."""
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
    placements = local_placements(
        target.model_dir, options.stages, options.devices, max_context=len(ids) + options.max_new_tokens
    )
    threads = max(1, (os.cpu_count() or 1) // len(placements))
    with PipelineEngine(
        target, placements, max_slots=1, max_context=len(ids) + options.max_new_tokens, threads_per_process=threads
    ) as engine:
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
