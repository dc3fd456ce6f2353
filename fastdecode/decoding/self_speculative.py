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
The draft loop, the acceptance rule and rollback are shared with ``assisted`` (``speculative.py``).

With an exit adapter (``decoder.adapter``, ``fastdecode/exit_adapter.py``; Kangaroo) the drafter's head reads
the adapter's output; E comes from the adapter, the adapter's attention has one more cache layer (filled at
prefill, rolled back with the rest), and verification still runs on the raw exit hidden states: lossless.
The adaptive policy's cost ratio then counts the heads (draft vocabulary included) and the adapter.
"""

from __future__ import annotations

import torch

from fastdecode.config import ConfigError
from fastdecode.decoding import speculative
from fastdecode.decoding.common import (
    DecodeConfig,
    DecodeOutput,
    Rows,
    check,
    choose,
    new_generator,
    prefill,
    refuse_draft_model,
)
from fastdecode.decoding.draft_vocab import draft_vocab_ids
from fastdecode.exit_adapter import adapter_for_decoding
from fastdecode.model import EarlyExitModel


@torch.inference_mode()
def generate(
    m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft: EarlyExitModel | None = None
) -> DecodeOutput:
    """Self-speculative decoding of ``prompts`` with the drafter = layers ``< cfg.exit_layer``; lossless."""
    check(cfg, m, prompts)
    refuse_draft_model("self_speculative", draft)
    # The adapter (None unless decoder.adapter is set) and the draft head's vocabulary subset (None: full head)
    adapter, vocab = adapter_for_decoding(cfg, m)
    if cfg.exit_layer is None and adapter is None:
        raise ConfigError(
            f"decoder 'self_speculative' needs decoder.exit_layer (the drafter's depth), "
            f"1 <= exit_layer <= {m.num_layers - 1}, or decoder.adapter (an exit adapter, which has its own)."
        )
    exit_layer, num_layers = adapter.exit_layer if adapter is not None else cfg.exit_layer, m.num_layers
    vocab = draft_vocab_ids(cfg.draft_vocab, m)  # None unless decoder.draft_vocab names a draft head subset
    width = max(len(p) for p in prompts)
    state = prefill(m, prompts, width + cfg.max_new_tokens + cfg.draft_tokens + 1, adapter=adapter)
    cache, positions = state.cache, state.positions
    cost_ratio = exit_layer / num_layers
    if adapter is not None:  # weights read per drafted token / per full step, heads and adapter counted
        head_rows = None if vocab is None else len(vocab)
        adapter_weights = adapter.num_parameters()
        cost_ratio = (m.step_cost(exit_layer, head_rows) + adapter_weights) / m.step_cost()
    policy = speculative.new_policy(cfg, cost_ratio=cost_ratio)
    generator = new_generator(cfg, m.device)
    drafter = speculative.Drafter(
        m, exit_layer, cache=cache, policy=policy, cfg=cfg, generator=generator, vocab=vocab, adapter=adapter
    )
    rows = Rows(len(prompts), cfg)
    out = DecodeOutput(tokens=rows.tokens)
    last = choose(state.logits, None, cfg, generator)  # the first new token comes from the full prefill
    rows.emit_tokens(last)
    while rows.active:
        live = rows.active
        active = rows.active_mask(m.device)
        limit = min(policy.draft_limit(), rows.most_remaining() - 1)  # the verifier adds one token itself
        start = cache.lengths[0]
        drafted = drafter.draft(last, positions, active, limit)
        k = drafted.tokens.shape[1]
        pos = (positions[:, None] + torch.arange(k + 1, device=m.device)).clamp(
            max=m.config.max_position_embeddings - 1
        )
        hidden = m.run_layers(drafted.hidden, exit_layer, num_layers, pos, cache=cache)
        verdict = speculative.accept(m.exit_logits(hidden), drafted, cfg, generator=generator)
        last = verdict.next_token
        kept = speculative.settle(
            rows, out, policy=policy, draft=drafted, verdict=verdict, caches=[cache], start=start
        )
        positions = positions + (kept + 1) * active
        adapted = 0 if adapter is None else k  # adapter passes (the backlog rides along with them)
        out.layers_run += ((k + 1) * num_layers + adapted) * len(live)
        out.layer_calls += (k + 1) * exit_layer + num_layers - exit_layer + adapted
    return out
