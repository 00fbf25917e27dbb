"""Planning: which devices run which contiguous block of decoder layers, and how fast and big each stage is.

Owns the cost model (costmodel, memory_model, time_model, stage_costs), fleets and links, the
device-sequence searches and the plan they return. May import the layers below it (shardpool.files,
.model, .data, .contract, .config, .errors) and mesh; never shardpool.train, .launch or .agent.
torch is imported only by plan.devices, plan.profiler, plan.sample_layer (the layer it times) and
plan.co_run, which measure this machine, and lazily by plan.profile_cache (torch's version is part
of a key), plan.report and plan.probe_process, which run them (in child processes of
plan.measuring_process where they must); every other module here is torch-free, even transitively.
"""
