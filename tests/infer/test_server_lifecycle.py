"""``shardpool serve`` with engines of their own (one per test: the driver's process group is
global): two stages serving a trained adapter, and an engine whose stage dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.helpers.serving import chat_model, start_engine, start_server
from tests.helpers.shared_runs import trained_once

pytestmark = pytest.mark.slow

PROMPT = "The quick brown"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_two_stages_serve_a_trained_adapter(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, completion_data: Path
) -> None:
    output = trained_once(tmp_path_factory, tiny_model, completion_data)
    with start_engine(output, stages=2) as engine, start_server(engine) as server:
        client = _client(server.url)
        assert [model.id for model in client.models.list().data] == [output.name]
        whole = client.completions.create(model=output.name, prompt=PROMPT, temperature=0, max_tokens=16)
        assert whole.usage.completion_tokens == 16
        chunks = client.completions.create(
            model=output.name, prompt=PROMPT, temperature=0, max_tokens=16, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text


def test_a_stage_lost_while_serving_fails_its_requests_then_the_server_serves_again(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A stage killed while serving: generations answer 503 with its line while the ring starts
    again on the same places, then the server serves again, with the same greedy text as before."""
    with start_engine(chat_model(tmp_path, tiny_model), slots=1, restart=True) as engine, start_server(engine) as server:
        client = _client(server.url)
        before = client.completions.create(model="tiny-chat", prompt=PROMPT, temperature=0, max_tokens=8)
        os.kill(engine.ring.processes[0].pid, signal.SIGKILL)  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while engine.failure is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as failed:
                _client(server.url).completions.create(
                    model="tiny-chat", prompt="x", max_tokens=4, stream=stream
                )
            assert failed.value.status_code == 503
            assert "stage 0 failed: killed by signal 9" in failed.value.body["message"]
        deadline = time.monotonic() + 180
        while engine.failure is not None:
            assert time.monotonic() < deadline, "the ring did not start again"
            time.sleep(0.5)
        after = client.completions.create(model="tiny-chat", prompt=PROMPT, temperature=0, max_tokens=8)
        assert engine.restarts == 1
        assert after.choices[0].text == before.choices[0].text
