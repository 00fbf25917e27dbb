"""shardpool.train.kernels: TF32 is set so that every reader of torch's precision flags agrees, old API or new."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Run in a fresh interpreter each: the flags are process-wide, and a test must not leave them set.
_SCRIPT = """
import json, torch
from shardpool.config import parse_config
from shardpool.train.kernels import apply_tf32

config = parse_config({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                       "lora_target_linear": True, "tf32": True})
assert apply_tf32(config, torch.device("cuda", 0))
%s
readers = {
    "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
    "cudnn.conv.fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,
}
values = {}
for name, read in readers.items():
    try:
        values[name] = read()
    except RuntimeError as error:
        values[name] = "error: " + str(error).splitlines()[0]
print(json.dumps(values))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "then",
    [
        "pass",
        # torch.compile reads the new matmul flag before tracing and sets it back afterwards.
        "torch.backends.cuda.matmul.fp32_precision = torch.backends.cuda.matmul.fp32_precision",
        # transformers' enable_tf32(True) on torch >= 2.9.
        "torch.backends.fp32_precision = 'tf32'",
    ],
)
def test_tf32_reads_the_same_through_the_legacy_and_the_new_flags(then: str) -> None:
    """torch raises "mix of the legacy and new APIs" when the two disagree; after apply_tf32 they never do."""
    run = subprocess.run([sys.executable, "-c", _SCRIPT % then], capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == {
        "matmul.allow_tf32": True,
        "cudnn.allow_tf32": True,
        "float32_matmul_precision": "high",
        "matmul.fp32_precision": "tf32",
        "cudnn.conv.fp32_precision": "tf32",
    }
