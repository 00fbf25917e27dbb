"""Regenerate the quickstart dataset and tiny model: configs/data/quickstart.jsonl and models/quickstart/.

Run from the repository root: ``python scripts/make_quickstart_model.py``. The output is
byte-for-byte reproducible; tests/model/test_tinymodel.py checks the committed copy against a fresh build.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardpool.model.tinymodel import make_quickstart

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    """Write the dataset and the model, then print what was written and its size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(REPO / "models" / "quickstart"))
    parser.add_argument("--data", default=str(REPO / "configs" / "data" / "quickstart.jsonl"))
    args = parser.parse_args()
    model_dir = make_quickstart(args.model_dir, args.data)
    size = sum(path.stat().st_size for path in model_dir.iterdir() if path.is_file())
    print(f"wrote {args.data} and {model_dir} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
