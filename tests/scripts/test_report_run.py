"""shardpool_dev.bench.child.run_and_report: a benchmark's report alone on stdout, one line for an error, 130 when stopped."""

from __future__ import annotations

import json
import os
import signal

import pytest
from shardpool_dev.bench.child import run_and_report


class LabBroke(Exception):
    pass


def test_the_report_is_all_that_goes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    def measure() -> dict[str, int]:
        print("progress line")
        return {"tokens_per_s": 300}

    assert run_and_report("bench_x", measure, errors=(LabBroke,), cleaned="the lab was removed") == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"tokens_per_s": 300}
    assert "progress line" in err


def test_a_known_error_is_one_line_and_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    def measure() -> dict[str, int]:
        raise LabBroke("host b lost its veth")

    assert run_and_report("bench_x", measure, errors=(LabBroke,), cleaned="the lab was removed") == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "bench_x: error: host b lost its veth\n"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_runs_the_clean_up_and_gives_130(
    stop: signal.Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    cleaned: list[str] = []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def measure() -> dict[str, int]:
        try:
            os.kill(os.getpid(), stop)
            signal.sigtimedwait([], 1.0)  # the handler raises before this returns
            return {"finished": 1}
        finally:
            cleaned.append("lab")

    assert run_and_report("bench_x", measure, errors=(LabBroke,), cleaned="the lab was removed") == 130
    out, err = capsys.readouterr()
    assert cleaned == ["lab"] and out == ""
    assert err == "bench_x: interrupted; the lab was removed\n"
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "handlers put back"
