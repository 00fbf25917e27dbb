"""A tiny model whose greedy continuations vary, a real peft adapter for it, and peft's own
``generate`` as the reference the inference engine must equal token for token."""

from __future__ import annotations

from pathlib import Path

from shardpool_dev.bench.generation import random_adapter, varied_tiny_model

__all__ = ["PROMPTS", "peft_greedy", "random_adapter", "varied_tiny_model"]

#: Prompts of different lengths (one token up to a few dozen).
PROMPTS: tuple[str, ...] = (
    "The",
    "One, two, three",
    "The quick brown fox jumps over the lazy dog.",
    "Red, green, blue",
    "### Instruction:\nSay hello.\n\n### Response:\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. She reads a book in the garden",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Pipeline stages pass activations forward and gradients backward. Each stage holds a slice of the "
    "decoder layers and its own LoRA weights.",
)


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompts: tuple[str, ...], max_new_tokens: int) -> list[list[int]]:
    """What peft's ``generate(do_sample=False)`` continues each prompt with, on the NF4 base
    (transformers' BitsAndBytesConfig, double quant, fp32 compute) with the adapter loaded by
    ``PeftModel.from_pretrained``: the generated ids, a final eos included."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul

    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb_config(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir) if adapter_dir is not None else base
    keep_exact_cpu_matmul(model.eval())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        generated = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens)
        outputs.append(generated[0, ids["input_ids"].shape[1] :].tolist())
    return outputs
