"""The EAGLE-3 training-time test loss (eagle3_train/losses.py) on tiny random heads: target distributions over
the draft vocabulary, (sum, count) normalisation, the unroll's alignment against a by-hand chain rollout,
gradients and the prev_correct option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3_train.losses import (
    shift_ahead,
    step_loss,
    target_draft_argmax,
    target_draft_distribution,
    ttt_loss,
    ttt_unroll,
)
from fastdecode.drafters.eagle3.layer import Eagle3KV
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.tokens import IGNORE_INDEX
from tests.helpers import eagle3_reduction, kernel_tolerance

H, VOCAB, DRAFT = 32, 64, 40
KEPT = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT].tolist())


def random_head(seed: int = 0) -> Eagle3Head:
    """A head with every parameter random (norms around 1) and the draft vocabulary ``KEPT``."""
    cfg = Eagle3Config(
        hidden_size=H,
        target_hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT,
        aux_layer_ids=[2, 4, 5],
        rope_theta=5000.0,
    )
    head = Eagle3Head(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    head.set_draft_vocab(KEPT)
    return head.eval()


def make_batch(b: int = 2, t: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    """A target-aligned batch (eagle3_train/losses.py's docstring) of random tensors."""
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(b, t, generator=gen) > 0.2
    return {
        "input_ids": torch.randint(VOCAB, (b, t), generator=gen),
        "embeds": torch.randn(b, t, H, generator=gen),
        "features": torch.randn(b, t, 3 * H, generator=gen),
        "target_logits": 3 * torch.randn(b, t, VOCAB, generator=gen),
        "loss_mask": loss_mask,
    }


def unroll_inputs(b: int = 2, t: int = 6, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(1, t + 1).expand(b, t)
    return torch.randn(b, t, H, generator=gen), torch.randn(b, t, 3 * H, generator=gen), pos


def test_the_draft_distribution_is_the_renormalised_target():
    head = random_head()
    logits = 3 * torch.randn(2, 5, VOCAB)
    logp = target_draft_distribution(logits, head.t2d)
    assert logp.shape == (2, 5, DRAFT)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 5))
    full = logits.softmax(-1)[..., KEPT]
    torch.testing.assert_close(logp.exp(), full / full.sum(-1, keepdim=True))
    # column d is draft id d: the head's lm_head row d scores target id draft_to_target(d)
    assert head.draft_to_target(torch.arange(DRAFT)).tolist() == KEPT


def test_the_target_argmax_maps_to_draft_ids_or_is_ignored():
    head = random_head()
    outside = next(i for i in range(VOCAB) if i not in KEPT)
    logits = torch.randn(1, 3, VOCAB)
    logits[0, 0, KEPT[5]] = 50.0
    logits[0, 1, outside] = 50.0
    logits[0, 2, KEPT[-1]] = 50.0
    ids = target_draft_argmax(logits, head.t2d)
    assert ids.tolist() == [[5, IGNORE_INDEX, DRAFT - 1]]
    assert head.draft_to_target(ids[0, [0, 2]]).tolist() == [KEPT[5], KEPT[-1]]


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_sums_and_counts_over_micro_batches_give_the_big_batch_mean(kind):
    gen = torch.Generator().manual_seed(4)
    draft = torch.randn(4, 5, DRAFT, generator=gen)
    target_logits = 3 * torch.randn(4, 5, VOCAB, generator=gen)
    t2d = random_head().t2d
    target = (target_draft_argmax if kind == "ce" else target_draft_distribution)(target_logits, t2d)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    parts = [step_loss(draft[s], target[s], mask[s], kind) for s in (slice(0, 1), slice(1, 4))]
    accumulated = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    scored = mask & (target != IGNORE_INDEX) if kind == "ce" else mask
    if kind == "ce":
        expected = F.cross_entropy(draft[scored], target[scored])
    else:
        expected = F.kl_div(
            draft[scored].log_softmax(-1), target[scored], log_target=True, reduction="batchmean"
        )
    torch.testing.assert_close(accumulated, expected)
    head, batch = random_head(), make_batch(b=3)
    whole = ttt_loss(head, batch, kind=kind)
    halves = [
        ttt_loss(head, {k: v[s] for k, v in batch.items()}, kind=kind) for s in (slice(0, 1), slice(1, 3))
    ]
    torch.testing.assert_close(whole[0] / whole[1], sum(h[0] for h in halves) / sum(h[1] for h in halves))


def test_kl_is_zero_when_the_head_matches_the_target():
    head, batch = random_head(), make_batch()
    logp = target_draft_distribution(batch["target_logits"], head.t2d)
    s, n = step_loss(logp, logp, batch["loss_mask"], "kl")
    # log q = log p - logsumexp(log p): zero but for that sum over the draft vocabulary, per position
    per_position = kernel_tolerance(torch.float32, 2 * DRAFT, 1.0)["atol"]
    assert n == int(batch["loss_mask"].sum()) and abs(float(s)) <= n * per_position
    with torch.no_grad():  # the target at position t + 1 = the head's step 0 at row t, plus anything outside
        step0 = ttt_unroll(
            head, batch["embeds"][:, 1:], batch["features"][:, :-1], torch.arange(1, 7)[None], steps=1
        )
        batch["target_logits"][:, 1:, head.t2d] = step0[0]
        loss, count, metrics = ttt_loss(head, batch, steps=1)
    # the head's logits in two batch layouts differ by rounding (delta): the KL is zero to first order in
    # delta, so what is left is the log-softmax's sum (as above) and delta squared, per position
    largest = float(step0[0].abs().max())
    delta = kernel_tolerance(torch.float32, eagle3_reduction(head.config, 7), largest)["atol"]
    per_position += delta**2
    assert count > 0 and abs(float(loss)) <= count * per_position and metrics["loss_0"] <= per_position
    batch["target_logits"][:, 2:, head.t2d] += 0.5 * torch.randn(2, 5, DRAFT)
    assert float(ttt_loss(head, batch, steps=1)[0].detach()) > 1e-2


def test_step_zero_is_a_plain_forward():
    head = random_head()
    embeds, features, pos = unroll_inputs()
    with torch.no_grad():
        steps = ttt_unroll(head, embeds, features, pos, steps=3)
        plain, _ = head(embeds, features, pos)
    assert len(steps) == 3 and all(s.shape == (2, 6, DRAFT) for s in steps)
    torch.testing.assert_close(steps[0], plain)


def test_a_row_depends_only_on_earlier_rows_and_its_own_chain():
    head = random_head()
    embeds, features, pos = unroll_inputs()
    p, steps = 4, 3
    with torch.no_grad():
        base = ttt_unroll(head, embeds, features, pos, steps=steps)
        later_features = features.clone()
        later_features[:, p] += 1.0
        moved = ttt_unroll(head, embeds, later_features, pos, steps=steps)
        later_embeds = embeds.clone()
        later_embeds[:, p] += 1.0
        shifted = ttt_unroll(head, later_embeds, features, pos, steps=steps)
    for k in range(steps):
        torch.testing.assert_close(moved[k][:, :p], base[k][:, :p])
        assert not torch.allclose(moved[k][:, p], base[k][:, p])
        # step k reads the embedding k rows ahead: row p - k is the first one to change
        torch.testing.assert_close(shifted[k][:, : p - k], base[k][:, : p - k])
        assert not torch.allclose(shifted[k][:, p - k], base[k][:, p - k])


def test_each_step_equals_a_chain_rollout_by_hand():
    """Row t at step k = the head run k + 1 times by hand for that row alone, as a proposer drafts: step 0
    over rows 0..t (causal), then one position per step with its own embedding k rows ahead, position + k,
    the previous output hidden state and every key written so far (the default mask, no TTT mask)."""
    head = random_head()
    embeds, features, pos = unroll_inputs(t=6)
    steps = 3
    with torch.no_grad():
        unrolled = ttt_unroll(head, embeds, features, pos, steps=steps)
        # one row at a time against the batch: sums in other orders, compounding over the chain's steps
        largest = max(float(step.abs().max()) for step in unrolled)
        tol = kernel_tolerance(torch.float32, steps * eagle3_reduction(head.config, 6 + steps), largest)
        for t in range(6):
            kv = Eagle3KV()
            logits, hidden = head(embeds[:, : t + 1], features[:, : t + 1], pos[:, : t + 1], kv)
            torch.testing.assert_close(unrolled[0][:, t], logits[:, t], **tol)
            hidden = hidden[:, t : t + 1]
            for k in range(1, min(steps, 6 - t)):
                logits, hidden = head(embeds[:, t + k : t + k + 1], hidden, pos[:, t : t + 1] + k, kv)
                torch.testing.assert_close(unrolled[k][:, t], logits[:, 0], **tol)


def test_gradients_reach_the_head_and_not_the_target_inputs():
    head, batch = random_head().train(), make_batch()
    batch["embeds"].requires_grad_(True)
    batch["features"].requires_grad_(True)
    loss, count, _ = ttt_loss(head, batch)
    (loss / count).backward()
    for name in (
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        grad = head.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert batch["embeds"].grad is None and batch["features"].grad is None


def test_prev_correct_scores_a_step_only_after_correct_earlier_steps():
    head, batch = random_head(), make_batch(t=8)
    rows = 7
    with torch.no_grad():
        logits = ttt_unroll(
            head, batch["embeds"][:, 1:], batch["features"][:, :-1], torch.arange(1, 8)[None], steps=2
        )
    guess = logits[0].argmax(-1)  # [B, rows]
    right = torch.arange(rows).expand(2, rows) % 3 != 1  # the target at position i + 1 agrees on these rows
    wanted = torch.where(right, guess, (guess + 1) % DRAFT)
    batch["target_logits"][:, 1:].scatter_(-1, head.draft_to_target(wanted)[..., None], 100.0)
    plain = ttt_loss(head, batch, steps=2)
    masked = ttt_loss(head, batch, steps=2, prev_correct=True)
    assert plain[2]["acc_0"] == masked[2]["acc_0"] < 1.0 and plain[1] == masked[1]
    valid1 = shift_ahead(batch["loss_mask"], 3, rows, False)
    assert plain[2]["count_1"] == int(valid1.sum())
    assert masked[2]["count_1"] == int((valid1 & right).sum()) < plain[2]["count_1"]
    step0, _ = step_loss(
        logits[0],
        shift_ahead(target_draft_distribution(batch["target_logits"], head.t2d), 1, rows),
        shift_ahead(batch["loss_mask"], 2, rows, False),
        "kl",
    )
    step1, _ = step_loss(
        logits[1],
        shift_ahead(target_draft_distribution(batch["target_logits"], head.t2d), 2, rows),
        valid1 & right,
        "kl",
    )
    torch.testing.assert_close(masked[0], step0 + 0.8 * step1)


def test_bad_inputs_are_refused():
    head, batch = random_head(), make_batch()
    with pytest.raises(ValueError, match="loss kind"):
        ttt_loss(head, batch, kind="jsd")
    with pytest.raises(ValueError, match="ttt steps"):
        ttt_loss(head, batch, steps=0)
    targets = torch.tensor(list(reversed(KEPT)))
    head.d2t.copy_(targets - torch.arange(DRAFT))
    with pytest.raises(ValueError, match="ascending target-id order"):
        ttt_loss(head, batch)


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_precomputed_targets_give_the_same_loss(kind):
    head, batch = random_head(), make_batch()
    logits = batch.pop("target_logits")
    with pytest.raises(KeyError, match="target_logits"):
        ttt_loss(head, batch)
    batch["target_logp"] = target_draft_distribution(logits, head.t2d)
    batch["target_ids"] = target_draft_argmax(logits, head.t2d)
    with torch.no_grad():
        given = ttt_loss(head, batch, kind=kind)
        computed = ttt_loss(head, {**batch, "target_logits": logits}, kind=kind)
    torch.testing.assert_close(given[0], computed[0])
    assert given[1:] == computed[1:]
