"""A client for an OpenAI-compatible completion server: regenerating answers on an existing serving engine.

``OpenAIClient`` sends prompts to any server that speaks the OpenAI HTTP API, ``concurrency`` requests in
flight, greedy, each retried on transient errors, and hands the answers back in the prompts' order. ``check``
asks ``/models`` once before any prompt is sent. Standard library only. Endpoints and retries:
docs/design/data.md.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastdecode.config import ConfigError
from fastdecode.errors import UserError

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)  # the server is busy, starting or restarting: try again


@dataclasses.dataclass
class ServerConfig:
    """``server.*`` of ``configs/regenerate.yaml``; ``url`` None decodes in-process."""

    url: str | None = None  # http://host:port/v1
    model: str | None = None  # the served model's name; None: the one /models lists
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: int = 8  # requests in flight
    timeout_s: float = 600.0  # per request
    retries: int = 3  # tries after the first, per request
    retry_wait_s: float = 2.0  # wait before the first retry, doubled before each next one
    chunk: int = 64  # answers received between two (atomic, whole-file) rewrites of the output
    api_key_env: str | None = None  # environment variable holding a bearer token, for servers that want one

    def checked(self) -> ServerConfig:
        """``self`` with ``url`` stripped of a trailing ``/``; bad values refused naming the key."""
        url = (self.url or "").rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"server.url={self.url!r} is not an http(s) URL: give http://HOST:PORT/v1.")
        if self.concurrency < 1 or self.chunk < 1 or self.retries < 0 or self.timeout_s <= 0:
            raise ConfigError(
                "server.concurrency and server.chunk must be >= 1, server.retries >= 0, server.timeout_s > 0."
            )
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ConfigError(
                f"server.api_key_env={self.api_key_env}, but that environment variable is "
                "empty: export it, or set server.api_key_env=null."
            )
        return dataclasses.replace(self, url=url)


class ServerError(UserError):
    """The server cannot be reached, refuses a request, or answers something that is not an answer."""


class OpenAIClient:
    """Greedy answers from the OpenAI-compatible server ``cfg.url`` (``/models``, ``/chat/completions``,
    ``/completions``); thread-safe (each request is its own connection)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg.checked()
        self.url: str = self.cfg.url  # type: ignore[assignment]
        self.model = cfg.model

    def _request(self, path: str, body: dict | None = None) -> dict:
        """GET (``body`` None) or POST ``body`` as JSON to ``url + path``, with the retries; the parsed reply."""
        url = self.url + path
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ[self.cfg.api_key_env]}"
        data = None if body is None else json.dumps(body).encode()
        wait, problem = self.cfg.retry_wait_s, ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(wait)
                wait *= 2
            try:
                req = urllib.request.Request(url, data=data, headers=headers)
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                    return _parse(resp.read(), url)
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode("utf-8", "replace")
                if err.code not in RETRY_STATUSES:
                    raise ServerError(
                        f"{url} answered HTTP {err.code}: {detail}{_hint(err.code, path)}"
                    ) from err
                problem = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                problem = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        raise ServerError(
            f"{url} cannot be reached or keeps failing ({problem}) after {self.cfg.retries + 1} tries: start "
            "the server (e.g. `vllm serve MODEL`, `python -m llama_cpp.server --model FILE.gguf`) or fix "
            "server.url (http://HOST:PORT/v1); server.retries and server.timeout_s set the patience."
        )

    def check(self) -> str:
        """Ask ``/models`` once: the served model to use (``cfg.model``, which must be listed; else the only
        one listed). Called before any prompt is sent."""
        listed = [m.get("id") for m in self._request("/models").get("data", []) if isinstance(m, dict)]
        if self.cfg.model is not None:
            if self.cfg.model not in listed:
                raise ServerError(
                    f"{self.url} does not serve a model named {self.cfg.model!r}; it serves "
                    f"{', '.join(map(repr, listed)) or 'none'}: set server.model to one of them."
                )
            self.model = self.cfg.model
        elif len(listed) == 1:
            self.model = listed[0]
        else:
            raise ServerError(
                f"{self.url} serves {len(listed)} models ({', '.join(map(repr, listed))}): choose one with "
                "server.model=NAME."
            )
        return self.model

    def answer(self, user: str, prompt_text: str, max_tokens: int) -> str:
        """The greedy answer to ``user`` (endpoint ``chat``) or the continuation of ``prompt_text``, our
        chat-templated prompt (``completions``), of at most ``max_tokens`` tokens."""
        body: dict[str, Any] = {"model": self.model, "temperature": 0.0, "max_tokens": max_tokens}
        if self.cfg.endpoint == "chat":
            reply = self._request(
                "/chat/completions", {**body, "messages": [{"role": "user", "content": user}]}
            )
        else:
            reply = self._request("/completions", {**body, "prompt": prompt_text})
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if self.cfg.endpoint == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as err:
            raise ServerError(f"{self.url}: the reply holds no answer ({str(reply)[:300]})") from err
        return text or ""

    def answers(self, prompts: Iterable[tuple[str, str]], max_tokens: int) -> Iterator[str]:
        """``answer(user, text, max_tokens)`` for each ``(user, text)``, yielded in the prompts' order while
        ``concurrency`` requests are in flight (a window of 4x that many ahead of the oldest unanswered)."""
        window = 4 * self.cfg.concurrency
        pending: collections.deque = collections.deque()
        with ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="regenerate") as pool:
            try:
                for user, text in prompts:
                    pending.append(pool.submit(self.answer, user, text, max_tokens))
                    if len(pending) >= window:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:  # an error or a closed generator: what has not started never starts
                    future.cancel()


def _parse(raw: bytes, url: str) -> dict:
    try:
        reply = json.loads(raw)
    except ValueError as err:
        raise ServerError(f"{url} answered something that is not JSON: {raw[:200]!r}") from err
    if not isinstance(reply, dict):
        raise ServerError(f"{url} answered JSON that is not an object: {raw[:200]!r}")
    return reply


def _hint(status: int, path: str) -> str:
    if status == 404 and path == "/models":
        return " (does server.url end with /v1?)"
    if status in (401, 403):
        return " (the server wants an API key: set server.api_key_env to the variable that holds it)"
    return ""
