"""shardpool's WireGuard mesh: keys, join protocol, coordinator and backends. Never imports torch."""
