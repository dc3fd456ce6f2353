"""``recipe=exit_adapter``: exit adapters on a frozen model (Kangaroo: "Kangaroo: Lossless Self-Speculative
Decoding via Double Early Exiting", Liu et al., 2024).

model (frozen) -> exits checked -> data -> draft vocabulary -> feature cache (layer-E features + teacher
targets, computed once, resumable) -> one adapter per exit, trained on the cache (HF Trainer; an epoch costs
only the adapters and the drafter's head) -> adapters saved (``final/E<e>/``, base weights never rewritten,
checked bitwise) -> per-exit agreement on the model's own greedy generations, raw exit vs adapter -> the exit
with the best expected speedup (head-aware cost model, ``choose_exit``) in ``final/adapters.json`` -> the base
model's perplexity (unchanged by construction) -> a closing speed line.

Written as steps a generic ``finetune`` sequence can call: the method code (features, loss, module, trainer)
lives in ``adapter_train/``; this module only wires it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from adapter_train.config import ExitAdapterConfig
from adapter_train.features import FeatureDataset, build_features, collate_features
from adapter_train.module import AdapterLM
from adapter_train.trainer import AdapterTrainer
from fastdecode.config import group_choices, load_group, to_dataclass, unknown_name_error
from fastdecode.data.chat import build_datasets, user_prompt_ids
from fastdecode.data.config import DataConfig
from fastdecode.data.draft_vocab import draft_vocab_from_examples
from fastdecode.decoding import DecodeConfig, get_decoder
from fastdecode.draft_vocab_file import load_draft_vocab
from fastdecode.exit_adapter import (
    INDEX_FILE,
    DraftVocabMismatchError,
    build_adapter,
    save_adapter,
)
from fastdecode.exit_report import (
    adapter_generation_report,
    choose_exit,
    greedy_generations,
    head_cost_in_blocks,
    model_perplexity,
)
from fastdecode.identity import weights_fingerprint
from fastdecode.io import atomic_write_json, save_resolved_config
from fastdecode.loading import load_model
from fastdecode.model import EarlyExitModel
from fastdecode_recipes.common import TrainJob, resolve_resume, training_arguments

log = logging.getLogger(__name__)


def given_draft_vocabulary(rcfg: ExitAdapterConfig, tokenizer, m: EarlyExitModel):
    """``recipe.draft_vocab`` (a file) checked against the tokenizer and the model, or None."""
    if rcfg.draft_vocab is None:
        return None
    ids, vocab_size = load_draft_vocab(rcfg.draft_vocab)
    if vocab_size != len(tokenizer) or len(ids) == 0 or int(ids.max()) >= m.vocab_size:
        raise DraftVocabMismatchError(
            f"recipe.draft_vocab={rcfg.draft_vocab!r} was built for a vocabulary of {vocab_size} ids but "
            f"this tokenizer has {len(tokenizer)} (the model's head {m.vocab_size} rows): rebuild it with "
            "this tokenizer, or set recipe.draft_vocab=null."
        )
    return ids.to(m.device)


def draft_vocabulary(rcfg: ExitAdapterConfig, train: list[dict], tokenizer, m: EarlyExitModel, given):
    """The draft vocabulary the adapters train and draft with: the given one, the most frequent trained-on
    tokens (``draft_vocab_size``), or None (the full head)."""
    if given is not None:
        return given
    if rcfg.draft_vocab_size is None or rcfg.draft_vocab_size >= len(tokenizer):
        return None
    return draft_vocab_from_examples(train, tokenizer, rcfg.draft_vocab_size).to(m.device)


def generation_prompts(train: list[dict], tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Chat-templated first user turns of the training examples (at most ``max_prompt_tokens``), in order."""
    out = []
    for ex in train:
        if ex.get("prompt", "").strip():
            ids = user_prompt_ids(tokenizer, ex["prompt"])
            if len(ids) <= max_prompt_tokens:
                out.append({"input_ids": ids})
    return out


def eos_ids(model, tokenizer) -> set[int]:
    """The tokenizer's and the generation config's EOS ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = model.generation_config.eos_token_id
    return ids | (set(extra) if isinstance(extra, list) else ({extra} if extra is not None else set()))


def _report_set(rcfg: ExitAdapterConfig, tokenizer, held_out: list[dict]) -> list[dict]:
    if rcfg.report.data is None:
        return held_out
    if rcfg.report.data not in group_choices("data"):
        raise unknown_name_error(
            "recipe.report.data", rcfg.report.data, group_choices("data"), "(configs/data)"
        )
    data = load_group("data", rcfg.report.data, DataConfig, max_samples=1)
    return build_datasets(data, tokenizer)[1]


def cached_generations(model, tokenizer, prompts: list[str], max_new_tokens: int, directory: Path) -> list:
    """The frozen model's greedy generations of ``prompts``, computed once per model and stored in
    ``directory`` (the model never changes in this recipe, so every run may reuse them)."""
    key = json.dumps([weights_fingerprint(model), prompts, max_new_tokens])
    path = directory / f"generations-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        return [(ids, n) for ids, n in json.loads(path.read_text())]
    generations = greedy_generations(model, tokenizer, prompts, max_new_tokens)
    atomic_write_json(path, generations)
    return generations


def draft_blocks(m: EarlyExitModel, adapters: dict, vocab) -> dict[int, float]:
    """A drafted token's cost in blocks per exit: E blocks, the adapter, the drafter's head (its rows)."""
    block = sum(p.numel() for p in m.layers[0].parameters())
    head = m.step_cost(depth=0, head_rows=None if vocab is None else len(vocab)) / block
    return {e: e + a.cost_in_blocks(m) + head for e, a in adapters.items()}


def speed_line(m: EarlyExitModel, tokenizer, prompts: list[str], adapter_dir: Path, rcfg) -> dict:
    """Self-speculation through the adapter (adaptive policy) against autoregressive decoding, batch 1."""
    r = rcfg.report
    ids = [user_prompt_ids(tokenizer, p) for p in prompts[: r.speed_prompts]]
    if not ids:
        return {}
    base = DecodeConfig(max_new_tokens=r.speed_new_tokens, eos_token_id=tokenizer.eos_token_id)
    spec = dataclasses.replace(base, adapter=str(adapter_dir), policy="adaptive", draft_tokens=r.max_draft)
    result = {}
    for name, cfg in (("autoregressive", base), ("self_speculative", spec)):
        get_decoder(name)(m, ids[:1], dataclasses.replace(cfg, max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        outs = [get_decoder(name)(m, [p], cfg) for p in ids]
        seconds = time.perf_counter() - start
        result[name] = {
            "tokens_per_s": sum(o.num_tokens for o in outs) / seconds,
            "tokens": sum(o.num_tokens for o in outs),
        }
        if name == "self_speculative":
            result["acceptance"] = sum(sum(o.accepted) for o in outs) / max(
                1, sum(sum(o.drafted) for o in outs)
            )
    result["speedup"] = result["self_speculative"]["tokens_per_s"] / result["autoregressive"]["tokens_per_s"]
    line = (
        f"self-speculation through the exit adapter ({adapter_dir.name}): "
        f"{result['self_speculative']['tokens_per_s']:.1f} tok/s vs autoregressive "
        f"{result['autoregressive']['tokens_per_s']:.1f} tok/s ({result['speedup']:.2f}x, acceptance "
        f"{result['acceptance']:.2f}; {len(ids)} held-out prompts, greedy, batch 1)"
    )
    log.info(line)
    print(line)
    return result


def run(job: TrainJob, cfg: Any = None) -> dict:
    """Cache features, train the adapters, save, report. Returns the summary (also ``summary.json``)."""
    from transformers import set_seed

    rcfg = to_dataclass(ExitAdapterConfig, job.recipe, "recipe")
    set_seed(job.seed)
    model, tokenizer = load_model(job.model)
    m = EarlyExitModel(model)
    rcfg.validate(m.num_layers)  # ExitLayerError before any data work
    given_vocab = given_draft_vocabulary(rcfg, tokenizer, m)  # DraftVocabMismatchError, likewise
    model.requires_grad_(False)
    model.eval()
    base_hash = weights_fingerprint(model, full=True)
    out = Path(job.output_dir)
    if cfg is not None:
        save_resolved_config(cfg, out)
    feature_dir = Path(rcfg.features.dir) if rcfg.features.dir else out / "features"
    train, held_out = build_datasets(job.data, tokenizer)
    vocab = draft_vocabulary(rcfg, train, tokenizer, m, given_vocab)
    report_set = _report_set(rcfg, tokenizer, held_out) if rcfg.report.enabled else []
    with torch.no_grad():  # the base model's perplexity, to compare with the one after training
        ppl_before = model_perplexity(m, report_set, rcfg.report.held_out_examples) if report_set else None
    sources, eos = train, None
    if rcfg.features.source == "generate":  # the model's own answers to the training split's first user turns
        sources, eos = (
            generation_prompts(train, tokenizer, rcfg.features.max_prompt_tokens),
            eos_ids(model, tokenizer),
        )
    reader = build_features(
        m, tokenizer, sources, feature_dir, rcfg.features, rcfg.cached_exits(), job.data, eos=eos
    )
    feature_summary = reader.manifest.get("summary", {})

    adapters = {e: build_adapter(m, e, rcfg.kind, rcfg.init, rcfg.zero_init) for e in rcfg.exits}
    module = AdapterLM(m, adapters, rcfg.loss, vocab)
    args = training_arguments(job, prediction_loss_only=True, remove_unused_columns=False)
    dataset = FeatureDataset(reader, rcfg.exits, rcfg.loss.target)
    trainer = AdapterTrainer(
        model=module,
        args=args,
        train_dataset=dataset,
        data_collator=functools.partial(collate_features, exits=rcfg.exits),
    )
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resolve_resume(job))
    train_seconds = time.perf_counter() - started
    scored = sum(len(reader.read(i, ["scored"])["scored"]) for i in range(len(reader)))
    epochs = float(result.metrics.get("epoch", 0.0))
    training = {
        "metrics": dict(result.metrics),
        "seconds": train_seconds,
        "scored_positions": scored,
        "epochs": epochs,
        "scored_positions_per_s": scored * epochs / max(train_seconds, 1e-9),
        "history": [h for h in trainer.state.log_history if "loss" in h],
    }
    if weights_fingerprint(model, full=True) != base_hash:
        raise RuntimeError("the base model's weights changed during adapter training: they must stay frozen")

    final = out / "final"
    meta = {
        "recipe": "exit_adapter",
        "loss": dataclasses.asdict(rcfg.loss),
        "data": job.data.name,
        "features": str(feature_dir),
        "scored_positions": scored,
        "epochs": epochs,
        "learning_rate": args.learning_rate,
        "seconds": train_seconds,
    }
    dirs = {}
    for e, adapter in adapters.items():
        adapter.eval()
        dirs[e] = save_adapter(
            adapter,
            final / f"E{e}",
            m,
            tokenizer,
            vocab,
            meta | {"init": rcfg.init, "zero_init": rcfg.zero_init},
        )

    summary = {
        "final": str(final),
        "adapters": {str(e): str(d) for e, d in dirs.items()},
        "features": {"dir": str(feature_dir), **feature_summary},
        "training": training,
        "base_weights_sha256": base_hash,
        "base_weights_unchanged": True,
    }
    summary |= _report(m, model, tokenizer, report_set, rcfg, adapters, vocab, feature_dir, dirs, final)
    summary["perplexity_before"] = ppl_before
    atomic_write_json(out / "summary.json", summary)
    return summary


def _report(m, model, tokenizer, report_set, rcfg, adapters, vocab, feature_dir, dirs, final) -> dict:
    """Agreement raw vs adapter, the chosen exit (``adapters.json``), perplexity, the speed line."""
    index = {"adapters": {str(e): f"E{e}" for e in adapters}, "chosen": None}
    if not rcfg.report.enabled:
        atomic_write_json(final / INDEX_FILE, index)
        return {"chosen": None}
    r = rcfg.report
    prompts = [ex["prompt"] for ex in report_set if ex.get("prompt")][: r.prompts]
    generations = cached_generations(model, tokenizer, prompts, r.max_new_tokens, feature_dir)
    with torch.no_grad():
        agreement = adapter_generation_report(m, adapters, generations, vocab)
        ppl = model_perplexity(m, report_set, r.held_out_examples)
    blocks = draft_blocks(m, adapters, vocab)
    head = head_cost_in_blocks(m)
    choice = choose_exit(
        agreement["adapter"], m.num_layers, r.max_draft, r.min_speedup, head, blocks, r.verify_cost
    )
    raw_choice = choose_exit(
        agreement["raw"], m.num_layers, r.max_draft, r.min_speedup, head, blocks, r.verify_cost
    )
    index["chosen"] = choice["exit"]
    index["choice"] = choice
    index["agreement"] = agreement
    index["draft_blocks"] = blocks
    atomic_write_json(final / INDEX_FILE, index)
    best = choice["exit"] or (choice.get("best_found") or {}).get("exit")
    speed = {}
    if best is not None and r.speed_prompts > 0:
        speed = speed_line(m, tokenizer, prompts, dirs[best], rcfg)
    log.info("exit adapters: agreement %s, chosen %s", agreement, choice)
    return {
        "agreement": agreement,
        "chosen": choice,
        "raw_exit_choice": raw_choice,
        "draft_blocks": blocks,
        "perplexity": ppl,
        "speed": speed,
    }
