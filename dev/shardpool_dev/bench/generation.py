"""Generation on the inference ring against peft's ``generate``, and the ring's own figures.

Three figures, each from runs in fresh processes pinned to the same cores:

- ``one_stage_over_peft``: decode tokens/s of one sequence on one local stage (the engine: a stage
  process and the driver) ÷ peft's ``generate`` with its KV cache in one process, greedy, the same
  NF4 base and adapter, the same threads; interleaved pairs A B, B A, ...
- ``two_stages_concurrent_over_alone``: on two local stages, the total tokens/s of 8 requests in
  flight together ÷ one request alone (the pipeline fills while one sequence waits for the other
  stage); both measured in the same engine, alternately.
- ``time_to_first_token_s``: a 512-token prompt, on one and on two stages.

With ``device`` a CUDA device, both sides run on it (the stages, two on the same GPU for the
two-stage figures, and peft's model) in bfloat16, the compute dtype ``shardpool generate`` picks
there; ``size`` ``gpu`` is a model wide enough for a GPU to have work (hidden 2048).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.child import run_json_child, thread_env
from shardpool_dev.bench.cpu import pinned, wait_for_idle
from shardpool_dev.bench.stats import pair_ratios, ratio_summary, run_order
from shardpool_dev.bench.workload import versions

DEFAULT_PAIRS = 3
NEW_TOKENS = 128
CONCURRENT = 8
LONG_PROMPT = 512
#: A model large enough that a token's compute, not the ring's messages, is what is timed.
MODEL_SHAPE = {
    "num_layers": 8,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_heads": 8,
    "num_kv_heads": 4,
}
#: The models by ``--size``: ``gpu`` has TinyLlama-1.1B's layer shape, 8 of its 22 layers.
MODEL_SHAPES = {
    "cpu": MODEL_SHAPE,
    "gpu": {
        "num_layers": 8,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_heads": 32,
        "num_kv_heads": 4,
    },
}


def varied_tiny_model(directory: Path) -> Path:
    """A 6-layer tiny Llama initialised wide enough (std 0.1) that greedy decoding does not settle
    on one token, so equal continuations mean equal logits, not a shared fixed point."""
    from shardpool.model.tinymodel import make_tiny_llama

    return make_tiny_llama(directory, num_layers=6, hidden_size=64, seed=3, initializer_range=0.1)


def random_adapter(model_dir: Path, directory: Path, *, seed: int = 11, scale: float = 0.05) -> Path:
    """A LoRA adapter saved by peft for ``model_dir`` (every decoder Linear, r 4), with lora_B drawn
    non-zero under ``seed`` so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardpool.model.shape import decoder_linear_names

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = list(decoder_linear_names(base.config.model_type))
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(directory)
    return directory


def build_inputs(work: Path, size: str = "cpu") -> tuple[Path, Path]:
    """The bench model of ``size`` (std 0.1, so greedy output varies) and a random adapter for it."""
    from shardpool.model.tinymodel import make_tiny_llama

    shape = MODEL_SHAPES[size]
    model = make_tiny_llama(work / "model", seed=3, initializer_range=0.1, **shape)  # type: ignore[arg-type]
    return model, random_adapter(model, work / "adapter")


def _prompt_ids(model: Path, length: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text = " ".join(f"word{index % 50} and {index}" for index in range(length))
    return tokenizer(text)["input_ids"][:length]


def peft_worker(spec_path: str) -> dict[str, Any]:
    """Side B: peft ``generate`` in this process; decode tokens/s of one greedy sequence."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardpool.generate import default_dtype
    from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    device, dtype = spec["device"], default_dtype(spec["device"])  # as the stages run
    placed = {} if device == "cpu" else {"device_map": {"": device}}
    base = AutoModelForCausalLM.from_pretrained(
        spec["model"],
        quantization_config=bnb_config(compute_dtype=dtype),
        dtype=getattr(torch, dtype),
        **placed,
    )
    model = PeftModel.from_pretrained(base, spec["adapter"]).eval()
    if device == "cpu":
        model = keep_exact_cpu_matmul(model)
    ids = torch.tensor([_prompt_ids(Path(spec["model"]), 16)], device=device)

    def run(new_tokens: int) -> float:
        started = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        if device != "cpu":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    run(8)  # warm-up
    # Decode rate: the time of N tokens less the time of one (the prefill and the first token).
    first, total = run(1), run(spec["new_tokens"])
    return {"tokens_per_s": (spec["new_tokens"] - 1) / (total - first)}


def engine_worker(spec_path: str) -> dict[str, Any]:
    """Side A (and the two-stage figures): the engine on local stages."""
    from shardpool.generate import local_placements
    from shardpool.infer.engine import GenerationRequest, PipelineEngine
    from shardpool.infer.target import resolve_target

    spec = json.loads(Path(spec_path).read_text())
    target = resolve_target(spec["adapter"])
    placements = local_placements(target.model_dir, spec["stages"], [spec["device"]])
    short = tuple(_prompt_ids(Path(spec["model"]), 16))
    long = tuple(_prompt_ids(Path(spec["model"]), LONG_PROMPT))
    with PipelineEngine(
        target, placements, max_slots=CONCURRENT, threads_per_process=spec["threads"]
    ) as engine:
        engine.generate(GenerationRequest(short, 8))  # warm-up

        def alone(new_tokens: int) -> float:
            started = time.perf_counter()
            engine.generate(GenerationRequest(short, new_tokens))
            return time.perf_counter() - started

        first_token = []
        for _ in range(3):
            stream = engine.submit(GenerationRequest(long, 1))
            stream.tokens()
            first_token.append((stream.first_token_at or 0.0) - stream.submitted_at)
        result: dict[str, Any] = {"time_to_first_token_s": statistics.median(first_token)}
        if spec["stages"] == 1:
            first, total = alone(1), alone(spec["new_tokens"])
            result["tokens_per_s"] = (spec["new_tokens"] - 1) / (total - first)
            return result
        ratios = []
        for _ in range(spec["rounds"]):
            one = spec["new_tokens"] / alone(spec["new_tokens"])
            started = time.perf_counter()
            streams = [engine.submit(GenerationRequest(short, spec["new_tokens"])) for _ in range(CONCURRENT)]
            generated = sum(len(stream.tokens()) for stream in streams)
            together = generated / (time.perf_counter() - started)
            ratios.append(together / one)
        result["concurrent_over_alone"] = ratios
        return result


def benchmark(
    *,
    pairs: int,
    cores: list[int],
    keep: Path | None,
    max_wait_idle_s: float,
    device: str = "cpu",
    size: str = "cpu",
) -> dict[str, Any]:
    """Every figure of the module's docstring, as one JSON-ready report."""
    import tempfile

    from shardpool.generate import default_dtype

    work = keep or Path(tempfile.mkdtemp(prefix="shardpool-bench-generate-"))
    work.mkdir(parents=True, exist_ok=True)
    model, adapter = build_inputs(work, size)
    threads = len(cores)
    base = {"model": str(model), "adapter": str(adapter), "new_tokens": NEW_TOKENS, "device": device}
    specs = {
        "A": dict(base, stages=1, threads=threads),
        "B": dict(base, threads=threads),
        "S2": dict(base, stages=2, threads=max(1, threads // 2), new_tokens=64, rounds=3),
    }
    paths = {}
    for name, spec in specs.items():
        paths[name] = work / f"spec-{name}.json"
        paths[name].write_text(json.dumps(spec))
    measured: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    waited = []
    with pinned(cores):
        for _, side in run_order(pairs):
            waited.append(wait_for_idle(max_wait_idle_s))
            worker = "engine-generate" if side == "A" else "peft-generate"
            measured[side].append(run_json_child(worker, paths[side], env=thread_env(threads), label=side))
        waited.append(wait_for_idle(max_wait_idle_s))
        two = run_json_child("engine-generate", paths["S2"], env=thread_env(max(1, threads // 2)), label="S2")
    ratios = pair_ratios(
        [run["tokens_per_s"] for run in measured["A"]], [run["tokens_per_s"] for run in measured["B"]]
    )
    return {
        "model": MODEL_SHAPES[size],
        "device": device,
        "compute_dtype": default_dtype(device),
        "new_tokens": NEW_TOKENS,
        "cores": cores,
        "one_stage_over_peft": {
            **ratio_summary(ratios),
            "pairs": pairs,
            "engine_tokens_per_s": [round(run["tokens_per_s"], 2) for run in measured["A"]],
            "peft_tokens_per_s": [round(run["tokens_per_s"], 2) for run in measured["B"]],
            "target": ">= 0.9",
        },
        "two_stages_concurrent_over_alone": {
            **ratio_summary(two["concurrent_over_alone"]),
            "rounds": len(two["concurrent_over_alone"]),
            "concurrent": CONCURRENT,
            "target": ">= 1.6",
        },
        "time_to_first_token_s": {
            "prompt_tokens": LONG_PROMPT,
            "one_stage": round(statistics.median(run["time_to_first_token_s"] for run in measured["A"]), 4),
            "two_stages": round(two["time_to_first_token_s"], 4),
        },
        "waited_for_idle_s": waited,
        "versions": versions(),
    }
