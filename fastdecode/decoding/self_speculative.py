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
adapter (``decoder.adapter``, ``fastdecode/exit_adapter.py``; Kangaroo) the drafter's head reads the adapter's
output over the adapter's own draft vocabulary; E comes from the adapter, the adapter's attention has one more
cache layer (filled at prefill, rolled back with the rest), and verification still runs on the raw exit
hidden states: lossless. With ``decoder.chain=true`` rows draft by prompt lookup where their text matches
(``ngram.py``) and through the exit elsewhere.
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.cost import cost_model
from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    check,
    configure_engine,
    new_generator,
    refuse_draft_model,
)
from fastdecode.decoding.ngram import ChainProposer, PromptLookupProposer
from fastdecode.decoding.proposers import ExitProposer, Proposer
from fastdecode.decoding.speculative import speculate
from fastdecode.exit_adapter import adapter_for_decoding
from fastdecode.model import EarlyExitModel


def exit_proposer(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, generator) -> Proposer:
    """The proposer ``cfg`` describes: the raw exit E or the exit adapter (with its own draft vocabulary),
    chained after prompt lookup with ``cfg.chain``."""
    # The adapter (None unless decoder.adapter is set) and the draft head's vocabulary: the adapter's own, or
    # decoder.draft_vocab for a raw exit (None: the full head)
    adapter, vocab = adapter_for_decoding(cfg, m)
    if cfg.exit_layer is None and adapter is None:
        raise ConfigError(
            f"decoder 'self_speculative' needs decoder.exit_layer (the drafter's depth), "
            f"1 <= exit_layer <= {m.num_layers - 1}, or decoder.adapter (an exit adapter, which has its own)."
        )
    exit_layer = adapter.exit_layer if adapter is not None else cfg.exit_layer
    costs = cost_model(m, cfg.costs)
    proposer = ExitProposer(m, exit_layer, cfg, generator, costs=costs, adapter=adapter, vocab=vocab)
    if cfg.chain:
        lookup = PromptLookupProposer(prompts, cfg, costs, m.vocab_size)
        return ChainProposer(lookup, proposer, judge_after=cfg.lookup.fallback_trial)
    return proposer


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Self-speculative decoding of ``prompts`` with the drafter = layers ``< cfg.exit_layer``; lossless."""
    check(cfg, m, prompts)
    refuse_draft_model("self_speculative", draft)
    configure_engine(m, cfg)  # the execution engine this call decodes on (the checks above change nothing)
    generator = new_generator(cfg, m.device)
    return speculate(m, prompts, cfg, exit_proposer(m, prompts, cfg, generator), generator=generator)
