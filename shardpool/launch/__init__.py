"""Job launchers: run a job's stage processes here (:mod:`.local_launcher`) or across the mesh (:mod:`.mesh_launcher`).

Both start every rank, relay the stages' events to the caller and stop all ranks on the first
failure; :mod:`.rebalancing` answers the stages' re-balance check. It may import shardpool.agent (its client), shardpool.plan, shardpool.files,
shardpool.contract and lower layers, never torch: the launcher only starts and watches processes.
"""
