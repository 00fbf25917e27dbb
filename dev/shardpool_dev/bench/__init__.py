"""The pieces the benchmark scripts under scripts/ share: CPU quotas, /proc accounting, paired
statistics, tiny models and child processes that report JSON."""
