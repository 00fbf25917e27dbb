"""Tiny, randomly initialised causal LMs with a real tokenizer, built offline.

Tests and the quickstart need a Hugging Face model directory that loads with ``AutoModelForCausalLM``
and ``AutoTokenizer`` exactly like a downloaded one, without any hub access. :func:`make_tiny_llama`
trains a small byte-level BPE tokenizer on a corpus, initialises a small decoder under a fixed seed
and saves both. The same arguments always give the same bytes, so a committed model can be checked
against a fresh build.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mesh.files import atomic_write

__all__ = [
    "DEFAULT_CORPUS",
    "MODEL_TYPES",
    "QUICKSTART_MODEL",
    "SPECIAL_TOKENS",
    "make_quickstart",
    "make_tiny_llama",
    "quickstart_corpus",
    "quickstart_rows",
    "train_tokenizer",
    "write_jsonl",
]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# Fixed order, so the special tokens always get ids 0..3: unk, bos, eos, pad.
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD)
MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
#: The attention window of the tiny models that have one: shorter than a test's sequences, so
#: sliding and full attention give different results.
TINY_SLIDING_WINDOW = 4
DEFAULT_VOCAB_SIZE = 512
MAX_POSITIONS = 1024

DEFAULT_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model can still learn simple patterns from a few hundred examples.",
    "Pipeline stages pass activations forward and gradients backward.",
    "Each stage holds a slice of the decoder layers and its own LoRA weights.",
    "The tokenizer splits text into pieces and maps every piece to a number.",
    "Training loss should fall when the model sees the same patterns again.",
    "Add the two numbers and write the sum.",
    "Reverse the order of the words in the sentence.",
    "Convert the text to uppercase letters.",
    "What is the capital city of the country?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Red, green, blue, yellow, black and white are colours.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    "She reads a book in the garden while he cooks dinner in the kitchen.",
    "### Instruction:\nSay hello.\n\n### Response:\nHello!",
    "### Instruction:\nRepeat the input.\n\n### Input:\nshardpool\n\n### Response:\nshardpool",
)


def train_tokenizer(
    corpus: Iterable[str],
    *,
    vocab_size: int | None = None,
    model_max_length: int = MAX_POSITIONS,
    extra_special_tokens: Sequence[str] = (),
):
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it for transformers.

    Byte-level BPE encodes any text losslessly, so decoding round-trips. The result adds ``<s>``
    in front of every encoded text (as Llama tokenizers do), ends nothing with ``</s>`` by itself,
    and pads with a dedicated ``<pad>`` token distinct from eos. ``extra_special_tokens`` (e.g.
    Llama 3's ``<|end_of_text|>``) are added to the vocabulary as whole tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus)
    if not texts:
        raise ValueError("the tokenizer corpus is empty; pass at least one text")
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or DEFAULT_VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
    )


def _model_config(model_type: str, **kwargs):
    """The transformers config class for ``model_type``, filled with ``kwargs`` and what tells the family apart.

    Gemma ties its embeddings, soft-caps (Gemma 2) and mixes sliding-window with full attention
    layers (Gemma 2 alternates them, Gemma 3 has one full layer in six, each with its own rotary
    base); Phi-3 fuses its projections and may attend through a window in every layer. The
    window is :data:`TINY_SLIDING_WINDOW` tokens so that it matters in tests.
    """
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gemma2": Gemma2Config,
        "gemma3_text": Gemma3TextConfig,
        "phi3": Phi3Config,
    }
    if model_type not in classes:
        raise ValueError(f"unknown model_type {model_type!r}; use one of {', '.join(MODEL_TYPES)}")
    if model_type in ("gemma2", "gemma3_text"):
        kwargs.update(
            tie_word_embeddings=True,
            sliding_window=TINY_SLIDING_WINDOW,
            query_pre_attn_scalar=kwargs["head_dim"],
        )
    if model_type == "phi3":
        kwargs.pop("head_dim")
        kwargs["sliding_window"] = TINY_SLIDING_WINDOW
    return classes[model_type](**kwargs)


def make_tiny_llama(
    out_dir: str | os.PathLike[str],
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int | None = None,
    seed: int = 0,
    model_type: str = "llama",
    corpus: Sequence[str] | None = None,
    initializer_range: float = 0.02,
    max_positions: int = MAX_POSITIONS,
    extra_special_tokens: Sequence[str] = (),
) -> Path:
    """Write a tiny random causal LM plus its trained tokenizer to ``out_dir`` and return the path.

    ``initializer_range`` is the std of the normal init (transformers' default 0.02 leaves logits
    nearly flat through a frozen lm_head; 0.1 lets LoRA move the loss quickly). ``vocab_size`` is the BPE target; the model's vocabulary is ``len(tokenizer)``, which is smaller
    when the corpus runs out of merges. ``model_type`` is any of :data:`MODEL_TYPES`; the family's
    own traits are set by :func:`_model_config`. Weights are fp32, untied (Gemma: tied), drawn under
    ``torch.manual_seed(seed)`` and saved as safetensors. The directory is built next to ``out_dir`` and swapped in at the end,
    so a crash never leaves a half-written model behind.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    tokenizer = train_tokenizer(
        DEFAULT_CORPUS if corpus is None else corpus,
        vocab_size=vocab_size,
        model_max_length=max_positions,
        extra_special_tokens=extra_special_tokens,
    )
    config = _model_config(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG state untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    out_path = Path(out_dir)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        staging.chmod(0o755)
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        for written in staging.iterdir():
            written.chmod(0o644)
        _swap_in(staging, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def _swap_in(staging: Path, target: Path) -> None:
    """Replace directory ``target`` by ``staging`` with two renames (the old one is removed after)."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The quickstart: a templated alpaca dataset and a tiny Llama whose tokenizer is trained on it
# --------------------------------------------------------------------------------------------------

QUICKSTART_ROWS = 480
QUICKSTART_SEED = 0
# A tiny Llama: ~0.9M parameters, about 3.6 MB of fp32 safetensors. The wider initialisation (0.1
# instead of transformers' 0.02) gives the frozen lm_head rows enough norm for confident logits, so
# LoRA alone can bring the loss down visibly (eval loss about 7.9 -> 2.9 in 150 steps on the quickstart data).
QUICKSTART_MODEL: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 2048,
    "initializer_range": 0.1,
}

_WORDS = (
    "apple river stone cloud green quiet happy tiger lamp paper window garden silver bread music "
    "orange rabbit winter summer candle forest yellow planet ocean pencil mountain bridge coffee"
).split()
# Made-up places, so the pairs can only be learnt from the dataset itself.
_CAPITALS = {
    "Veloria": "Brinmar",
    "Zandria": "Port Melo",
    "Kestavia": "Lunholm",
    "Marovia": "Teska",
    "Quenland": "Frostby",
    "Dorvania": "Amberly",
    "Solmere": "Caldris",
    "Tirnova": "Elwick",
    "Yvendar": "Sorrel",
    "Palmyre": "Ostin",
    "Norrick": "Hallow",
    "Belcara": "Vantis",
    "Gravemont": "Lirra",
    "Coravia": "Drennan",
    "Fenwyr": "Tallis",
    "Astmark": "Winford",
}


def _quickstart_row(rng, task: int) -> dict[str, str]:
    """One alpaca row of task ``task`` (0..4), drawn from ``rng``."""
    if task == 0:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if task == 1:
        words = rng.sample(_WORDS, rng.randint(3, 5))
        return {
            "instruction": "Reverse the order of the words.",
            "input": " ".join(words),
            "output": " ".join(reversed(words)),
        }
    if task == 2:
        country = rng.choice(sorted(_CAPITALS))
        return {
            "instruction": f"What is the capital of {country}?",
            "input": "",
            "output": f"The capital of {country} is {_CAPITALS[country]}.",
        }
    if task == 3:
        words = " ".join(rng.sample(_WORDS, rng.randint(2, 4)))
        return {"instruction": "Convert the text to uppercase.", "input": words, "output": words.upper()}
    a, b = rng.sample(range(100), 2)
    return {"instruction": "Which number is larger?", "input": f"{a} or {b}", "output": str(max(a, b))}


def quickstart_rows(count: int = QUICKSTART_ROWS, seed: int = QUICKSTART_SEED) -> list[dict[str, str]]:
    """The quickstart dataset: ``count`` alpaca rows cycling through five small templated tasks.

    Additions, word reversal, made-up capitals, uppercasing and comparisons: each has a pattern a
    tiny model picks up within a minute or two, so the eval loss visibly falls.
    """
    import random

    rng = random.Random(seed)
    return [_quickstart_row(rng, index % 5) for index in range(count)]


def quickstart_corpus(rows: Sequence[dict[str, str]]) -> list[str]:
    """The texts the quickstart tokenizer learns from: each row as it is trained (prompt + response)."""
    from shardpool.data.formats import format_alpaca_prompt

    return [format_alpaca_prompt(row["instruction"], row["input"]) + row["output"] for row in rows] + list(
        DEFAULT_CORPUS
    )


def write_jsonl(rows: Sequence[dict[str, str]], path: str | os.PathLike[str]) -> Path:
    """Write rows as JSON lines, atomically (temporary file in the same directory, then rename)."""
    import json

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(target, text.encode("utf-8"))
    return target


def make_quickstart(model_dir: str | os.PathLike[str], data_path: str | os.PathLike[str]) -> Path:
    """Write the quickstart dataset to ``data_path`` and its tiny Llama to ``model_dir``; reproducible."""
    rows = quickstart_rows()
    write_jsonl(rows, data_path)
    return make_tiny_llama(
        model_dir, seed=QUICKSTART_SEED, corpus=quickstart_corpus(rows), **QUICKSTART_MODEL
    )
