"""shardpool: QLoRA fine-tuning across mismatched devices, pipeline-style, over a WireGuard mesh.

Sub-packages by layer, top to bottom (each imports only from the layers below; ``lint-imports``
checks it, docs/architecture.md draws it): :mod:`shardpool.cli`; :mod:`shardpool.finetune` (the
story of a run), :mod:`shardpool.console` and :mod:`shardpool.jobs_command`; :mod:`shardpool.launch`;
:mod:`shardpool.agent`; :mod:`shardpool.train` and :mod:`shardpool.plan`; :mod:`shardpool.files`;
:mod:`shardpool.model`; :mod:`shardpool.data`; :mod:`shardpool.contract`; :mod:`shardpool.config`
and :mod:`shardpool.errors`. Everything below the mesh-facing layers uses :mod:`mesh` for files,
ports and HTTP.
"""

import logging

__version__ = "0.1.0"

# bitsandbytes warns at import on CPUs with AVX512-BF16 that an optional hub-downloaded kernel is
# missing. shardpool never uses that inference kernel (see shardpool.model.nf4.keep_exact_cpu_matmul),
# so the warning would only be noise in every command's output.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
