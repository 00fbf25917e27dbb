"""``shardpool serve`` against the official ``openai`` client: a real server on a real engine over a
tiny model. Completions and chat, whole and streamed (the streamed text joined is the whole text),
stop strings, usage, the API key, bad requests in one line, the body cap, the queue bound, a client
that goes away, a failed engine, two stages with a trained adapter, and the command itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from shardpool.data.tokenizing import load_tokenizer
from shardpool.infer.engine import PipelineEngine
from shardpool.infer.server import OpenAIServer
from tests.helpers.serving import chat_model, start_engine, start_server

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
PROMPTS = ["The quick brown", "Pipeline stages pass", "One, two, three,", "Red, green, blue"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    return chat_model(tmp_path_factory.mktemp("serve"), tiny_model)


@pytest.fixture(scope="module")
def engine(chat_model_dir: Path) -> Iterator[PipelineEngine]:
    with start_engine(chat_model_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: PipelineEngine) -> Iterator[OpenAIServer]:
    server = start_server(engine, api_key=KEY, max_concurrent=4, max_queued=4)
    yield server
    server.stop()


def _client(server: OpenAIServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, prompt: str, **options: Any) -> Any:
    return client.completions.create(model="tiny-chat", prompt=prompt, temperature=0, **options)


def _complete_once_a_slot_is_free(client: openai.OpenAI, prompt: str, **options: Any) -> Any:
    """A completion, asked again while the server answers 429 (at most 10 s: a freed slot comes sooner)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _complete(client, prompt, **options)
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_models_lists_the_served_model(server: OpenAIServer) -> None:
    models = _client(server).models.list().data
    assert [(model.id, model.object, model.owned_by) for model in models] == [
        ("tiny-chat", "model", "shardpool")
    ]


def test_a_greedy_completion_streamed_joins_to_the_whole_one(server: OpenAIServer) -> None:
    client = _client(server)
    whole = _complete(client, PROMPTS[0], max_tokens=24)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.created > 0
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens == len(
        load_tokenizer(server.engine.target.tokenizer_dir)(PROMPTS[0])["input_ids"]
    )
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(
        _complete(client, PROMPTS[0], max_tokens=24, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text and len(text) > 10
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_the_default_max_tokens_of_a_completion_is_16(server: OpenAIServer) -> None:
    assert _complete(_client(server), PROMPTS[1]).usage.completion_tokens == 16


def test_a_greedy_chat_streamed_joins_to_the_whole_one(server: OpenAIServer) -> None:
    client = _client(server)
    whole = client.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=0, max_tokens=20)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    tokenizer = load_tokenizer(server.engine.target.tokenizer_dir)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(
        client.chat.completions.create(
            model="tiny-chat", messages=CHAT, temperature=0, max_tokens=20, stream=True
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_content_parts_are_text(server: OpenAIServer) -> None:
    client = _client(server)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    plain = [{"role": "user", "content": "Say hello."}]
    answers = [
        client.chat.completions.create(model="tiny-chat", messages=messages, temperature=0, max_tokens=8)
        for messages in (parts, plain)
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_a_stop_string_cuts_the_text_and_ends_with_stop(server: OpenAIServer) -> None:
    client = _client(server)
    text = _complete(client, PROMPTS[2], max_tokens=40).choices[0].text
    stop = text[8:11]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                _complete(client, PROMPTS[2], max_tokens=40, stop=[stop, "never-seen"], stream=True)
            )
            got = "".join(chunk.choices[0].text for chunk in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            answer = _complete(client, PROMPTS[2], max_tokens=40, stop=stop)
            got, reason = answer.choices[0].text, answer.choices[0].finish_reason
            assert answer.usage.completion_tokens < 40
        assert (got, reason) == (expected, "stop")


def test_concurrent_requests_each_equal_their_result_alone(server: OpenAIServer) -> None:
    client = _client(server)
    alone = [_complete(client, prompt, max_tokens=32).choices[0].text for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(
            pool.map(lambda prompt: _complete(client, prompt, max_tokens=32).choices[0].text, PROMPTS)
        )
    assert together == alone


def test_the_api_key_is_required(server: OpenAIServer) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(server, "wrong-key").models.list()
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert reply.status_code == 401 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert _client(server).models.list().data  # the right key: 200


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompt": ["a", "b"]}, "`prompt` must be a string"),
        ({"prompt": [1, 2, 3]}, "`prompt` must be a string"),
        ({"prompt": "x", "n": 2}, "only n=1"),
        ({"prompt": "x", "temperature": 3}, "`temperature` must be a number from 0 to 2"),
        ({"prompt": "x", "max_tokens": 0}, "`max_tokens` must be an integer of at least 1"),
        ({"prompt": "x", "max_tokens": 5000}, "exceeds the context of 1024 tokens"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"prompt": "x", "logprobs": 2}, "`logprobs` is not supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role must be one of system, user, assistant"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content must be a string"),
    ],
)
def test_bad_requests_are_answered_400_in_one_line(
    server: OpenAIServer, options: dict[str, Any], message: str
) -> None:
    path = "chat/completions" if "messages" in options else "completions"
    reply = httpx.post(
        f"{server.url}/v1/{path}",
        json={"model": "tiny-chat", **options},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_400(server: OpenAIServer) -> None:
    reply = httpx.post(
        f"{server.url}/v1/completions", content=b"{", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert reply.status_code == 400 and "not JSON" in reply.json()["error"]["message"]


def test_n_above_one_is_refused_by_the_client_call(server: OpenAIServer) -> None:
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        _complete(_client(server), "x", n=2)


def test_an_unknown_model_is_404(server: OpenAIServer) -> None:
    with pytest.raises(openai.NotFoundError, match="`gpt-4o` does not exist"):
        _client(server).completions.create(model="gpt-4o", prompt="x")


def test_a_body_over_the_cap_is_413(server: OpenAIServer) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        _complete(_client(server), "x" * (1 << 20))
    assert refused.value.status_code == 413


def test_requests_beyond_the_queue_get_429_and_a_client_that_leaves_frees_its_slot(
    engine: PipelineEngine,
) -> None:
    with start_server(engine, max_concurrent=1, max_queued=0) as server:
        client = _client(server)
        started = time.monotonic()
        with client.completions.with_streaming_response.create(
            model="tiny-chat", prompt=PROMPTS[0], temperature=0, max_tokens=1000, stream=True
        ) as streaming:
            next(streaming.iter_lines())  # the first chunk: the request holds the only slot
            with pytest.raises(openai.RateLimitError) as refused:
                _complete(client, PROMPTS[1], max_tokens=4)
            assert refused.value.response.headers["Retry-After"] == "1"
        # The stream was closed after one chunk: its generation is cancelled, not run to 1000 tokens.
        answer = _complete_once_a_slot_is_free(client, PROMPTS[1], max_tokens=4)
        assert answer.usage.completion_tokens == 4
        assert time.monotonic() - started < 5  # 1000 tokens take over 10 s on this model


def test_a_client_that_stops_waiting_for_a_whole_reply_frees_its_slot(engine: PipelineEngine) -> None:
    with start_server(engine, max_concurrent=1, max_queued=0) as server:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            body = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        answer = _complete_once_a_slot_is_free(_client(server), PROMPTS[1], max_tokens=4)
        assert answer.usage.completion_tokens == 4
        assert time.monotonic() - started < 5  # 1000 tokens take over 10 s on this model


def test_the_serve_command_answers_and_stops_on_sigterm(chat_model_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "shardpool",
        "serve",
        str(chat_model_dir),
        "--port",
        "0",
        "--api-key",
        KEY,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(process, timeout=120)
        assert line.startswith("serving tiny-chat on http://127.0.0.1:") and line.endswith("/v1 (1 stage)"), (
            line
        )
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        assert (
            client.completions.create(model="tiny-chat", prompt="x", max_tokens=3).usage.completion_tokens
            == 3
        )
        children = psutil.Process(process.pid).children(recursive=True)
        assert children  # the stage process
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read() if process.stderr else ""
        assert not [
            child for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        ]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.append(process.stdout.readline() if process.stdout else "")
    )
    reader.daemon = True
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0]:
        process.kill()
        raise AssertionError(f"no ready line; stderr: {process.stderr.read() if process.stderr else ''}")
    return lines[0].strip()
