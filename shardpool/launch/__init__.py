"""shardpool/launch."""
