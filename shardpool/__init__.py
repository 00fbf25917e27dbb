"""shardpool: QLoRA fine-tuning across mismatched devices, pipeline-style, over a WireGuard mesh."""

__version__ = "0.1.0"
