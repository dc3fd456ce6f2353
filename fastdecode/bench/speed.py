"""The speed benchmark: check, read prompts, load, resolve what needs the model (``auto.py``), say what will run,
warm up, measure every method interleaved, summarise, write.

All methods run in one process on the same prompts, interleaved so that machine drift hits every method alike
(``measure.py``). Prompts are the first ``n_prompts`` records that fit, taken round-robin across categories
on sets that have them (``categories.py``). Timing and TTFT: docs/design/bench.md.
"""

from __future__ import annotations

import logging
from typing import Any

from fastdecode.api import drafter_corpus
from fastdecode.bench.auto import AUTO_PREFIX, resolve_after_load
from fastdecode.bench.categories import category_summary, prompt_categories, round_robin
from fastdecode.bench.config import (
    Method,
    SpeedJob,
    check_exit_layers,
    draft_model_config,
    job_drafters,
    plan,
    target_model_config,
)
from fastdecode.bench.engines import AutoRunner, FastdecodeRunner, HFRunner
from fastdecode.bench.stats import Record, attach_matches, oracle_report, summarise
from fastdecode.config import ConfigError
from fastdecode.data.sources import load_split
from fastdecode.data.splits import first_user_turn
from fastdecode.data.twins import drop_twins
from fastdecode.decoding.common import check_context
from fastdecode.registry import (
    check_corpus_file,
    corpus_fingerprint,
    corpus_options,
    corpus_prompt_keys,
    load_corpus,
    named_corpus,
)
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import eos_ids

log = logging.getLogger(__name__)


def read_prompt_records(job: SpeedJob) -> list[dict]:
    """``prompt_records``' records."""
    return prompt_records(job)[0]


def prompt_records(job: SpeedJob) -> tuple[list[dict], dict]:
    """The prompt records (``prompt_split=auto``): the data config's ``eval_split`` when it names one, else
    benchmarks whole and training sets held-out only; none with a twin (``data.twins``) in the training split
    or among the prompts of a corpus the job decodes with (``corpus=``, the one beside ``drafter=``);
    round-robin across categories when they have one and ``n_prompts`` takes fewer than all
    (``categories.round_robin``). Returns them and what was dropped (``twins``: the report's)."""
    split = job.prompt_split
    if split == "auto":
        split = job.data.eval_split or ("all" if job.data.eval_only else "held_out")
    records, split_twins = load_split(job.data, split)
    if not records:
        raise ConfigError(f"data '{job.data.name}' has no records in split '{split}'.")
    twins = {"training_split": split_twins, "corpora": {}}
    for corpus in twin_corpora(job):
        keys = corpus_prompt_keys(corpus)
        if keys is None:
            log.warning("corpus %s records no prompt keys: its prompts' twins cannot be excluded", corpus)
        else:
            records, dropped = drop_twins(records, set(keys), first_user_turn, digests=True)
            twins["corpora"][corpus] = dropped
    if not records:
        raise ConfigError(
            f"every prompt of data '{job.data.name}' ({split}) has a twin among the corpus' prompts "
            f"({twins['corpora']}): benchmark another prompt set, or give a corpus built from other prompts."
        )
    if split_twins or any(twins["corpora"].values()):
        log.info(
            "prompts with a twin dropped: %d (training split), %s (corpora)", split_twins, twins["corpora"]
        )
    return round_robin(records, job.n_prompts), twins


def twin_corpora(job: SpeedJob) -> list[str]:
    """The corpus files whose prompts the benchmark's must not twin: ``corpus=`` and the ones beside the
    trained drafters (``drafter=``: the answers each was trained on, ``api.drafter_corpus``)."""
    beside = [drafter_corpus(path) for path in job_drafters(job)]
    found = [job.corpus, *(str(path) for path in beside if path is not None)]
    return list(dict.fromkeys(path for path in found if path is not None))


def tokenize_prompts(
    job: SpeedJob, records: list[dict], tokenizer, context: int
) -> list[tuple[str, list[int]]]:
    """``(id, token ids)`` of the first ``n_prompts`` records that fit (all with ``n_prompts`` None): the conversation up to its first user
    turn, through the chat template with the generation prompt (chat models), else the plain text with BOS."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if job.chat_template == "always" and not has_template:
        raise ConfigError("chat_template=always but the tokenizer has no chat template; use auto or never.")
    templated = has_template and job.chat_template != "never"
    limit = min(job.max_prompt_tokens, context - job.max_new_tokens)
    prompts, too_long = [], 0
    for rec in records:
        first_user = next((i for i, m in enumerate(rec["messages"]) if m["role"] == "user"), None)
        if first_user is None:
            continue
        messages = rec["messages"][: first_user + 1]
        if templated:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer("\n\n".join(m["content"] for m in messages)).input_ids
        if len(ids) > limit:
            too_long += 1
            continue
        prompts.append((str(rec["id"]), list(ids)))
        if job.n_prompts is not None and len(prompts) == job.n_prompts:
            break
    if not prompts:
        raise ConfigError(f"no prompt fits in {limit} tokens (max_prompt_tokens, context - max_new_tokens).")
    if job.n_prompts is not None and len(prompts) < job.n_prompts:
        log.warning("only %d prompts (asked for %d; %d too long)", len(prompts), job.n_prompts, too_long)
    return prompts


def check_corpus(job: SpeedJob, methods: list[Method]) -> None:
    """``corpus=`` needs a ``suffix`` method and a readable suffix index file (checked before any load)."""
    if job.corpus is None:
        return
    if not any(x.spec.uses_corpus for x in methods):
        raise ConfigError(
            f"corpus={job.corpus!r} is read by the suffix methods that use a corpus only (uses_corpus: suffix, "
            "suffix_tree, the *_suffix_chain ones, auto): add one (decoder=[...,suffix]) or drop corpus=."
        )
    check_corpus_file(job.corpus)  # a missing, foreign or other-version file fails here, by name


def build_runners(
    job: SpeedJob, methods: list[Method], m: EarlyExitModel, tokenizer, draft, *, auto=None
) -> dict[str, Any]:
    """One runner per method, checked against the loaded model ``m`` before any decoding; the ``auto`` method
    calls ``auto`` (the library facade, ``generate(method="auto")``)."""
    model = m.hf
    eos = eos_ids(model, tokenizer)
    draft_m = EarlyExitModel(draft) if draft is not None else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    runners = {}
    for method in methods:
        if method.options.get("adapter") is not None:  # another model or tokenizer fails before decoding
            from fastdecode.drafters.exits.adapter import load_adapter

            load_adapter(method.options["adapter"], m, tokenizer)
        if job.corpus and method.spec.uses_corpus and not method.is_auto:
            method.options = corpus_options(method.options, job.corpus)
        named = None if method.is_auto else named_corpus(method.options)  # ``auto``: the facade checks it
        if (
            named is not None
        ):  # the job's or the method's own, against this tokenizer (a decoder: vocabulary size)
            load_corpus(named, m, corpus_fingerprint(tokenizer), method.options.get("suffix"))
        if method.is_auto:
            runners[method.name] = AutoRunner(method, auto, job, m)
        elif method.spec.engine == "fastdecode":
            runners[method.name] = FastdecodeRunner(method, m, draft_m, job, eos)
        else:
            runners[method.name] = HFRunner(method, model, draft, job, eos, pad)
    return runners


def annotate(summary: list[dict], methods: list[Method], runners: dict, hf_layers: dict) -> None:
    """Add to each summary row its exit layer, sweep grid point, the layer counts of HF methods, and for the
    ``auto`` method's candidates the speedup the plan expected and ``auto_best`` (the best measured candidate
    per temperature and batch size; None on other methods); the ``auto`` row gets ``vs_best_candidate``
    (its tokens/s over the best candidate's) and ``ran`` (the candidates it ran)."""
    by_name = {m.name: m for m in methods}
    for row in summary:
        method = by_name[row["method"]]
        row["exit_layer"], row["grid"] = method.exit_layer, list(method.grid) if method.grid else None
        row["counted_by"] = "decoder" if runners[method.name].counters else "not counted"
        key = (row["method"], row["temperature"], row["batch_size"])
        if key in hf_layers:
            row["layers_per_token"], row["layer_calls_per_token"] = hf_layers[key]
            row["counted_by"] = (
                "layer hooks, first batch, untimed (an assistant's own prompt prefill included)"
            )
        row["expected_speedup"] = (method.candidate or {}).get("expected_speedup")
        row["auto_best"] = None
        if method.is_auto:
            row["ran"] = sorted(runners[method.name].ran)
    for temperature, size in dict.fromkeys((r["temperature"], r["batch_size"]) for r in summary):
        same = [r for r in summary if (r["temperature"], r["batch_size"]) == (temperature, size)]
        auto = [r for r in same if r["method"].startswith(AUTO_PREFIX)]
        best = max(auto, key=lambda r: r["tokens_per_s"] or 0.0, default=None)
        for row in auto:
            row["auto_best"] = row is best
        for row in same:
            if by_name[row["method"]].is_auto and best is not None and best["tokens_per_s"]:
                row["vs_best_candidate"] = (row["tokens_per_s"] or 0.0) / best["tokens_per_s"]


def load_and_resolve(job: SpeedJob, methods: list[Method]):
    """Load the target (and the draft model when a method uses one), then resolve what needs the loaded model
    (``auto.resolve_after_load``). Returns ``(m, tokenizer, draft, Resolved)``."""
    from fastdecode.runtime.loading import load_model, model_config

    target = target_model_config(job)
    config = model_config(target)  # config.json, not the weights
    check_exit_layers(methods, config.num_hidden_layers, job.exit_layer)
    check_context(config.max_position_embeddings, job.max_new_tokens, 1, "a prompt")
    model, tokenizer = load_model(target)
    draft = None
    if any(m.spec.uses_draft for m in methods):
        draft = load_model(draft_model_config(job))[0]
    m = EarlyExitModel(model)
    resolved = resolve_after_load(job, methods, m, tokenizer)
    check_exit_layers(resolved.methods, m.num_layers)
    return m, tokenizer, draft, resolved


def run(cfg: Any) -> dict:
    """The whole benchmark for one model and prompt set; returns the result written to ``output_dir``."""
    from fastdecode.bench.measure import measure
    from fastdecode.bench.report import environment, write_report
    from fastdecode.files.io import check_writable

    job, methods, exit_source = plan(cfg)
    check_corpus(job, methods)
    records, twins = prompt_records(job)  # a missing data file fails before any model loads
    check_writable(job.output_dir)  # a read-only output_dir fails here too, not after the benchmark
    m, tokenizer, draft, resolved = load_and_resolve(job, methods)
    methods = resolved.methods
    runners = build_runners(job, methods, m, tokenizer, draft, auto=resolved.decoder)
    prompts = tokenize_prompts(job, records, tokenizer, m.config.max_position_embeddings)
    for runner in runners.values():
        runner.check([ids for _, ids in prompts])
    categories = prompt_categories(records, [pid for pid, _ in prompts])
    timed_records, skipped, hf_layers = measure(job, methods, runners, prompts, m.device)
    for record in timed_records:
        record.categories = [categories.get(pid) for pid in record.prompt_ids] if categories else None
    attach_matches(timed_records, job.baseline)
    summary = summarise(timed_records, job.baseline, job.hf_baseline)
    annotate(summary, methods, runners, hf_layers)
    meta = environment(job, m.hf, exit_source)
    meta["costs"] = resolved.costs.to_json() if resolved.costs is not None else None
    result = {
        "meta": meta,
        "methods": {
            x.name: {
                "engine": x.spec.engine,
                "decoder": x.spec.decoder,
                "options": x.options,
                "draft_source": x.draft_source,
                "candidate": x.candidate,
            }
            for x in methods
        },
        "plan": resolved.plan.to_json() if resolved.plan is not None else None,
        "prompts": [pid for pid, _ in prompts],
        "twins": twins,  # prompts dropped for a twin in the training split or a corpus' prompts
        "categories": categories,
        "skipped": skipped,
        "summary": summary,
        "category_summary": category_summary(timed_records, job.baseline, job.hf_baseline),
        "oracle": oracle_report(timed_records),
        "records": [r.to_json() for r in timed_records],
    }
    write_report(result, job.output_dir)
    return result


__all__ = ["Record", "run", "tokenize_prompts"]
