"""Job launchers: run a job's stage processes here (:mod:`.local_launcher`) or across the mesh (:mod:`.mesh_launcher`).

Both start every rank, relay the stages' events to the caller and stop all ranks on the first
failure; a supervised mesh launcher asks its supervisor (:mod:`.supervision`), given to it at
construction. It may import shardpool.agent (its client), shardpool.plan, shardpool.files,
shardpool.contract and lower layers, never torch or shardpool.elastic (the layer above): the
launcher only starts and watches processes.
"""
