"""shardpool.elastic: a run that changes while it trains, as one layer above the launchers.

It owns the run's state machine (:mod:`.states`), the re-balance check and its decision
(:mod:`.rebalancing`, :mod:`.rebalance_decision`), and keeping a mesh run going across lost and
joined members: the supervisor (:mod:`.supervisor`), its join checks (:mod:`.joins`), growth in
place (:mod:`.growth`), the step-boundary copies (:mod:`.copies`), the re-plan policy and its
lines (:mod:`.policy`), the stall watch (:mod:`.beats`) and the commit gate (:mod:`.commit`).

It may import ``shardpool.launch``, ``shardpool.agent``, ``shardpool.train``, ``shardpool.plan``
and the layers below them; nothing below imports it. Launchers get what they need of it as an
object passed in (:class:`shardpool.launch.supervision.Supervision`). Its modules are torch-free.
Import each name from the module that defines it: this package re-exports nothing.
"""
