"""LayerSkip self-speculative decoding (the ``self_speculative`` decoder): layers ``< E`` and the shared exit
head draft, layers ``>= E`` verify on the stored exit hidden states, over one KV cache; lossless.

This module owns the decoder's checks (an exit E, or an exit adapter from ``decoder.adapter``), builds its
``ExitProposer`` (``proposer.py``) and offers ``auto`` (``fastdecode/plan/choose.py``) every exit that the
checkpoint's ``acceptance.json`` records and the exit adapter given with the model, each priced on this
machine. Design notes: docs/design/drafters.md.
"""

from __future__ import annotations

from fastdecode.config import ConfigError
from fastdecode.decoding.config import DecodeConfig
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.decoding.kinds import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.drafters.exits.adapter import adapter_for_decoding, load_adapter
from fastdecode.drafters.exits.proposer import ExitProposer
from fastdecode.drafters.exits.record import recorded_adapter
from fastdecode.plan.cost import exit_draft_cost
from fastdecode.runtime.model import EarlyExitModel


def check_exit(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    """The drafter ``cfg`` names exists: an exit E, or an exit adapter (loaded and checked against ``m``,
    with its draft vocabulary; a raw exit's ``decoder.draft_vocab`` too)."""
    adapter, _ = adapter_for_decoding(cfg, m)
    if cfg.exit_layer is None and adapter is None:
        raise ConfigError(
            f"decoder 'self_speculative' needs decoder.exit_layer (the drafter's depth), "
            f"1 <= exit_layer <= {m.num_layers - 1}, or decoder.adapter (an exit adapter, which has its own)."
        )


def build(s: Setup) -> ExitProposer:
    """The raw exit E or the exit adapter (with its own draft vocabulary) of ``s.cfg``."""
    adapter, vocab = adapter_for_decoding(s.cfg, s.m)  # loaded once per model and file version
    exit_layer = adapter.exit_layer if adapter is not None else s.cfg.exit_layer
    return ExitProposer(s.m, exit_layer, s.cfg, s.generator, costs=s.costs, adapter=adapter, vocab=vocab)


def offers(p: PlanInputs) -> list[Offer]:
    """Every exit the checkpoint records (full head, or its draft vocabulary), and the exit adapter given with
    the model, each with the options that draft through exactly it and its cost on this machine."""
    found = []
    for d in p.record.find("exit") if p.record is not None else []:
        vocab_file = p.record.path_of(d.draft_vocab)
        vocab = draft_vocab_ids(vocab_file, p.m) if vocab_file else None
        token = exit_draft_cost(p.costs, p.m, d.exit_layer, vocab=vocab)
        options = {"exit_layer": d.exit_layer, "adapter": None, "draft_vocab": vocab_file}
        name = "exit" if vocab is None else "exit (draft vocabulary)"
        found.append(
            Offer(name, options, d.acceptance, token, d.exit_layer, d.exit_layer, d.tokens_per_round)
        )
    if p.adapter is not None:
        recorded = recorded_adapter(p.adapter)
        token = 0.0
        if recorded.agreement is not None:  # else nothing to weigh the cost against
            adapter, _, vocab = load_adapter(recorded.path, p.m)
            token = exit_draft_cost(p.costs, p.m, recorded.exit_layer, adapter=adapter, vocab=vocab)
        options = {"exit_layer": None, "adapter": recorded.path, "draft_vocab": None}
        found.append(
            Offer(
                "adapter",
                options,
                recorded.agreement,
                token,
                recorded.exit_layer,
                recorded.exit_layer,
                recorded.tokens_per_round,
            )
        )
    return found


KIND = ProposerKind("self_speculative", build, check=check_exit, chainable=True, offers=offers)
generate = KIND.generate
