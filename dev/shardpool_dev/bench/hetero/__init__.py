"""The heterogeneous-pool benchmark: mesh hosts throttled by cgroup CPU quotas, pooled against the fastest alone."""
