"""shardpool/train."""
