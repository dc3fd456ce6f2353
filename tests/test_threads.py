"""Threads sharing a model (docs/RELIABILITY.md): threads calling ``generate`` on one ``FastDecoder`` get what
each call gets alone, whatever engine options each asks for: calls on a model take turns
(``EarlyExitModel.lock``, held by the whole call), and a suffix index shared by threads locks its reads too,
which expand nodes and memoise rankings (``SuffixIndex.lock``). The global index is bounded in tokens as
well as in outputs, and its eviction drops the memos that would keep removed nodes alive."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import fastdecode
from fastdecode.config import ConfigError
from fastdecode.drafters.suffix.index import SuffixIndex, SuffixNode
from fastdecode.drafters.suffix.options import SuffixOptions
from fastdecode.drafters.suffix.sources import global_index, remember, reset_global_index
from fastdecode.runtime.model import EarlyExitModel
from tests.eagle3_heads import random_head_dir

METHODS = ("auto", "suffix", "eagle3")
THREADS, CALLS, NEW = 4, 8, 12  # threads, calls of each method per thread, new tokens per call
HF_MODULES = {"fast_layers": False, "fast_linear": False}  # no engine: the HF modules (the CPU default: lean)


@pytest.fixture(scope="module")
def fd(tmp_path_factory):
    """The tiny model with a random EAGLE-3 head (its drafts are rarely accepted: lossless all the same)."""
    return fastdecode.from_pretrained("tiny-llama", drafter=random_head_dir(tmp_path_factory.mktemp("head")))


@pytest.fixture(autouse=True)
def empty_global_index():
    reset_global_index()
    yield
    reset_global_index()


def prompts_of(count: int, seed: int) -> list[list[int]]:
    """``count`` different prompts of one length (so the engine's kernels are calibrated for few widths):
    five random tokens said twice, which prompt lookup and suffix decoding draft from."""
    gen = torch.Generator().manual_seed(seed)
    return [half + half for half in torch.randint(5, 261, (count, 5), generator=gen).tolist()]


def in_threads(work, count: int) -> dict[int, object]:
    """``work(thread)`` in ``count`` threads started together (switching often): {thread: its result}; a
    thread's exception is raised here."""
    results: dict[int, object] = {}
    start = threading.Barrier(count)

    def run(thread: int) -> None:
        start.wait()
        try:
            results[thread] = work(thread)
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            results[thread] = err

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    for found in results.values():
        if isinstance(found, BaseException):
            raise found
    return results


def test_threads_calling_generate_get_what_each_call_gets_alone(fd):
    """4 threads x 8 calls of each of ``auto``, ``suffix`` and ``eagle3`` on one decoder, a different prompt
    per call: each output is the one the same call made alone gets (the calls made one after another first,
    from an empty global index, as the threads start from), which is autoregressive decoding's (greedy is
    lossless, so suffix decoding's global index changes only what is drafted)."""
    prompts = prompts_of(THREADS * CALLS * len(METHODS), seed=1)
    calls = {
        t: [(METHODS[(t + i) % 3], prompts[(t * CALLS * 3) + i]) for i in range(CALLS * 3)]
        for t in range(THREADS)
    }
    plain = {tuple(p): fd.generate(p, max_new_tokens=NEW, method="autoregressive").ids for p in prompts}
    reset_global_index()
    alone = {t: [fd.generate(p, max_new_tokens=NEW, method=m).ids for m, p in calls[t]] for t in calls}
    assert all(out == plain[tuple(p)] for t in calls for out, (_, p) in zip(alone[t], calls[t], strict=True))
    reset_global_index()
    started = time.perf_counter()
    found = in_threads(lambda t: [fd.generate(p, max_new_tokens=NEW, method=m) for m, p in calls[t]], THREADS)
    seconds = time.perf_counter() - started
    assert {t: [out.ids for out in found[t]] for t in calls} == alone
    methods = {out.method for outs in found.values() for out in outs}
    assert {"suffix", "eagle3"} <= methods  # and what auto planned
    drafted = sum(
        sum(out.output.drafted) for outs in found.values() for out in outs if out.method == "suffix"
    )
    assert drafted > 0  # the global index was read while the threads wrote it
    print(f"{THREADS} threads x {CALLS * 3} calls: {seconds:.2f} s")


def test_threads_with_other_engine_options_on_one_model_decode_as_autoregressive(fd, monkeypatch):
    """Two threads, one decoding on the HF modules and one on the static cache with oneDNN kernels, each
    planned by ``auto`` (a cost model measured per engine): every output is autoregressive decoding's on that
    engine, and every engine switch happens inside a call that holds the model's lock."""
    engines = [HF_MODULES, {"static_cache": True, "linear_kernel": "dnn"}]
    prompts = prompts_of(2 * CALLS, seed=2)
    plain = [
        fd.generate(p, max_new_tokens=NEW, method="autoregressive", **engines[k % 2]).ids
        for k, p in enumerate(prompts)
    ]
    held: list[bool] = []
    real = fd.m.use_engine

    def use_engine(options):
        held.append(fd.m.lock.held())
        return real(options)

    monkeypatch.setattr(fd.m, "use_engine", use_engine)
    found = in_threads(
        lambda t: [fd.generate(p, max_new_tokens=NEW, **engines[t]).ids for p in prompts[t::2]], 2
    )
    assert [found[k % 2][k // 2] for k in range(len(prompts))] == plain
    assert held and all(held)


def test_a_call_keeps_its_engine_while_another_thread_asks_for_another(fd, monkeypatch):
    """Forced interleaving: thread A pauses inside its call (its streamer, at its first new token) until
    thread B has switched the engine, or 1 s; the engine A runs on stays the one it selected (B waits for A's
    call)."""
    prompt_a, prompt_b = prompts_of(2, seed=3)
    plain_a = fd.generate(prompt_a, max_new_tokens=NEW, method="autoregressive", **HF_MODULES).ids
    plain_b = fd.generate(prompt_b, max_new_tokens=NEW, method="autoregressive").ids  # the default engine
    inside, switched = threading.Event(), threading.Event()
    seen: list[object] = []
    real = fd.m.use_engine

    def use_engine(options):
        engine = real(options)
        if threading.current_thread().name == "B":
            switched.set()
        return engine

    class Pausing:
        puts = 0

        def put(self, ids) -> None:
            self.puts += 1
            if self.puts == 2:  # the prompt came first: this is A's first new token, its engine selected
                inside.set()
                switched.wait(timeout=1.0)
            if self.puts >= 2:
                seen.append(fd.m.engine)

        def end(self) -> None:
            pass

    def call(thread: int):
        if thread == 0:
            return fd.generate(
                prompt_a, max_new_tokens=NEW, method="autoregressive", streamer=Pausing(), **HF_MODULES
            )
        threading.current_thread().name = "B"
        inside.wait(timeout=10)
        return fd.generate(prompt_b, max_new_tokens=NEW, method="autoregressive")

    monkeypatch.setattr(fd.m, "use_engine", use_engine)
    found = in_threads(call, 2)
    # A ran on the HF modules (no engine) from its first new token to its last
    assert len(seen) == len(plain_a[0]) and all(engine is None for engine in seen)
    assert found[0].ids == plain_a and found[1].ids == plain_b


def test_a_writer_waits_for_a_read_of_a_shared_suffix_index():
    """Forced interleaving: a reader pauses inside ``draft_chain`` (at its first ranking) while a writer adds
    a sequence that evicts the one the reader drafts from; the writer waits for the read, which drafts what
    the index held when it began."""
    text = [5, 6, 7, 5, 6, 8, 5, 6, 7]
    alone = SuffixIndex(8)
    alone.add("old", text)
    expected = alone.draft_chain([1, 5, 6], 4).tokens
    index = SuffixIndex(8, max_sequences=1)
    index.add("old", text)
    inside, go = threading.Event(), threading.Event()
    real = index.ranked

    def ranked(node: SuffixNode):
        inside.set()
        go.wait(timeout=10)
        return real(node)

    index.ranked = ranked
    drafts: list[object] = []

    def read() -> None:
        try:
            drafts.append(index.draft_chain([1, 5, 6], 4).tokens)
        except Exception as err:  # noqa: BLE001 - a read of removed nodes: asserted on below
            drafts.append(err)

    reader = threading.Thread(target=read)
    writer = threading.Thread(target=index.add, args=("new", [9, 10, 9, 11]))
    reader.start()
    assert inside.wait(timeout=10)
    writer.start()
    writer.join(timeout=0.5)
    waited = writer.is_alive()
    go.set()
    reader.join()
    writer.join()
    assert waited and drafts == [expected] and expected == [7, 5, 6, 8]
    assert list(index.keys) == ["new"]


def nodes_of(node: SuffixNode):
    yield node
    for child in list((node.children or {}).values()):
        yield from nodes_of(child)


def test_eviction_drops_the_memos_of_what_it_removes():
    """Every node ranked (memoised), then the sequence evicted: no memo left holds a node that is gone."""
    index = SuffixIndex(8, max_sequences=1)
    index.add("a", [5, 6, 7, 5, 6, 8, 5, 6, 7])
    for _ in range(index.max_depth):
        for node in list(nodes_of(index.root)):
            index.ranked(node)
    assert index.root.order is not None
    index.add("b", [9, 10, 9, 11])  # evicts "a"
    for node in nodes_of(index.root):
        if node.order is not None:
            assert all(node.children.get(token) is child for token, child in node.order[1])
    assert [token for token, _ in index.ranked(index.root)] == [9, 10, 11]


def test_the_global_index_is_bounded_in_tokens_too(tiny_llama):
    """``global_tokens``: the oldest outputs are evicted while the index holds more tokens (an output longer
    than the bound is not kept); checked by ``SuffixOptions``, 1,000,000 by default."""
    index = SuffixIndex(8, max_tokens=10)
    for n in range(5):
        index.add(n, [5 + n] * 4)
    assert list(index.keys) == [3, 4] and index.size == 8
    index.add("long", list(range(5, 17)))
    assert len(index) == 0 and index.size == 0 and index.root.children == {}
    assert SuffixOptions().global_tokens == 1_000_000
    with pytest.raises(ConfigError, match=r"decoder.suffix.global_tokens=0 .*need >= 1"):
        SuffixOptions(global_tokens=0)
    m = EarlyExitModel(tiny_llama[0])
    options = SuffixOptions(global_size=8, global_tokens=10)
    remember(m, options, [2], [[5] * 6, [6] * 6])
    remember(m, options, [2], [[7] * 3])
    found = global_index(m, options, [2])
    assert (found.max_sequences, found.max_tokens) == (8, 10)
    assert [found.tokens[key] for key in found.keys.values()] == [[6] * 6, [7] * 3]


def test_the_registry_s_decoders_hold_their_models_locks():
    """A decoder called directly (``registry.DECODERS``, ``get_decoder``) holds its model's lock, and a draft
    model's, for the whole call, and lets go after it."""
    from fastdecode.decoding import autoregressive
    from fastdecode.registry import DECODERS, get_decoder, locked
    from tests.helpers import tiny_model

    target = EarlyExitModel(tiny_model("tiny-llama")[0])
    draft = EarlyExitModel(tiny_model("tiny-mistral")[0])
    seen = []

    def probe(m, prompts, cfg, draft=None):
        seen.append((m.lock.held(), draft is None or draft.lock.held()))
        return "decoded"

    assert locked(probe)(target, [[1, 2]], None, draft) == "decoded" and seen == [(True, True)]
    assert not target.lock.held() and not draft.lock.held()
    assert DECODERS["autoregressive"].__wrapped__ is autoregressive.generate
    assert get_decoder("suffix").__wrapped__ is DECODERS["suffix"].__wrapped__
