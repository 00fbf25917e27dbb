"""The job contract: the closed, capped pydantic schema of what crosses between launcher, agent and stage.

It owns the job (:mod:`.job`), the agent's start request (:mod:`.start`), the stage events
(:mod:`.events`), their field types (:mod:`.fields`), the name/path/digest checks (:mod:`.names`)
the pipeline schedules' action orders (:mod:`.schedule`), which the stages run and the planner
simulates, and the re-balance protocol between launcher and stages (:mod:`.rebalance`).
It may import only pydantic, the standard library, shardpool.config, shardpool.errors and mesh: never
torch or the HTTP stack, so the agent and the launchers validate a job without loading a model.
"""
