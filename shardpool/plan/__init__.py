"""shardpool/plan."""
