"""DFlash speculative decoding (Chen et al., 2026): the ``dflash`` decoder, where a block drafter conditioned
on the target's features drafts a whole block in one forward and the target verifies; lossless.

This module owns the decoder's checks (``decoder.drafter`` names a DFlash drafter that fits the target, read
before its weights load; ``is_dflash_directory`` tells such a directory apart), loads the drafter once per
model and version of its files, prices its pass and context write (``pass_costs``, ``measure_pass``) and tells
``auto`` about a drafter whose directory records its acceptance (``offers``). The proposer is
``proposer.DFlashProposer``. Design notes: docs/design/dflash.md.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.drafters.dflash.files import (
    CONFIG_FILE,
    NATIVE_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    WEIGHTS_FILE,
    load_dflash,
    read_dflash_config,
)
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.drafters.dflash.options import DFlashOptions
from fastdecode.drafters.dflash.proposer import ContextCache, DFlashProposer, block_round_cost
from fastdecode.files.drafter_dir import check_fit, drafter_needed, load_once
from fastdecode.files.file_cache import FileCache
from fastdecode.plan.acceptance import read_record
from fastdecode.plan.cost import PROBE_CONTEXT, CostModel, block_parameters, plain_step, timed
from fastdecode.plan.timing import Timer, interleaved_minima
from fastdecode.runtime.model import EarlyExitModel

NAME = "dflash"
PASS_REPEATS = 7  # timings of a pass and a write; the least disturbed one counts
WRITE_TOKENS = 4  # tokens of the context write timed (a round keeps t and its accepted drafts)
_LOADED = FileCache(maxsize=4)  # per model (owner), drafter files' version, device and dtype


def is_dflash_directory(path: str | os.PathLike) -> bool:
    """Whether ``path/config.json`` describes a DFlash drafter (its ``architectures``, native or speculators
    format); False for anything else, a missing or unreadable file included (another reader names those)."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(config, dict):
        return False
    arch = (config.get("architectures") or [None])[0]
    return (
        arch in (NATIVE_ARCHITECTURE, SPECULATORS_ARCHITECTURE)
        or config.get("speculators_model_type") == NAME
    )


def check_draft(cfg: DFlashConfig, m: EarlyExitModel, path: str) -> None:
    """Refuse a drafter built for another target: its widths, vocabulary and layers must fit ``m``, whose head
    must read states of the drafter's width (the drafter's output goes through the target's head)."""
    target, where = m.config, f"decoder.drafter={path!r}"
    found = {
        "hidden size": (cfg.hidden_size, target.hidden_size),
        "feature width (target hidden size)": (cfg.target_hidden_size, target.hidden_size),
        "vocabulary size": (cfg.vocab_size, m.vocab_size),
        "layer count": (cfg.num_target_layers, m.num_layers),
    }
    check_fit(found, where, "a DFlash drafter")
    if m.lm_head.in_features != cfg.hidden_size:
        raise ConfigError(
            f"{where}: this model's head reads {m.lm_head.in_features}-wide states, not its hidden size "
            f"{cfg.hidden_size} (an output projection sits between them): DFlash drafts through the target's "
            "head, so it needs a target whose head reads its hidden states; use another decoder here."
        )


def check(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    """A DFlash directory is named and fits the model (read from its config, before any weights load); no
    token trees; ``decoder.dflash.slots`` within the drafter's block."""
    if cfg.drafter is None:
        raise drafter_needed(NAME, "a DFlash drafter", "dflash", "a z-lab / SpecForge DFlashDraftModel")
    for group, options in cfg.groups.items():
        if getattr(options, "tree", False):
            raise ConfigError(
                f"decoder.{group}.tree=true: decoder 'dflash' drafts chains (one block per round, verified as "
                f"a chain), never token trees; set decoder.{group}.tree=false."
            )
    found = read_dflash_config(cfg.drafter)
    check_draft(found, m, cfg.drafter)
    slots = DFlashOptions.of(cfg).slots
    if slots is not None and slots > found.block_size:
        raise ConfigError(
            f"decoder.dflash.slots={slots}: the drafter's block has {found.block_size} slots; give at most "
            "that, or null for the whole block."
        )


def load_draft(path: str, m: EarlyExitModel) -> DFlashDraft:
    """The drafter in ``path`` on ``m``'s device and dtype, in eval mode; loaded once per model and version of
    its files. After ``check_draft``."""

    return load_once(_LOADED, path, [CONFIG_FILE, WEIGHTS_FILE], m, read=load_dflash, check=check_draft)


def pass_costs(costs: CostModel, m: EarlyExitModel, draft: DFlashDraft, slots: int) -> tuple[float, float]:
    """``(pass, write)`` in plain decoding steps: one drafter forward over a block of ``slots`` and one round's
    context write. With a measured cost model both are timed on the model against a plain step timed in the
    same measurement (``measure_pass``), else priced by weights read: the draft layers as blocks of the target
    over ``slots`` tokens, ``fc`` and the layers' key and value projections over ``WRITE_TOKENS``. The target's
    head over the drafted slots is the cost model's own (``proposer.block_round_cost``)."""
    if costs.source == "measured":
        return measure_pass(m, draft, batch=costs.batch, slots=slots)
    block = block_parameters(m)
    layers = sum(p.numel() for p in draft.layers.parameters()) + draft.norm.weight.numel()
    keys = [layer.self_attn for layer in draft.layers]
    write = draft.fc.weight.numel() + sum(a.k_proj.weight.numel() + a.v_proj.weight.numel() for a in keys)
    return costs.layers(layers / block, slots), costs.layers(write / block, WRITE_TOKENS)


@torch.inference_mode()
def measure_pass(
    m: EarlyExitModel,
    draft: DFlashDraft,
    *,
    batch: int = 1,
    slots: int | None = None,
    repeats: int = PASS_REPEATS,
    timer: Timer | None = None,
) -> tuple[float, float]:
    """``(pass, write)`` as ``DFlashProposer`` runs them (the drafter as the model's engine runs linears), in
    plain decoding steps of the target: a block of ``slots`` over ``PROBE_CONTEXT`` context slots, and the
    context of ``WRITE_TOKENS`` tokens written, over the target's plain step of ``batch`` rows
    (``plain_step``), all timed here, interleaved (the least of ``repeats`` rounds after an untimed one). Kept
    on the model per drafter shape, slots, dtype, batch, thread count, device, model dtype and engine."""
    cfg, engine = draft.config, m.engine
    slots = slots or cfg.block_size
    key = (
        "dflash_pass",
        repr(cfg),
        slots,
        str(draft.fc.weight.dtype),
        batch,
        torch.get_num_threads(),
        str(m.device),
        str(m.dtype),
        engine.options if engine is not None else None,
    )
    if key not in m.measurements:
        device, dtype, ctx = m.device, draft.fc.weight.dtype, PROBE_CONTEXT
        net = engine.packed(draft) if engine is not None else draft
        context = ContextCache(m, net, batch, ctx + max(slots, WRITE_TOKENS))
        features = torch.randn(batch, ctx + WRITE_TOKENS, cfg.features_width, device=device, dtype=dtype)
        positions = torch.arange(ctx + max(slots, WRITE_TOKENS), device=device)[None].expand(batch, -1)
        on = torch.ones(batch, ctx + WRITE_TOKENS, dtype=torch.bool, device=device)
        context.write(features[:, :ctx], positions[:, :ctx], on[:, :ctx])
        noise = torch.randn(batch, slots, cfg.hidden_size, device=device, dtype=dtype)

        def block() -> None:
            context.cache.crop(ctx)
            context.run(noise, positions[:, ctx : ctx + slots])

        def write() -> None:
            context.cache.crop(ctx)
            span = slice(ctx, ctx + WRITE_TOKENS)
            context.write(features[:, span], positions[:, span], on[:, span])

        probes = {("dflash_pass",): block, ("dflash_write",): write, ("step",): plain_step(m, batch=batch)}
        found = interleaved_minima(probes, device, repeats, timer or timed)
        step = found[("step",)]
        m.measurements[key] = (found[("dflash_pass",)] / step, found[("dflash_write",)] / step)
    return m.measurements[key]


def build(s: Setup) -> DFlashProposer:
    """The proposer of the drafter ``s.cfg.drafter`` names."""
    draft = load_draft(s.cfg.drafter, s.m)
    slots = DFlashOptions.of(s.cfg).slots or draft.config.block_size
    pass_cost, write_cost = pass_costs(s.costs, s.m, draft, slots)
    return DFlashProposer(
        s.m, draft, s.cfg, costs=s.costs, slots=slots, pass_cost=pass_cost, write_cost=write_cost
    )


def offers(p: PlanInputs) -> list[Offer]:
    """The DFlash drafter given with the model (``PlanInputs.drafter``) when its directory records its
    acceptance (``acceptance.json``, drafter ``dflash``): a round of K drafts costs one pass over the whole
    block, the head over K slots and the verification (no K past the block's ``block_size - 1``); a round a
    chain's first stage drafted, the context write."""
    if p.drafter is None or not is_dflash_directory(p.drafter):
        return []
    record = read_record(p.drafter)
    found = record.find(NAME) if record is not None else []
    if not found:
        return []
    cfg = read_dflash_config(p.drafter)
    check_draft(cfg, p.m, p.drafter)
    pass_cost, write_cost = pass_costs(p.costs, p.m, load_draft(p.drafter, p.m), cfg.block_size)

    def round_cost(drafted: int) -> float:
        if drafted >= cfg.block_size:
            return math.inf
        return block_round_cost(p.costs, drafted, pass_cost, write_cost)

    options = {"drafter": str(p.drafter), "exit_layer": None, "adapter": None, "draft_vocab": None}
    d = found[0]
    return [
        Offer(
            NAME,
            options,
            d.acceptance,
            0.0,
            tokens_per_round=d.tokens_per_round,
            round_cost=round_cost,
            ride_cost=write_cost,
        )
    ]


KIND = ProposerKind(NAME, build, check=check, chainable=True, offers=offers)
generate = KIND.generate
