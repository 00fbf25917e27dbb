"""The reference every pipeline figure is set against: one process, transformers + bitsandbytes NF4 + peft."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.stats import WARMUP_STEPS, median_after_warmup


def _vm_status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def plain_steps(
    model: Any,
    params: list[Any],
    optimizer: Any,
    scheduler: Any,
    data: Any,
    steps: Any,
    config: Any,
    *,
    device: Any,
) -> tuple[list[float], list[float], list[float]]:
    """The plain loop's optimizer steps; per step its seconds, tokens/s and loss."""
    import torch

    from shardpool.train.loss import label_tokens, token_loss_sum

    step_seconds, tokens_per_s, losses = [], [], []
    for step in steps:
        begun = time.perf_counter()
        microbatches = [data.train.select(rows) for rows in step]
        step_tokens = sum(label_tokens(rows.labels) for rows in microbatches)
        loss_total = 0.0
        for rows in microbatches:
            logits = model(
                input_ids=rows.input_ids.to(device),
                attention_mask=rows.attention_mask.to(device),
                position_ids=rows.position_ids.to(device),
            ).logits
            loss = token_loss_sum(logits, rows.labels) / step_tokens
            loss.backward()
            loss_total = loss_total + loss.detach()
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - begun
        step_seconds.append(elapsed)
        tokens_per_s.append(sum(int(rows.attention_mask.sum()) for rows in microbatches) / elapsed)
        losses.append(float(loss_total))
    return step_seconds, tokens_per_s, losses


def plain_loop(spec_path: str) -> dict[str, Any]:
    """The reference: one process, transformers + bitsandbytes NF4 + peft LoRA, the same micro-batches.

    Same tokenized rows, step plan, LoRA settings, token-weighted loss, clip and AdamW as the
    pipeline; the LoRA init is peft's own (it does not change the speed).
    """
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_scheduler

    from shardpool.config import parse_config
    from shardpool.data.prepare import prepare_data
    from shardpool.data.steps import step_batches
    from shardpool.data.tokenizing import load_tokenizer
    from shardpool.model.lora import lora_settings
    from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
    from shardpool.train.optim import scheduler_name

    runtime_rss = _vm_status("VmRSS")
    config = parse_config(spec["config"])
    data = prepare_data(config, load_tokenizer(config.base_model))
    steps = step_batches(
        len(data.train),
        micro_batch_size=config.micro_batch_size,
        micro_batches_per_step=config.gradient_accumulation_steps,
        num_epochs=config.num_epochs,
        max_steps=config.max_steps,
        shuffle_each_epoch=config.shuffle_merged_datasets,
        seed=config.seed,
    )
    started = time.perf_counter()
    device = torch.device(spec.get("device", "cpu"))
    compute_dtype = getattr(torch, config.compute_dtype_name)
    model = AutoModelForCausalLM.from_pretrained(
        config.base_model,
        quantization_config=bnb_config(compute_dtype=config.compute_dtype_name),
        dtype=compute_dtype,
        device_map={"": str(device)},
    )
    keep_exact_cpu_matmul(model)
    lora = lora_settings(config)
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    load_seconds = time.perf_counter() - started
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = get_scheduler(
        scheduler_name(config), optimizer, num_warmup_steps=0, num_training_steps=len(steps)
    )
    step_seconds, tokens_per_s, losses = plain_steps(
        model, params, optimizer, scheduler, data, steps, config, device=device
    )
    return {
        "threads": int(spec["threads"]),
        "steps_measured": len(step_seconds[WARMUP_STEPS:] or step_seconds),
        "step_seconds": median_after_warmup(step_seconds),
        "step_seconds_min": min(step_seconds[WARMUP_STEPS:] or step_seconds),
        "tokens_per_s": median_after_warmup(tokens_per_s),
        "final_loss": losses[-1],
        "load_seconds": round(load_seconds, 2),
        "peak_rss_bytes": _vm_status("VmHWM"),
        "peak_device_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "runtime_only_rss_bytes": runtime_rss,
        "lora_parameters": sum(param.numel() for param in params),
    }
