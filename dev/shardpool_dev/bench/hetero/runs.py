"""The pool benchmark's runs: every mode on one mesh, in ABBA order, under the hosts' quotas."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.cgroups import PERIOD_US, CgroupChoice, CgroupCpuSampler, HostCgroups
from shardpool_dev.bench.hetero.beside import beside_config, beside_output, beside_runs, beside_summary
from shardpool_dev.bench.hetero.lab import (
    overhead_cgroup,
    read_pid_of_agent,
    restart_agent,
    run_finetune,
    settle_scope,
    swap_profiles,
    throttle,
)
from shardpool_dev.bench.hetero.modes import (
    DEFAULT_MODES,
    FULL,
    LABELS,
    LOCAL_MODES,
    MODES,
    QUICK,
    SWAPPED,
    mode_settings,
    quota_threads,
    rebalance_setting,
    run_name,
)
from shardpool_dev.bench.hetero.report import report, say
from shardpool_dev.bench.hetero.summary import calibrated_figures, read_jsonl, summarize_run
from shardpool_dev.bench.mesh import form_mesh, wait_for_agents, write_yaml
from shardpool_dev.bench.mesh_bench import build_inputs
from shardpool_dev.bench.stats import abba_order
from shardpool_dev.bench.workload import training_config
from shardpool_dev.lab import Lab


def benchmark(
    *,
    quick: bool,
    quotas: tuple[float, ...],
    swap: bool,
    keep: Path | None,
    choice: CgroupChoice,
    scope: str = "stage",
    only: Sequence[str] = DEFAULT_MODES,
    repeats: int = 1,
    period_us: int = PERIOD_US,
    warmup_lead: int | None = None,
) -> dict[str, Any]:
    """Build the model, the throttled lab and the mesh; train the three ways (or ``only`` those)
    ``repeats`` times each in ABBA order (:func:`shardpool_dev.bench.stats.abba_order`), on the same mesh; then, with ``swap``,
    once from swapped profiles; the JSON report. ``warmup_lead`` fixes the 1F1B warm-up lead of
    every mesh run (None: the planner's choice)."""
    size = QUICK if quick else FULL
    chosen = tuple(mode for mode in MODES if mode in only)
    order = abba_order(chosen, repeats) + ([(SWAPPED, 0)] if swap else [])
    labels = LABELS[: len(quotas)]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-hetero-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    try:
        model_dir, data = build_inputs(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())
        num_layers = int(hf_config["num_hidden_layers"])
        (work / "lab").mkdir(exist_ok=True)
        runs: dict[str, list[dict[str, Any]]] = {}
        plans: dict[str, list[dict[str, Any]]] = {}
        records: dict[str, list[list[dict[str, Any]]]] = {}
        swapped = 0
        overhead = () if scope == "host" else tuple(overhead_cgroup(label, scope) for label in labels)
        host_quotas = dict(zip(labels, quotas, strict=True))
        with Lab(work / "lab") as lab, HostCgroups(choice, host_quotas, overhead, period_us) as cgroups:
            for octet, label in enumerate(labels, start=1):
                lab.add_host(label, octet)
            mesh_setup_s = form_mesh(lab, labels)
            moved = throttle(lab, cgroups, scope)
            for label in labels:  # so each agent, and what it starts, sees its cgroup's quota
                restart_agent(lab, lab.hosts[label], cgroups)
            wait_for_agents(lab, labels)
            settle_scope(lab, cgroups, scope)
            say(
                f"mesh of {len(labels)} hosts formed in {mesh_setup_s:.1f} s and throttled {dict(cgroups.quotas)}"
            )
            for mode, repeat in order:
                name = run_name(mode, repeat)
                if mode == SWAPPED:
                    swapped = swap_profiles(lab, cgroups, labels[0], labels[-1], scope)
                out = work / f"out-{name}"
                settings = mode_settings(mode, num_layers, len(labels))
                if warmup_lead is not None and settings["placement"] == "mesh":
                    settings["warmup_lead"] = warmup_lead
                config = training_config(model_dir, data, out, size, settings)
                # training_config turns re-balancing off for every benchmark; the pooled runs are
                # the ones that must re-balance, at the default.
                config = rebalance_setting(
                    config, "auto" if mode in ("pooled", "pooled_pipeline", SWAPPED) else "off"
                )
                if mode in LOCAL_MODES and scope == "stage":
                    config["shardpool"]["threads_per_stage"] = quota_threads(quotas[0])
                config_path = write_yaml(work / f"{name}.yaml", config)
                beside_configs = (
                    {
                        label: write_yaml(
                            work / f"{name}-{label}.yaml",
                            beside_config(config, beside_output(work, name, label), quota, scope),
                        )
                        for label, quota in list(host_quotas.items())[1:]
                    }
                    if mode == "all_alone"
                    else {}
                )
                run_started = time.monotonic()
                sampler = CgroupCpuSampler(
                    cgroups, {label: read_pid_of_agent(lab.hosts[label]) for label in labels}
                )
                sampler.start()
                try:
                    with beside_runs(
                        lab, cgroups, beside_configs, work, name, size["run_timeout_s"], scope
                    ) as beside:
                        run_finetune(
                            lab, cgroups, config_path, work / f"{name}.log", size["run_timeout_s"], scope
                        )
                finally:
                    cgroup_cpu_s = sampler.stop()
                plan = json.loads((out / "plan.json").read_text())
                run_records = read_jsonl(out / "metrics.jsonl")
                if mode in LOCAL_MODES:  # a local plan names the machine, not the lab host
                    for stage in plan["stages"]:
                        stage["host"] = labels[0]
                summary = summarize_run(run_records, plan, size["warmup"])
                if beside_configs:
                    summary["beside"] = {
                        label: beside_summary(beside_output(work, name, label)) for label in beside_configs
                    }
                    summary["beside_started_s"] = beside
                if mode not in LOCAL_MODES:
                    summary["after_calibration"] = calibrated_figures(plan, run_records, config_path)
                summary["run_s"] = round(time.monotonic() - run_started, 1)
                summary["cgroup_cpu_s"] = cgroup_cpu_s
                runs.setdefault(mode, []).append(summary)
                plans.setdefault(mode, []).append(plan)
                records.setdefault(mode, []).append(run_records)
                say(f"{name}: {summary['tokens_per_s']} tokens/s, run took {summary['run_s']} s")
        result = report(
            quick=quick,
            size=size,
            quotas=host_quotas,
            choice=choice,
            scope=scope,
            period_us=period_us,
            runs=runs,
            plans=plans,
            records=records,
            order=order,
            swapped=swapped if swap else None,
            moved=moved,
            hf_config=hf_config,
            mesh_setup_s=mesh_setup_s,
            seconds=time.monotonic() - started,
        )
        if warmup_lead is not None:
            result["command"] += f" --warmup-lead {warmup_lead}"
        return result
    finally:
        if keep is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
