"""The pieces the benchmark scripts under scripts/ share, and each benchmark's own logic.

Shared: ``stats`` (medians, per-pair ratios, ABBA orders), ``cpu`` (pinning, /proc/stat accounting,
idle waits), ``procfs`` (CPU time per process), ``cgroups`` (CPU quotas), ``workload`` (tiny models,
data, run configs, the scratch directory), ``child`` (a measurement in a fresh process that hands
back JSON), ``plain`` (the plain peft + bitsandbytes loop), ``mesh`` (what a benchmark does on a lab
mesh). One module (or package) per benchmark: ``pipeline``, ``paired``, ``stage_vs_peft``,
``state_copy``, ``threads``, ``profile``, ``planner``, ``mesh_bench``, ``nat``, ``chaos``, ``split``,
``hetero/`` and ``gpu/``. The scripts parse their command line and call into these.
"""
