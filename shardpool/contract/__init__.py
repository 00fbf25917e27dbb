"""shardpool/contract."""
