"""Plan a run described by a shardpool config: ``shardpool plan`` and ``shardpool finetune`` start here.

The config becomes a typed :class:`~shardpool.plan.costmodel.Workload` and a model shape (from
``config.json`` alone, no weights); the devices are either a fleet file's or this machine's
configured ``shardpool.devices``, measured through a :class:`~shardpool.plan.local_fleet.DeviceProbe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shardpool.config import Config, load_config, parse_config
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Fleet
from shardpool.plan.local_fleet import DeviceProbe, local_fleet
from shardpool.plan.planner import evaluate_split, plan_pipeline
from shardpool.plan.result import Plan

__all__ = ["load_config_with_overrides", "plan_for_config"]


def plan_for_config(
    config: Config,
    *,
    fleet: Fleet | None = None,
    probe: DeviceProbe | None = None,
    model_path: str | None = None,
) -> Plan:
    """Plan a loaded config: on ``fleet`` if given, else on its local ``shardpool.devices`` measured by ``probe``.

    Only ``config.json`` of the base model (or ``model_path``) is read. With a hypothetical
    fleet, the config's ``shardpool.stages``, ``devices`` and ``layers`` describe a local run and are not
    applied, nor is a per-stage ``shardpool.nf4_backend`` list (``auto`` instead; one setting
    applies). On a local run each entry of such a list goes with its entry of ``shardpool.devices``
    (:func:`~shardpool.plan.local_fleet.local_fleet` chooses each slot's backend). With
    ``shardpool.layers`` on a local run, that manual split is predicted as given.
    """
    shape = ModelShape.from_config_dir(model_path or config.base_model)
    workload = Workload.from_config(config)
    one_setting = "auto" if isinstance(workload.nf4_backend, tuple) else workload.nf4_backend
    if fleet is not None:
        return plan_pipeline(
            shape, replace(workload, stages=None, layers=None, nf4_backend=one_setting), fleet
        )
    if probe is None:
        raise ShardpoolError("planning this machine's devices needs a probe to measure them; pass probe=")
    section = config.shardpool
    local = local_fleet(
        section.stage_devices(),
        shape=shape,
        workload=workload,
        probe=probe,
        threads_per_stage=section.threads_per_stage,
    )
    workload = replace(workload, nf4_backend=one_setting)  # each slot carries its own choice now
    if section.layers:
        return evaluate_split(
            shape, workload, local, devices=[d.name for d in local.devices], layers=section.layers
        )
    return plan_pipeline(shape, workload, local)


def load_config_with_overrides(
    path: str, overrides: Sequence[str] = (), *, model_path: str | None = None
) -> Config:
    """Load and validate a config after applying ``KEY=VALUE`` overrides (values parsed as YAML).

    Dotted keys reach into sections (``shardpool.schedule=gpipe``). Lets ``shardpool plan``
    try other batch shapes without editing the file. ``model_path`` is the model planned instead
    of base_model (``--model``), which ``sequence_len`` is checked against.
    """
    import yaml

    if not overrides:
        return load_config(path, model_config=model_path)
    load_config(
        path, model_config=model_path
    )  # same errors as without overrides for a missing or broken file
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ShardpoolError(f"--set {item!r} is not KEY=VALUE; write e.g. --set sequence_len=2048")
        target = raw
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ShardpoolError(f"--set {item!r}: {part} is not a section; set a key inside a section")
        target[leaf] = yaml.safe_load(value)
    return parse_config(raw, source=f"{path} with --set", model_config=model_path)
