"""``shardpool jobs``: list, show and stop the jobs started through this machine's agent.

The agent decides who sees what from the kernel-reported uid on its socket: a user sees and stops
their own jobs, root everyone's. This module only asks and prints.
"""

from __future__ import annotations

import json
import time
from typing import Any

from shardpool.agent.local_client import LocalAgentClient

__all__ = ["format_job", "format_jobs", "run_jobs_command"]

_COLUMNS = ("id", "submitter", "members", "state", "started")


def run_jobs_command(action: str | None, job_id: str | None, *, socket_path: str | None = None) -> str:
    """Carry out ``shardpool jobs [show ID | stop ID]`` and return what to print."""
    local = LocalAgentClient(socket_path) if socket_path else LocalAgentClient()
    if action is None or action == "list":
        return format_jobs(local.jobs())
    if job_id is None:
        raise ValueError(f"`shardpool jobs {action}` needs a job id")
    if action == "show":
        return format_job(local.job(job_id))
    if action == "stop":
        reply = local.stop(job_id)
        return f"stopped job {reply.get('id', job_id)}" + _stopped_on(reply)
    raise ValueError(f"unknown jobs action {action!r}; use list, show or stop")


def format_jobs(jobs: list[dict[str, Any]]) -> str:
    """A plain table of jobs, newest last, one per line (or a sentence when there are none)."""
    if not jobs:
        return "no jobs (only jobs you started through this machine's agent are listed; root sees all)"
    rows = [[_cell(job, column) for column in _COLUMNS] for job in jobs]
    widths = [max(len(column), *(len(row[index]) for row in rows)) for index, column in enumerate(_COLUMNS)]
    lines = ["  ".join(column.upper().ljust(width) for column, width in zip(_COLUMNS, widths, strict=True))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def format_job(job: dict[str, Any]) -> str:
    """Every field the agent reports about one job, one ``key: value`` line each."""
    lines = [f"{column}: {_cell(job, column)}" for column in _COLUMNS]
    for key in sorted(set(job) - set(_COLUMNS) - {"job_id"}):
        value = job[key]
        shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        lines.append(f"{key}: {shown}")
    return "\n".join(lines)


def _cell(job: dict[str, Any], column: str) -> str:
    value = job.get(column, job.get("job_id") if column == "id" else None)
    if value is None:
        return "-"
    if column == "members" and isinstance(value, list):
        return ",".join(str(member) for member in value)
    if column == "started" and isinstance(value, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return str(value)


def _stopped_on(reply: dict[str, Any]) -> str:
    members = reply.get("members")
    if isinstance(members, (list, dict)) and members:
        return " on " + ", ".join(str(member) for member in members)
    return ""
