"""Generation on the stages that trained the model: the pipelined engine, its stage processes,
sampling, streaming text, and the OpenAI-compatible server.

The engine (:mod:`shardpool.infer.engine`) hosts the rendezvous, starts one process per stage
(:mod:`shardpool.infer.stage_process`) and joins their gloo world as the last rank, the driver.
Requests go round a ring: driver → stage 0 → … → last stage → driver, each stage keeping a KV
cache per sequence for the layers it owns (:meth:`shardpool.model.stage.PipelineStage.forward_cached`).

May import: launch, train, model, data, config, contract, errors (and elastic's sealed store);
never agent internals or the CLI.
"""
