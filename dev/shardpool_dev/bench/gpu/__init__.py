"""What scripts/gpu_check.py runs on a CUDA device, and how it judges each run, as plain functions tested on the CPU.

Nothing here imports shardpool or torch at import time: the check learns whether there is a GPU first."""
