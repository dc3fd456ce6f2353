"""EAGLE-3 speculative decoding (Li et al., 2025): the ``eagle3`` decoder, where a trained one-layer head
drafts from the target's features and the target verifies; lossless (greedy and sampling).

This module owns the decoder's checks (``decoder.drafter`` names a head that fits the target, read before
its weights load), loads the head once per model and version of its files, prices a drafted token
(``head_token_cost``, ``measure_head``) and tells ``auto`` about a head whose directory records its
acceptance (``offers``). The proposer is ``proposer.Eagle3Proposer``. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.kinds import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.drafters.eagle3.files import CONFIG_FILE, WEIGHTS_FILE, load_eagle3, read_eagle3_config
from fastdecode.drafters.eagle3.model import FEATURES, Eagle3Config, Eagle3Head, check_aux_layer_ids
from fastdecode.drafters.eagle3.options import Eagle3Options
from fastdecode.drafters.eagle3.proposer import Eagle3Proposer, HeadRows
from fastdecode.files.drafter_dir import check_fit, drafter_needed, load_once
from fastdecode.files.file_cache import FileCache
from fastdecode.plan.acceptance import read_record
from fastdecode.plan.cost import PROBE_CONTEXT, CostModel, block_parameters, plain_step, timed
from fastdecode.plan.timing import Timer, interleaved_minima
from fastdecode.runtime.model import EarlyExitModel

NAME = "eagle3"
HEAD_REPEATS = 7  # timings of a drafted token; the least disturbed one counts
_LOADED = FileCache(maxsize=4)  # per model (owner), head files' version, device and dtype


def check_head(cfg: Eagle3Config, m: EarlyExitModel, path: str) -> None:
    """Refuse a head built for another target: its widths, vocabulary and feature layers must fit ``m``."""
    target = m.config
    where = f"decoder.drafter={path!r}"
    found = {
        "target hidden size": (cfg.target_hidden_size, target.hidden_size),
        "hidden size (the width of the target's embedding)": (cfg.hidden_size, target.hidden_size),
        "vocabulary size": (cfg.vocab_size, target.vocab_size),
    }
    check_fit(found, where, "an EAGLE-3 head")
    try:
        check_aux_layer_ids(cfg.aux_layer_ids, m.num_layers)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}; give a head trained for this model.") from err


def check(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    """A head directory is named and fits the model (read from its config, before any weights load)."""
    if cfg.drafter is None:
        raise drafter_needed("eagle3", "an EAGLE-3 head", "eagle3", "a speculators / SpecForge checkpoint")
    if Eagle3Options.of(cfg).tree and cfg.chain:
        raise ConfigError(
            "decoder.eagle3.tree=true drafts token trees, which a chain (decoder.chain=true) does not draft: "
            "set decoder.chain=false or decoder.eagle3.tree=false."
        )
    check_head(read_eagle3_config(cfg.drafter), m, cfg.drafter)


def load_head(path: str, m: EarlyExitModel) -> Eagle3Head:
    """The head in ``path`` on ``m``'s device and dtype, in eval mode; loaded once per model and version of
    its files. After ``check_head``."""

    return load_once(_LOADED, path, [CONFIG_FILE, WEIGHTS_FILE], m, read=load_eagle3, check=check_head)


def head_token_cost(costs: CostModel, m: EarlyExitModel, head: Eagle3Head) -> float:
    """One drafted token (a head forward, its draft-vocabulary softmax and argmax), in plain decoding steps:
    with a measured cost model, timed on the model against a plain step timed in the same measurement
    (``measure_head``; never over ``costs.step_seconds``, which another session may have timed), else by
    weights read: the layer and ``fc`` as blocks of the target, the ``lm_head`` as the target's head over the
    draft vocabulary's rows."""
    if costs.source == "measured":
        return measure_head(m, head, batch=costs.batch)
    layer = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("lm_head"))
    return costs.draft_token(
        0, head_rows=head.config.draft_vocab_size, extra_blocks=layer / block_parameters(m)
    )


@torch.inference_mode()
def measure_head(
    m: EarlyExitModel,
    head: Eagle3Head,
    *,
    batch: int = 1,
    repeats: int = HEAD_REPEATS,
    timer: Timer | None = None,
) -> float:
    """One drafted token as ``Eagle3Proposer`` drafts it, in plain decoding steps of the target: a row added
    to ``HeadRows`` (the head run as the model's engine runs linears) attending to ``PROBE_CONTEXT`` earlier
    rows, then its argmax over the draft vocabulary mapped to a target id, over the target's plain step of
    ``batch`` rows (``plain_step``), both timed here, interleaved (``interleaved_minima``: the least of
    ``repeats`` rounds after an untimed one), so the ratio compares timings of one session. Kept on the model
    per head shape, dtype, batch, thread count, device, model dtype and engine (the weights' values do not
    change it)."""
    cfg, engine = head.config, m.engine
    key = (
        "eagle3_draft",
        repr(cfg),
        str(head.fc.weight.dtype),
        batch,
        torch.get_num_threads(),
        str(m.device),
        str(m.dtype),
        engine.options if engine is not None else None,
    )
    if key not in m.measurements:
        device, dtype, context = m.device, head.fc.weight.dtype, PROBE_CONTEXT
        rows = HeadRows(m, head, batch, context + 1)
        features = torch.randn(batch, context, FEATURES * cfg.target_hidden_size, device=device, dtype=dtype)
        tokens = torch.randint(cfg.vocab_size, (batch, context + 1), device=device)
        positions = torch.arange(context + 1, device=device)[None].expand(batch, -1)
        on = torch.ones(batch, context + 1, dtype=torch.bool, device=device)
        _, hidden = rows.add(tokens[:, :context], features, positions[:, :context], on[:, :context])

        def draft() -> None:
            logits, _ = rows.add(tokens[:, context:], hidden[:, -1:], positions[:, context:], on[:, context:])
            rows.crop(context)
            head.draft_to_target(logits[:, -1].argmax(-1))

        probes = {("eagle3_draft",): draft, ("step",): plain_step(m, batch=batch)}
        found = interleaved_minima(probes, device, repeats, timer or timed)
        m.measurements[key] = found[("eagle3_draft",)] / found[("step",)]
    return m.measurements[key]


def build(s: Setup) -> Eagle3Proposer:
    """The proposer of the head ``s.cfg.drafter`` names."""
    head = load_head(s.cfg.drafter, s.m)
    cost = head_token_cost(s.costs, s.m, head)
    return Eagle3Proposer(s.m, head, s.cfg, s.generator, costs=s.costs, head_cost=cost)


def offers(p: PlanInputs) -> list[Offer]:
    """The head given with the model (``PlanInputs.drafter``) when its directory records its acceptance."""
    if p.drafter is None:
        return []
    record = read_record(p.drafter)
    found = record.find(NAME) if record is not None else []
    if not found:
        return []
    cfg = read_eagle3_config(p.drafter)
    check_head(cfg, p.m, p.drafter)
    token = head_token_cost(p.costs, p.m, load_head(p.drafter, p.m))
    options = {"drafter": str(p.drafter), "exit_layer": None, "adapter": None, "draft_vocab": None}
    d = found[0]  # a round of k drafts: k head passes (``Eagle3Proposer.round_cost``) and the verification;
    # a round prompt lookup drafted in a chain: one head pass (``Eagle3Proposer.ride_cost``)
    return [Offer(NAME, options, d.acceptance, token, 0, None, d.tokens_per_round, ride_cost=token)]


KIND = ProposerKind(NAME, build, check=check, chainable=True, offers=offers)
generate = KIND.generate
