"""The long-lived worker processes of the llama.cpp comparison (``bench/llamacpp.py``), one per side.

``python -m fastdecode.bench.llamacpp_worker SPEC_JSON`` loads one side (llama.cpp on the GGUF, or fastdecode),
says ``ready``, then answers JSON lines on stdin: ``generate`` (one greedy answer of the given token ids, timed),
``stats`` (peak RSS), ``quit``. Replies go to the original stdout; anything else printed (llama.cpp's C logs too)
goes to stderr. Imports only the standard library at the top: llama.cpp's worker never loads torch, and
llama-cpp-python (the ``llamacpp`` extra) is imported inside the worker that runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from fastdecode.errors import UserError

LLAMA = "llama.cpp"
FASTDECODE = "fastdecode"
BUILD = (  # pyproject.toml's llamacpp extra: -march=native turns AMX on where the CPU has it (llama.cpp #20824)
    "A='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS=\"-DGGML_NATIVE=ON "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF '-DCMAKE_C_FLAGS=$A' '-DCMAKE_CXX_FLAGS=$A'\" "
    "pip install --no-binary llama-cpp-python 'fastdecode[llamacpp]'"
)


class LlamaCppMissingError(UserError):
    """llama-cpp-python, the ``llamacpp`` extra, is not installed (or its library does not load)."""


class WorkerError(UserError):
    """A worker refused a request with a user error (its message names the fix)."""


def llama_cpp_available() -> bool:
    """Whether ``llama_cpp`` can be found (not imported: the driver never loads it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def missing_llama_cpp(reason: str = "it is not installed") -> LlamaCppMissingError:
    return LlamaCppMissingError(
        f"the llama.cpp comparison needs llama-cpp-python (the 'llamacpp' extra), but {reason}. Build it from "
        f"source, CPU only, with AMX off: {BUILD}"
    )


def require_llama_cpp() -> Any:
    """The ``llama_cpp`` module, imported now; a missing or unloadable one is refused by name."""
    try:
        import llama_cpp
    except ImportError as err:
        raise missing_llama_cpp(f"importing it failed ({err})") from err
    return llama_cpp


def peak_rss_bytes() -> int:
    """This process' peak resident set: ``VmHWM`` of ``/proc/self/status``. ``ru_maxrss`` is not used where
    that exists: across ``exec`` Linux keeps the parent's peak in it (a worker would report the driver's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def answer(tokens: list[int], start: float, stamps: list[float], firsts: int, end: float) -> dict:
    """One timed answer: ``ttft_s`` (prefill and first token), ``decode_s`` (first token to last), the
    ``decode_tokens`` between them (those after the ``firsts`` tokens emitted with the first), ``total_s``."""
    return {
        "tokens": tokens,
        "ttft_s": stamps[0] - start if stamps else end - start,
        "decode_s": stamps[-1] - stamps[0] if stamps else 0.0,
        "decode_tokens": max(len(tokens) - firsts, 0),
        "total_s": end - start,
    }


class LlamaSide:
    """llama.cpp on the GGUF: greedy, ``n_threads`` = ``n_threads_batch`` = the spec's threads, no draft model
    (no prompt lookup), each prompt prefilled whole (``reset``: no prefix of an earlier prompt reused)."""

    def __init__(self, spec: dict) -> None:
        llama_cpp = require_llama_cpp()
        threads = spec["threads"]
        self.llm = llama_cpp.Llama(
            model_path=spec["gguf"],
            n_ctx=spec["n_ctx"],
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            seed=spec.get("seed", 0),
            draft_model=None,
            verbose=False,
        )
        info = llama_cpp.llama_print_system_info()
        self.info = {
            "version": llama_cpp.__version__,
            "system_info": info.decode() if isinstance(info, bytes) else str(info),
            "n_ctx": self.llm.n_ctx(),
        }

    def generate(self, ids: list[int], max_new_tokens: int, stop: Iterable[int], **_: Any) -> dict:
        stop, tokens, stamps = set(stop), [], []
        self.llm.reset()
        start = time.perf_counter()
        greedy = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        for token in self.llm.generate(ids, reset=True, **greedy):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if token in stop or len(tokens) >= max_new_tokens:
                break
        return answer(tokens, start, stamps, 1, time.perf_counter())


class Stamps:
    """An HF-style streamer that times what ``FastDecoder.generate`` emits (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen, self.stamps, self.counts = False, [], []

    def put(self, ids: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())
        self.counts.append(int(ids.numel()))

    def end(self) -> None:
        pass


class FastdecodeSide:
    """fastdecode through its public API: ``from_pretrained(model)`` at ``torch.set_num_threads(threads)``,
    ``generate(ids, max_new_tokens=, method=, **options)``, the options passed through unchanged."""

    def __init__(self, spec: dict) -> None:
        import torch

        torch.set_num_threads(spec["threads"])
        import fastdecode
        from fastdecode.tokens import eos_ids

        self.fd = fastdecode.from_pretrained(spec["model"])
        self.info = {
            "version": fastdecode.__version__,
            "torch": torch.__version__,
            "eos": sorted(eos_ids(self.fd.m.hf, self.fd.tokenizer)),
        }

    def generate(self, ids: list[int], max_new_tokens: int, method: str, options: dict, **_: Any) -> dict:
        streamer = Stamps()
        start = time.perf_counter()
        out = self.fd.generate(
            ids, max_new_tokens=max_new_tokens, method=method, streamer=streamer, **options
        )
        end = time.perf_counter()
        firsts = streamer.counts[0] if streamer.counts else 0
        return answer(list(out.ids[0]), start, streamer.stamps, firsts, end) | {"ran": out.ran}


def reply(stream: IO[str], **message: Any) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def failure(err: BaseException) -> dict:
    """An exception as a reply: its message, whether it is a user error, the traceback of any other."""
    user = isinstance(err, UserError)
    return {"error": f"{type(err).__name__}: {err}" if not user else str(err), "user_error": user} | (
        {} if user else {"traceback": traceback.format_exc()}
    )


def serve(side: Any, requests: IO[str], replies: IO[str]) -> None:
    """Answer ``requests`` (JSON lines) until ``quit`` or end of input."""
    for line in requests:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            reply(replies, ok=True)
            return
        try:
            if op == "generate":
                reply(replies, ok=True, **side.generate(**request))
            elif op == "stats":
                reply(replies, ok=True, peak_rss=peak_rss_bytes())
            else:
                reply(replies, ok=False, error=f"unknown op {op!r}", user_error=False)
        except Exception as err:  # the driver raises it; the worker stays up for its quit
            reply(replies, ok=False, **failure(err))


def main(argv: list[str] | None = None) -> None:
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol keeps the original stdout ...
    os.dup2(2, 1)  # ... and every other write to fd 1 (C libraries' logs) goes to stderr
    sys.stdout = sys.stderr
    start = time.perf_counter()
    try:
        side = LlamaSide(spec) if spec["side"] == LLAMA else FastdecodeSide(spec)
    except Exception as err:
        reply(replies, ok=False, **failure(err))
        return
    info = side.info | {"load_s": time.perf_counter() - start, "peak_rss": peak_rss_bytes()}
    reply(replies, ok=True, ready=info)
    serve(side, sys.stdin, replies)


class Worker:
    """The driver's end: a worker process started with ``spec`` (its environment with ``OMP_NUM_THREADS`` set
    to its threads), ``request(op, **fields)`` -> the reply; a refusal raises."""

    def __init__(self, spec: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        root = str(Path(__file__).resolve().parents[2])  # the fastdecode package, importable by the worker
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "fastdecode.bench.llamacpp_worker", json.dumps(spec)]
        self.name = spec["side"]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.ready = self.read()["ready"]

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(
                f"the {self.name} worker exited (code {code}) without a reply; see its stderr above"
            )
        message = json.loads(line)
        if not message.get("ok"):
            if message.get("user_error"):
                raise WorkerError(f"{self.name} worker: {message['error']}")
            raise RuntimeError(f"{self.name} worker: {message['error']}\n{message.get('traceback', '')}")
        return message

    def request(self, op: str, **fields: Any) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.request("quit")
            except (OSError, RuntimeError):
                pass
        self.process.wait(timeout=60)


if __name__ == "__main__":
    main()
