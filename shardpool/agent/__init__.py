"""shardpool/agent."""
