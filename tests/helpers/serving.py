"""A real engine and OpenAI-compatible server over a tiny model, for the serve tests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from shardpool.data.templates import CHATML_TEMPLATE
from shardpool.data.tokenizing import load_tokenizer
from shardpool.generate import local_placements
from shardpool.infer.engine import PipelineEngine
from shardpool.infer.server import OpenAIServer, ServerOptions
from shardpool.infer.target import resolve_target

#: The context of the test engines: long enough for every test, short enough to refuse a request.
MAX_CONTEXT = 1024


def chat_model(root: Path, tiny_model: Path) -> Path:
    """A copy of ``tiny_model`` named ``tiny-chat`` whose tokenizer has a ChatML template."""
    model = root / "tiny-chat"
    shutil.copytree(tiny_model, model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(model)
    return model


def start_engine(target_dir: Path, stages: int = 1, slots: int = 4, *, restart: bool = False) -> PipelineEngine:
    """An engine on ``stages`` even CPU stages (one per process: the driver's gloo group is global);
    with ``restart``, it starts its ring again after a stage fails, as ``shardpool serve``'s does."""
    target = resolve_target(target_dir)
    placements = local_placements(target.model_dir, stages, ["cpu"])
    return PipelineEngine(
        target, placements, max_slots=slots, max_context=MAX_CONTEXT, threads_per_process=1, restart=restart
    )


def start_server(engine: PipelineEngine, **options: Any) -> OpenAIServer:
    """A started server on a free port of 127.0.0.1 (stop it, or use it as a context manager)."""
    tokenizer = load_tokenizer(engine.target.tokenizer_dir)
    return OpenAIServer(engine, tokenizer, options=ServerOptions(**options)).start()
