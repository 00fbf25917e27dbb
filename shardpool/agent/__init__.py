"""The agent that runs on every member (:mod:`.service`), its clients, and who may use it.

It owns the mesh listener's signed routes (:mod:`.mesh_routes`), the local Unix socket for people
on this member (:mod:`.local`), the job table and stage processes run as the unprivileged run-as
account (:mod:`.job_table`, :mod:`.jobs`, :mod:`.processes`, :mod:`.confine`, :mod:`.accounts`),
device profiling in a child process (:mod:`.profiling`), and the clients (:mod:`.client`,
:mod:`.local_client`). It may import mesh, shardpool.plan's torch-free modules, shardpool.contract
and lower layers; never torch, shardpool.train or shardpool.launch.
"""
