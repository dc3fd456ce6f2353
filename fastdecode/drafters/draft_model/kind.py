"""Two-model speculative decoding (Leviathan et al. 2023; HF's ``assistant_model``): the ``assisted`` decoder.

A separate, smaller draft model with the target's tokenizer drafts in its own cache, and the target
verifies; lossless (greedy and sampling). This module owns the decoder's checks (a draft model is given and
fits the target's vocabulary, device and context; no exit layer) and builds its ``DraftModelProposer``
(``proposer.py``), priced by both models' cost models. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from fastdecode.config import ConfigError
from fastdecode.decoding.common import check_context
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.decoding.kinds import ProposerKind, Setup
from fastdecode.drafters.draft_model.proposer import DraftModelProposer
from fastdecode.plan.cost import cost_model
from fastdecode.runtime.model import EarlyExitModel


def check_draft(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None
) -> None:
    """Refuse a missing or incompatible draft model (and an exit layer, a draft vocabulary that does not
    fit it) before any work is done."""
    if draft is None:
        raise ConfigError(
            "decoder 'assisted' needs a draft model: pass draft=<EarlyExitModel> (a smaller model with the "
            "target's tokenizer), or use 'self_speculative' to draft with the target's own first layers."
        )
    if cfg.exit_layer is not None:
        raise ConfigError(
            f"decoder 'assisted' drafts with the whole draft model and verifies with the whole target, so "
            f"decoder.exit_layer={cfg.exit_layer} has no meaning here; set decoder.exit_layer=null (or use "
            "'self_speculative' to draft with the target's first exit_layer layers)."
        )
    if draft.vocab_size != m.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens but the target's has {m.vocab_size}: "
            "drafted ids would mean different tokens; use a draft model with the same tokenizer."
        )
    if draft.device != m.device:
        raise ConfigError(
            f"the draft model is on {draft.device} but the target on {m.device}; load both on one device."
        )
    longest = max((len(p) for p in prompts), default=0)
    context = draft.config.max_position_embeddings
    check_context(context, cfg.max_new_tokens, longest, "the longest prompt", "draft model")
    draft_vocab_ids(cfg.draft_vocab, draft)  # a draft vocabulary that does not fit the draft model


def build(s: Setup) -> DraftModelProposer:
    """The draft model's proposer, priced by both models' cost models at the call's batch size."""
    return DraftModelProposer(
        s.draft,
        s.cfg,
        s.generator,
        costs=s.costs,
        draft_costs=cost_model(s.draft, s.cfg.costs, batch=len(s.prompts)),
        vocab=draft_vocab_ids(s.cfg.draft_vocab, s.draft),  # None unless decoder.draft_vocab names a subset
        target=s.m,
    )


KIND = ProposerKind("assisted", build, check=check_draft, chainable=True, uses_draft_model=True)
generate = KIND.generate
