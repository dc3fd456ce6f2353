"""The DFlash loss as pure functions on tiny tensors: anchors on response tokens only, same-position labels (not
shifted by one), slot 0 never scored, labels never past the response, the decay weights, CE and KL and their
normalisation, the per-slot metrics; and the strict context mask, through the module."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.losses import (
    anchor_candidates,
    anchor_positions,
    anchor_weight_sum,
    block_inputs,
    block_metrics,
    decay_weights,
    dflash_loss,
    slot_weights,
)
from dflash_train.module import DFlashLM, collate_records
from fastdecode.drafters.dflash.layer import DFlashDraft
from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.tokens import IGNORE_INDEX
from tests.helpers import tiny_model

MASK = 99


def response_of(width: int, spans: list[tuple[int, int]], rows: int = 1) -> torch.Tensor:
    out = torch.zeros(rows, width, dtype=torch.bool)
    for start, stop in spans:
        out[:, start:stop] = True
    return out


def test_anchors_are_response_tokens_followed_by_one_sorted_distinct_and_padded():
    response = torch.zeros(3, 12, dtype=torch.bool)
    response[0, 4:12] = True  # candidates 4..10 (7)
    response[1, 2:5] = True  # candidates 2, 3
    response[2, 6] = True  # a lone response token: no candidate
    anchors, keep = anchor_positions(response, 5, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 5)
    assert keep.sum(1).tolist() == [5, 2, 0]
    for row in range(3):
        chosen = anchors[row][keep[row]].tolist()
        assert chosen == sorted(set(chosen))
        assert all(response[row, a] and response[row, a + 1] for a in chosen)
    assert anchors[1][keep[1]].tolist() == [2, 3]
    # the last response token is never an anchor (nothing after it to draft), nor is a position past the row
    assert not anchor_candidates(response)[0, 11] and anchor_candidates(response)[0].sum() == 7
    wide, _ = anchor_positions(response, 50)
    assert wide.shape[1] == 7  # N = the most candidates of a row, not num_anchors


def test_anchors_of_a_row_depend_on_its_own_generator_only():
    response = response_of(16, [(3, 16)], rows=2)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    both, _ = anchor_positions(response, 4, gens)
    alone, _ = anchor_positions(response[1:], 4, [torch.Generator().manual_seed(2)])
    assert torch.equal(both[1], alone[0])
    with pytest.raises(ValueError, match="one per row"):
        anchor_positions(response, 4, gens[:1])


def test_block_labels_are_same_position_and_slot_0_is_never_scored():
    ids = torch.arange(100, 112)[None]  # token at position p is 100 + p
    response = response_of(12, [(3, 12)])
    anchors, keep = torch.tensor([[4]]), torch.tensor([[True]])
    b = block_inputs(ids, anchors, keep, response, block=4, mask_token_id=MASK)
    assert b["tokens"].tolist() == [[104, MASK, MASK, MASK]]  # the anchor's own token, then masks
    assert b["positions"].tolist() == [[4, 5, 6, 7]]
    # slot k is labelled by the token AT anchor + k (its hidden drafts that token), not anchor + k + 1
    assert b["labels"].tolist() == [[IGNORE_INDEX, 105, 106, 107]]
    assert b["valid"].tolist() == [[False, True, True, True]]
    w = slot_weights(b["valid"], 4, 2.0)
    assert w[0, 0] == 0 and w[0, 1:].tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])


def test_labels_stop_at_the_end_of_the_response_and_at_a_gap():
    ids = torch.arange(100, 110)[None]
    # positions 2..5 and 8..9 are response; 6, 7 another turn
    response = response_of(10, [(2, 6), (8, 10)])
    anchors, keep = torch.tensor([[4, 8]]), torch.tensor([[True, True]])
    b = block_inputs(ids, anchors, keep, response, block=4, mask_token_id=MASK)
    labels = b["labels"].view(2, 4).tolist()
    assert labels[0] == [IGNORE_INDEX, 105, IGNORE_INDEX, IGNORE_INDEX]  # 6 is not a response token
    assert labels[1] == [IGNORE_INDEX, 109, IGNORE_INDEX, IGNORE_INDEX]  # 10, 11 are past the row
    assert b["label_pos"].max() <= 9
    padded = block_inputs(ids, anchors, torch.tensor([[True, False]]), response, block=4, mask_token_id=MASK)
    assert not padded["valid"].view(2, 4)[1].any()  # a padded block scores nothing


def test_decay_weights_and_the_weight_sum_the_trainer_divides_by():
    assert decay_weights(5, 7.0).tolist() == pytest.approx(
        [0, 1, math.exp(-1 / 7), math.exp(-2 / 7), math.exp(-3 / 7)]
    )
    response = response_of(20, [(5, 18)], rows=2)
    response[1, 14:] = False
    anchors, keep = anchor_positions(response, 6, torch.Generator().manual_seed(3))
    ids = torch.randint(0, 50, (2, 20))
    b = block_inputs(ids, anchors, keep, response, block=4, mask_token_id=MASK)
    total = anchor_weight_sum(anchors, keep, response, block=4, gamma=3.0)
    assert float(total) == pytest.approx(float(slot_weights(b["valid"], 4, 3.0).sum()))


def test_ce_kl_both_and_the_normalisation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen)
    labels = torch.randint(0, 11, (5,), generator=gen)
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0, 0.0])
    s, w = dflash_loss(logits, weights, kind="ce", labels=labels)
    ce = F.cross_entropy(logits, labels, reduction="none")
    assert float(w) == pytest.approx(3.75) and float(s) == pytest.approx(
        float((weights * ce).sum()), rel=1e-6
    )
    assert float(s / w) == pytest.approx(float((weights * ce).sum() / weights.sum()), rel=1e-6)
    same = torch.log_softmax(logits, -1)
    assert float(dflash_loss(logits, weights, kind="kl", target_logp=same)[0]) == pytest.approx(0.0, abs=1e-5)
    other = torch.log_softmax(torch.randn(5, 11, generator=gen), -1)
    kl = (other.exp() * (other - same)).sum(-1)
    s_kl, _ = dflash_loss(logits, weights, kind="kl", target_logp=other)
    assert float(s_kl) == pytest.approx(float((weights * kl).sum()), rel=1e-5) and float(s_kl) > 0
    rows = torch.tensor([0, 2, 2, 1, 0])  # slots sharing a label position share the target's row
    shared, _ = dflash_loss(logits, weights, kind="kl", target_logp=other[:3], target_rows=rows)
    assert float(shared) == pytest.approx(
        float(dflash_loss(logits, weights, kind="kl", target_logp=other[rows])[0])
    )
    s_both, _ = dflash_loss(logits, weights, kind="both", labels=labels, target_logp=other)
    assert float(s_both) == pytest.approx(float(s + s_kl), rel=1e-6)
    with pytest.raises(ValueError, match="needs labels"):
        dflash_loss(logits, weights, kind="ce")


def test_block_metrics_count_leading_matches_per_block():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, 7, IGNORE_INDEX, 8, 9, IGNORE_INDEX]])
    valid = labels != IGNORE_INDEX
    drafts = torch.tensor(
        [[-1, 5, 0, 7, -1, 8, 9, -1]]
    )  # block 0: 1 leading match; block 1: 2 (then the end)
    out = block_metrics(drafts, labels, valid, 4)
    assert float(out["acc_1"]) == 1.0 and float(out["acc_2"]) == 0.5 and float(out["acc_3"]) == 1.0
    assert float(out["accept_len"]) == pytest.approx(1 + (1 + 2) / 2)


def tiny_lm(block: int = 4) -> DFlashLM:
    model = tiny_model("tiny-llama")[0]
    cfg = DFlashConfig.from_target(model.config, mask_token_id=3, target_layer_ids=[0, 2], block_size=block)
    torch.manual_seed(0)
    return DFlashLM(
        EarlyExitModel(model), DFlashDraft(cfg), {"kind": "ce", "gamma": 4.0, "num_anchors": 4, "seed": 0}
    )


def record(n_prompt: int, n_answer: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    length = n_prompt + n_answer - 1
    tokens = torch.randint(5, 200, (n_prompt + n_answer,), generator=gen).int()
    return {
        "input_ids": tokens[:-1],
        "scored": torch.arange(n_prompt - 1, length).int(),
        "targets": tokens[n_prompt:],
        "teacher": tokens[n_prompt:],
        "h1": torch.randn(length, 64, generator=gen),
        "h3": torch.randn(length, 64, generator=gen),
    }


@torch.no_grad()
def test_a_block_sees_the_context_strictly_before_its_anchor_and_never_the_padding():
    """Features at the anchor and after it (and the zeros padding a shorter row) change nothing; one before it
    changes the block: ``< anchor``, not ``<=``."""
    lm = tiny_lm().eval()
    batch = collate_records([record(4, 9, 0), record(3, 5, 1)], [1, 3])  # row 1 is padded to row 0's width
    anchors, keep = torch.tensor([[6, 8], [4, 5]]), torch.ones(2, 2, dtype=torch.bool)
    blocks = block_inputs(batch["input_ids"], anchors, keep, batch["response"], block=4, mask_token_id=3)

    def hidden(features):
        return lm.hidden_states(batch["input_ids"], features, blocks, anchors, keep)

    base = hidden(batch["features"])
    later = batch["features"].clone()
    later[0, 8:] += 5.0  # row 0: at and after block 1's anchor (8)
    later[1, 5:] += 5.0  # row 1: at its block 1's anchor (5), after it, and the padding past its 7 features
    assert torch.equal(hidden(later), base)
    earlier = batch["features"].clone()
    earlier[0, 7] += 5.0  # just before anchor 8: block 1 sees it, block 0 (anchor 6) does not
    moved = hidden(earlier)
    assert torch.equal(moved[0, :4], base[0, :4]) and not torch.allclose(moved[0, 4:], base[0, 4:])
