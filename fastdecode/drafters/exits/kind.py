"""LayerSkip self-speculative decoding: draft with layers ``< E`` through the shared exit head, verify with
layers ``>= E`` on the stored exit hidden states, over ONE KV cache.

One round, with ``t`` the last accepted token (not yet in the cache) at position ``p``::

    draft:   t, d1, .., d_{k-1} through layers < E, one at a time -> exit hidden states h_0..h_{k-1}, drafts
             d1..dk from the exit head; then d_k through layers < E -> h_k (it was never fed back)
    verify:  layers >= E over [h_0..h_k] (k+1 positions) -> verifier logits at every draft position
    accept:  per row a_b drafts (greedy prefix match, or the lossless sampling rule), plus one token from
             the verifier (correction or bonus)

Each token passes each layer exactly once: the layer-``< E`` KV written while drafting is exactly what the
full model writes, so it is kept (rejected drafts pass every layer once too: verification needs them).
Rollback is a length pointer: crop every layer to the longest accepted length in the batch; rows that
accepted fewer leave holes (``key_valid`` False) that attention masks exactly, so greedy output is
bit-identical to ``autoregressive`` in fp32. Sliding windows count positions across holes (``KVCache.key_pos``).

This is the speculative loop (``speculative.py``) over an ``ExitProposer`` (``proposers.py``). With an exit
adapter (``decoder.adapter``, ``fastdecode/drafters/exits/adapter.py``; Kangaroo) the drafter's head reads the adapter's
output over the adapter's own draft vocabulary; E comes from the adapter, the adapter's attention has one more
cache layer (filled at prefill, rolled back with the rest), and verification still runs on the raw exit
hidden states: lossless. With ``decoder.chain=true`` rows draft by prompt lookup where their text matches
(``ngram.py``) and through the exit elsewhere.

``offers`` tells ``auto`` (``fastdecode/plan/choose.py``) what it may plan with: every exit the checkpoint's
``acceptance.json`` records, with the full head and with the draft vocabulary, and the exit adapter, each
priced on this machine.
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
