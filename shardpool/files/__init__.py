"""shardpool/files."""
