"""What this machine gives a process: its cgroup's CPU quota and memory limit, read from /proc and
/sys. Torch-free and below planning and training, which both need it: the planner and the agent's
profiler to describe a device, a stage to measure its room before a re-shard."""
