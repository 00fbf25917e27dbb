"""shardpool: QLoRA fine-tuning across mismatched devices, pipeline-style, over a WireGuard mesh."""

import logging

__version__ = "0.1.0"

# bitsandbytes warns at import on CPUs with AVX512-BF16 that an optional hub-downloaded kernel is
# missing. shardpool never uses that inference kernel (see shardpool.model.nf4.keep_exact_cpu_matmul),
# so the warning would only be noise in every command's output.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
