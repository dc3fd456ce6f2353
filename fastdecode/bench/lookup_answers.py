"""The prompt lookup replay's job (``configs/lookup_replay.yaml``) and its answer cache: the model's own
greedy answers to prompts of a training split, kept on disk with the cost model they are priced by.

Prompts come from the data config's training split; an evaluation set is refused. The cache is one JSON file
rewritten atomically after every batch, so a killed run resumes; the answers of another job are refused.
Details: docs/design/bench.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.config import ConfigError, ModelConfig
from fastdecode.data.config import DataConfig, check_data_files, check_trainable
from fastdecode.decoding.policies import POLICIES
from fastdecode.drafters.lookup.options import EOS_CUTS, MATCHES
from fastdecode.files.io import atomic_write_json, check_writable
from fastdecode.plan.cost import SOURCES, CostModel

logger = logging.getLogger(__name__)
FORMAT = 1


@dataclass
class ReplayJob:
    """``configs/lookup_replay.yaml``: which answers (model, data, how many, how long), which variants of
    prompt lookup are replayed over them (every combination), under which draft-length policies."""

    model: ModelConfig
    data: DataConfig
    num_prompts: int = 128
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256
    batch_size: int = 8
    draft_tokens: int = 6
    policies: list[str] = field(default_factory=lambda: ["adaptive", "constant"])
    matches: list[str] = field(default_factory=lambda: list(MATCHES))
    max_ngram_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    eos: list[str] = field(default_factory=lambda: list(EOS_CUTS))
    costs: str = "measured"
    cache: str = "outputs/lookup-replay/answers.json"
    output: str | None = None

    def __post_init__(self) -> None:
        for key in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "draft_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 1.")
        for key, choices in (("policies", POLICIES), ("matches", MATCHES), ("eos", EOS_CUTS)):
            wrong = [value for value in getattr(self, key) if value not in choices]
            if wrong or not getattr(self, key):
                raise ConfigError(f"{key}={getattr(self, key)}: need one or more of {sorted(choices)}.")
        if not self.max_ngram_sizes or min(self.max_ngram_sizes) < 1:
            raise ConfigError(f"max_ngram_sizes={self.max_ngram_sizes}: need one or more sizes >= 1.")
        if self.costs not in SOURCES and not self.costs.endswith(".json"):
            raise ConfigError(
                f"costs={self.costs!r}: need one of {list(SOURCES)}, or a .json file holding a cost model "
                "(a speed.json, whose meta.costs is the one its run measured)."
            )

    def header(self) -> dict[str, Any]:
        """What the cached answers depend on: a cache with another header is not these answers."""
        return {
            "format": FORMAT,
            "model": self.model.name_or_path or self.model.name,
            "data": self.data.name,
            "split": "train",
            "max_new_tokens": self.max_new_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
        }

    def check(self) -> None:
        """Everything that can be refused before the model loads."""
        check_trainable(self.data)  # prompts come from a training split: benchmarks are refused
        check_data_files(self.data)
        check_writable(Path(self.cache).parent, option="cache")
        if self.costs not in SOURCES:
            costs_from_file(self.costs)
        if self.output:
            check_writable(Path(self.output).parent, option="output")
        read_cache(self)


def read_cache(job: ReplayJob) -> dict[str, Any]:
    """The cache of ``job`` (a new empty one when the file does not exist); another job's is refused."""
    import json

    path = Path(job.cache)
    if not path.exists():
        return {"header": job.header(), "records": [], "costs": {}}
    found = json.loads(path.read_text())
    if found.get("header") != job.header():
        raise ConfigError(
            f"cache={path} holds answers for {found.get('header')}, not {job.header()}: choose another "
            "cache path, or delete that file to generate these answers."
        )
    return found


def cost_model_of(fields: dict[str, Any]) -> CostModel:
    """A ``CostModel`` from its JSON fields (``CostModel.to_json``)."""
    return CostModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def cached_costs(cache: dict[str, Any], key: str) -> CostModel | None:
    found = cache["costs"].get(key)
    return None if found is None else cost_model_of(found)


def costs_from_file(path: str) -> CostModel:
    """The cost model a JSON file holds: a ``CostModel.to_json``, or a speed.json (its ``meta.costs``)."""
    import json

    try:
        found = json.loads(Path(path).read_text())
        found = found["meta"]["costs"] if "meta" in found else found
        return cost_model_of(found)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"costs={path}: not a readable cost model ({type(err).__name__}: {err}); give a speed.json, a JSON "
            "object of CostModel fields, or costs=measured."
        ) from err


def fill_cache(job: ReplayJob, cache: dict[str, Any], m: Any, tokenizer: Any, eos: set[int]) -> None:
    """Generate the answers ``cache`` still lacks for ``job``, a batch at a time, rewriting the file after
    each; ``cache["records"]`` holds ``{"prompt": ids, "answer": ids}`` in the training split's order."""
    from fastdecode.data.chat import training_prompts
    from fastdecode.decoding.config import DecodeConfig
    from fastdecode.registry import get_decoder

    records = cache["records"]
    if len(records) >= job.num_prompts:
        return
    prompts = [
        ids for _, ids in training_prompts(job.data, tokenizer, job.num_prompts, job.max_prompt_tokens)
    ]
    cfg = DecodeConfig(max_new_tokens=job.max_new_tokens, eos_token_id=sorted(eos))
    for start in range(len(records), len(prompts), job.batch_size):
        batch = prompts[start : start + job.batch_size]
        answers = get_decoder("autoregressive")(m, batch, cfg).tokens
        records += [{"prompt": p, "answer": a} for p, a in zip(batch, answers, strict=True)]
        cache["eos"] = sorted(eos)
        atomic_write_json(job.cache, cache)  # whole file each time: never half-written
        logger.info("lookup replay: %d / %d answers", len(records), len(prompts))


def costs_key(job: ReplayJob) -> str:
    """Where the cache keeps the cost model: estimated, or measured on this machine at this thread count."""
    import torch

    from fastdecode.runtime.loading import resolve_device
    from fastdecode.runtime.machine import machine_key

    if job.costs != "measured":
        return job.costs
    return f"measured-{machine_key(resolve_device(job.model.device))}-{torch.get_num_threads()}threads"


def prepare(job: ReplayJob) -> tuple[list[tuple[list[int], list[int]]], CostModel, set[int]]:
    """``(calls, costs, eos)``: the first ``num_prompts`` ``(prompt, answer)`` pairs, the cost model and the
    EOS ids, from the cache; the model is loaded only to generate what is missing or measure the costs."""
    cache = read_cache(job)
    key = costs_key(job)
    costs = cached_costs(cache, key) if job.costs in SOURCES else costs_from_file(job.costs)
    if len(cache["records"]) < job.num_prompts or costs is None:
        from fastdecode.plan.cost import decoding_costs
        from fastdecode.runtime.loading import load_model
        from fastdecode.runtime.model import EarlyExitModel
        from fastdecode.tokens import eos_ids

        model, tokenizer = load_model(job.model)
        m, eos = EarlyExitModel(model), eos_ids(model, tokenizer)
        fill_cache(job, cache, m, tokenizer, eos)
        if costs is None:
            costs = decoding_costs(m, job.costs)
            cache["costs"][key] = costs.to_json()
            cache["eos"] = sorted(eos)
            atomic_write_json(job.cache, cache)
    calls = [(r["prompt"], r["answer"]) for r in cache["records"][: job.num_prompts]]
    return calls, costs, set(cache["eos"])
