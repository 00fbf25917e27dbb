"""shardpool.train: the stage processes that train one model across pipeline stages and replicas.

It owns one stage process from start to end (:mod:`.worker`: set-up, the step loop, events to the
launcher; what a rank does when its run changes is ``shardpool.elastic.rank``, above it), its part of a pipelined step (:mod:`.pipeline`, with the schedules in :mod:`.schedule`),
the loss and the per-step reductions across ranks (:mod:`.loss`), the optimizer and LR schedule
(:mod:`.optim`), evaluation (:mod:`.evaluate`),
its training state and share of checkpoints (:mod:`.stage_state`), what every rank reports of a
step (:mod:`.step_report`), the checkpoint files and their
finalizing on the launcher (:mod:`.checkpoint`), the process groups and the wire between stages
(:mod:`.process_group`, :mod:`.transport`), the files a stage reads and writes on the launcher
(:mod:`.runfiles`), and the rendezvous store the launcher hosts (:mod:`.rendezvous`).

It may import torch, torch.distributed, transformers and peft, and from shardpool the layers below
it: ``shardpool.files``, ``shardpool.model``, ``shardpool.data``, ``shardpool.contract``,
``shardpool.config``, ``shardpool.errors`` and ``mesh``; never ``shardpool.plan`` or anything above.
Import each name from the module that defines it: this package re-exports nothing.
"""
