"""Regeneration on an OpenAI-compatible server, against a fake one started in the test (stdlib http.server).

The fake server answers deterministically (the answer names the prompt and max_tokens), in a varying time
per prompt so that concurrent answers arrive out of order, and records every request it gets.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hydra import compose, initialize_config_dir

import fastdecode.runtime.loading
import fastdecode_cli.regenerate
from fastdecode.config import CONFIG_DIR, ConfigError, load_group
from fastdecode.data.chat import training_prompts, user_prompt_text
from fastdecode.data.config import DataConfig
from fastdecode.data.openai_client import ServerError
from fastdecode.runtime.tokenizer import byte_tokenizer
from fastdecode_cli.regenerate import run
from tests.helpers import free_port, write_chat_jsonl


class FakeServer:
    """An OpenAI-compatible server on 127.0.0.1: ``/v1/models`` lists ``model``; the first ``fail_first``
    POSTs answer 503; a POST whose user text or prompt contains ``refuse`` answers 400."""

    def __init__(self, model: str = "fake-model", fail_first: int = 0, refuse: str | None = None) -> None:
        self.model, self.fail_first, self.refuse = model, fail_first, refuse
        self.requests: list[tuple[str, dict | None]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                owner.record(self.path, None)
                if self.path != "/v1/models":
                    return self.reply(404, {"error": f"no route {self.path}"})
                self.reply(200, {"object": "list", "data": [{"id": owner.model, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*owner.respond(self.path, body))

            def reply(self, status: int, payload: dict) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def record(self, path: str, body: dict | None) -> int:
        with self.lock:
            self.requests.append((path, body))
            return sum(1 for _, b in self.requests if b is not None)

    def respond(self, path: str, body: dict) -> tuple[int, dict]:
        if self.record(path, body) <= self.fail_first:
            return 503, {"error": "loading model"}
        if body.get("model") != self.model:
            return 404, {"error": f"model {body.get('model')} not found"}
        text = body["messages"][0]["content"] if path == "/v1/chat/completions" else body["prompt"]
        if self.refuse is not None and self.refuse in text:
            return 400, {"error": "refused"}
        time.sleep(0.02 * (len(text) % 3))  # later prompts may be answered first
        answer = expected_answer(text, body["max_tokens"])
        if path == "/v1/chat/completions":
            return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
        return 200, {"choices": [{"index": 0, "text": answer}]}

    def posts(self) -> list[dict]:
        return [b for _, b in self.requests if b is not None]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def expected_answer(text: str, max_tokens: int) -> str:
    return f"{max_tokens} tokens about <{text}>"


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def _cfg(tmp_path, url, *extra, output="own.jsonl"):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=14)
    overrides = [
        "model=tiny-llama",
        "data=jsonl",
        f"data.path={data}",
        "data.held_out=4",
        "max_new_tokens=6",
        "num_prompts=9",
        f"output={tmp_path / output}",
        f"server.url={url}",
        "server.concurrency=4",
        "server.chunk=2",
        "server.retry_wait_s=0.01",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="regenerate", overrides=overrides)


def _users(tmp_path) -> list[str]:
    """The first user turns the in-process path would answer, in its order."""
    write_chat_jsonl(tmp_path / "chat.jsonl", n=14)
    data = load_group("data", "jsonl", DataConfig, path=str(tmp_path / "chat.jsonl"), held_out=4)
    return [user for user, _ in training_prompts(data, byte_tokenizer(), 9, 256)]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_chat_answers_are_written_in_the_prompts_order(tmp_path, server, monkeypatch):
    rewrites: list[
        int
    ] = []  # lines of each rewrite of the output: one per server.chunk=2 answers, then the rest
    write = fastdecode_cli.regenerate.atomic_write_text
    monkeypatch.setattr(
        fastdecode_cli.regenerate,
        "atomic_write_text",
        lambda path, text: (rewrites.append(text.count("\n")), write(path, text)),
    )
    result = run(_cfg(tmp_path, server.url))
    assert rewrites == [2, 4, 6, 8, 9]
    users = _users(tmp_path)
    assert len(users) == 9 and result == {"written": 9, "new": 9, "output": str(tmp_path / "own.jsonl")}
    assert _records(tmp_path / "own.jsonl") == [
        {"prompt": u, "response": expected_answer(u, 6)} for u in users
    ]
    posts = server.posts()
    assert sorted(p["messages"][0]["content"] for p in posts) == sorted(users)
    assert all(p["messages"] == [{"role": "user", "content": p["messages"][0]["content"]}] for p in posts)
    assert {(p["model"], p["temperature"], p["max_tokens"]) for p in posts} == {("fake-model", 0.0, 6)}
    assert server.requests[0] == ("/v1/models", None)  # the model's name was asked first


def test_completions_send_our_templated_prompt_whose_ids_are_ours(tmp_path, server):
    run(_cfg(tmp_path, server.url, "server.endpoint=completions", "server.model=fake-model"))
    tok = byte_tokenizer()
    data = load_group("data", "jsonl", DataConfig, path=str(tmp_path / "chat.jsonl"), held_out=4)
    ours = training_prompts(data, tok, 9, 256)
    sent = {p["prompt"] for p in server.posts()}
    assert sent == {user_prompt_text(tok, user) for user, _ in ours}
    assert sorted(tok(text, add_special_tokens=False).input_ids for text in sent) == sorted(
        i for _, i in ours
    )
    texts = [user_prompt_text(tok, user) for user, _ in ours]
    assert [r["response"] for r in _records(tmp_path / "own.jsonl")] == [expected_answer(t, 6) for t in texts]


def test_an_interrupted_run_resumes_after_what_is_written(tmp_path, server):
    users = _users(tmp_path)
    broken = FakeServer(refuse=users[5])  # prompts 0-4 answered, the 6th refused: the run stops there
    try:
        with pytest.raises(ServerError, match="HTTP 400"):
            run(_cfg(tmp_path, broken.url))
    finally:
        broken.close()
    written = _records(tmp_path / "own.jsonl")
    assert [r["prompt"] for r in written] == users[:5]  # every answer received before the error, in order
    more = run(_cfg(tmp_path, server.url))
    assert more["new"] == 4 and _records(tmp_path / "own.jsonl")[:5] == written
    assert sorted(p["messages"][0]["content"] for p in server.posts()) == sorted(users[5:])  # no prompt twice
    run(_cfg(tmp_path, server.url, output="fresh.jsonl"))
    assert (tmp_path / "own.jsonl").read_text() == (tmp_path / "fresh.jsonl").read_text()


def test_a_503_is_retried(tmp_path):
    flaky = FakeServer(fail_first=3)
    try:
        run(_cfg(tmp_path, flaky.url, "server.concurrency=1"))
        assert len(flaky.posts()) == 9 + 3
        assert len(_records(tmp_path / "own.jsonl")) == 9
    finally:
        flaky.close()
    down = FakeServer(fail_first=100)
    try:
        with pytest.raises(ServerError, match=r"HTTP 503.* after 2 tries") as err:
            run(_cfg(tmp_path, down.url, "server.retries=1", output="down.jsonl"))
        assert down.url in str(err.value)
        assert not (tmp_path / "down.jsonl").exists()
    finally:
        down.close()


@pytest.fixture
def no_tokenizer(monkeypatch):
    """The server is checked before the tokenizer (and the prompts) load."""

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer loaded before the server was checked")

    monkeypatch.setattr(fastdecode.runtime.loading, "load_tokenizer", refuse)


def test_an_unreachable_url_is_named_before_any_work(tmp_path, no_tokenizer):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(ServerError, match="cannot be reached") as err:
        run(_cfg(tmp_path, url, "server.retries=1"))
    assert f"{url}/models" in str(err.value) and "server.url" in str(err.value)
    assert not (tmp_path / "own.jsonl").exists()
    with pytest.raises(ConfigError, match="http"):
        run(_cfg(tmp_path, "localhost:8000/v1"))


def test_a_url_without_v1_is_refused_with_a_hint(tmp_path, server, no_tokenizer):
    with pytest.raises(ServerError, match=r"HTTP 404.*end with /v1"):
        run(_cfg(tmp_path, server.url.removesuffix("/v1")))
    assert server.posts() == []


def test_a_model_the_server_does_not_serve_is_refused_before_any_prompt(tmp_path, server, no_tokenizer):
    with pytest.raises(ServerError, match="'fake-model'") as err:
        run(_cfg(tmp_path, server.url, "server.model=smollm2"))
    assert "'smollm2'" in str(err.value) and server.url in str(err.value)
    assert server.requests == [("/v1/models", None)] and not (tmp_path / "own.jsonl").exists()
