"""shardpool/data."""
