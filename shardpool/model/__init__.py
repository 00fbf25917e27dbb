"""shardpool/model."""
