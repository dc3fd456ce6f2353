"""Trajectory collection throughput: our collector against the CLLM reference procedure (``fastdecode-collect-
throughput`` / ``python eval/collect_throughput.py``, ``fastdecode_cli/collect_throughput.py``).

Runs our collector (batched, length-bucketed, KV cache, fast-forward) and the CLLM reference procedure
(``reference_trajectories``: batch 1, no KV cache, every iteration re-encodes prompt ⊕ block) on the same
prompts with the same seeded initial guesses, and reports fixed-point tokens per second of each, the speedup,
and how many records agree (fixed points and whole state sequences; filters are off for both).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from cllm_train.collect import CollectJob
from fastdecode.runtime.machine import machine_label


@torch.inference_mode()
def reference_trajectories(
    hf: Any, prompt: Any, n: int, init: str, max_new_seq_len: int, *, eos_ids: set[int], seed: int
) -> list[dict]:
    """The reference procedure for one ``Prompt``: records (schema of ``cllm_train/records.py``).

    Each iteration runs the whole ``prefix ⊕ y`` through the HF model and takes ``y' = argmax`` at the block
    positions shifted by one, until ``y' == y``; the converged block extends the prefix.
    """
    from cllm_train.trajectories import make_record
    from fastdecode.jacobi import Block, initial_guess, row_generator

    prefix, records = list(prompt.ids), []
    device = hf.device
    while True:
        generator = row_generator(seed, f"{prompt.id}:{len(records)}")
        y = initial_guess(init, n, prefix, hf.get_output_embeddings().weight.shape[0], generator)
        states = [y]
        while True:
            logits = hf(torch.tensor([prefix + y], device=device)).logits[0]  # [T, V]
            new = logits[len(prefix) - 1 : len(prefix) - 1 + n].argmax(-1).tolist()
            if new == y:
                break
            y = new
            states.append(y)
        records.append(make_record(prompt, len(records), prefix, Block(0, states, [], -1), eos_ids))
        prefix += y
        if records[-1]["eos"] or len(prefix) - len(prompt.ids) >= max_new_seq_len:
            return records


def _ours(m: Any, prompts: list, job: CollectJob, eos_ids: set[int]) -> tuple[list[dict], int]:
    from cllm_train.collect import plan_batches, solve_batch
    from cllm_train.trajectories import FilterConfig

    off = FilterConfig(max_repeat_run=None, ngram_size=None)
    records, forwards = [], 0
    for batch in plan_batches(prompts, job.batch_size):
        result = solve_batch(m, batch, job, eos_ids, filters=off)
        records += [rec for recs in result.records for rec in recs]
        forwards += result.forwards
    return records, forwards


def _reference(hf: Any, prompts: list, job: CollectJob, eos_ids: set[int]) -> list[dict]:
    return [
        record
        for prompt in prompts
        for record in reference_trajectories(
            hf, prompt, job.block_size, job.init, job.max_new_seq_len, eos_ids=eos_ids, seed=job.seed
        )
    ]


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def collect_throughput(job: CollectJob, bench_prompts: int, warmup: bool = True) -> dict:
    """Time ours against the reference on ``bench_prompts`` prompts of ``job``; returns the report."""
    from cllm_train.collect import build_prompts
    from fastdecode.runtime.loading import load_model
    from fastdecode.runtime.model import EarlyExitModel
    from fastdecode.tokens import eos_ids

    if job.max_prompts is None:  # tokenize only what the benchmark can use (some prompts are too long)
        job = dataclasses.replace(job, max_prompts=4 * bench_prompts)
    hf, tokenizer = load_model(job.model)
    m, eos = EarlyExitModel(hf), eos_ids(hf, tokenizer)
    prompts = build_prompts(job, tokenizer, hf.config.max_position_embeddings)[0][:bench_prompts]
    if warmup:
        short = dataclasses.replace(job, max_new_seq_len=job.block_size)
        _ours(m, prompts[:1], short, eos)
        _reference(hf, prompts[:1], short, eos)
    (ours, forwards), ours_s = _timed(lambda: _ours(m, prompts, job, eos))
    ref, ref_s = _timed(lambda: _reference(hf, prompts, job, eos))
    key = {(r["prompt_id"], r["block"]): r for r in ref}
    same_fixed = sum(
        key.get((r["prompt_id"], r["block"]), {}).get("fixed_point") == r["fixed_point"] for r in ours
    )
    same_states = sum(key.get((r["prompt_id"], r["block"]), {}).get("states") == r["states"] for r in ours)
    tokens = sum(len(r["fixed_point"]) for r in ours)
    report = {
        "model": job.model.name,
        "prompts": len(prompts),
        "block_size": job.block_size,
        "batch_size": job.batch_size,
        "max_new_seq_len": job.max_new_seq_len,
        "records": {"ours": len(ours), "reference": len(ref)},
        "same_fixed_point": same_fixed,
        "same_states": same_states,
        "tokens": tokens,
        "forwards": {"ours": forwards, "reference": sum(len(r["states"]) for r in ref)},
        "seconds": {"ours": ours_s, "reference": ref_s},
        "tokens_per_s": {
            "ours": tokens / ours_s,
            "reference": sum(len(r["fixed_point"]) for r in ref) / ref_s,
        },
    }
    report["speedup"] = report["tokens_per_s"]["ours"] / report["tokens_per_s"]["reference"]
    report["measured_on"] = machine_label(m.device)  # what the tokens per second were measured on
    return report
