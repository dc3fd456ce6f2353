"""CLLM core: consistency and AR losses, state draws, examples and batches, the training module's forwards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cllm_train.config import CLLMConfig
from cllm_train.dataset import build_examples, collate, draw_states, state_uniforms
from cllm_train.losses import ar_loss, consistency_loss, consistency_positions
from cllm_train.module import ConsistencyLM
from fastdecode.config import ConfigError
from fastdecode.tokens import next_token_targets
from tests.helpers import gradient_tolerance, kernel_tolerance, model_tolerance, synthetic_records


def _cfg(**kw) -> CLLMConfig:
    return CLLMConfig(trajectories="unused", **kw)


def _batch(cfg: CLLMConfig, records: list[dict] | None = None) -> dict:
    records = records or [r for r in synthetic_records(12) if len(r["states"]) >= 3][:3]
    return collate(build_examples(records, cfg), pad_id=0, ar_from_teacher=cfg.ar_target == "fixed_point")


# --------------------------------------------------------------------------------------------------------
# Losses
def test_consistency_loss_is_zero_when_student_equals_teacher():
    student = torch.randn(2, 6, 11, requires_grad=True)
    term = consistency_loss(student, student.detach().clone())
    term.loss.backward()
    # the same log-softmax of the same values on both sides: log p - log q is exactly zero
    assert term.loss.item() == 0 and term.count == 12
    # at agreement the gradient vanishes too: (q * sum(p) - p) / 12, off zero by the sum over the 11 classes
    # and the exponentials of the log-probabilities (a few ulps each), terms p / 12 <= 1 / 12
    tol = kernel_tolerance(torch.float32, 2 * 11, 1 / 12)
    assert student.grad.abs().max() <= tol["atol"]


def test_consistency_loss_matches_a_naive_loop_of_the_reference_formula():
    """cllm.md: mean over K of -sum_v softmax(sg(teacher))_v log_softmax(student)_v (minus the constant
    teacher entropy in ours): same gradient, and value = soft cross-entropy - entropy."""
    torch.manual_seed(0)
    batch, prefix_w, n, vocab = 3, 5, 4, 13
    width = prefix_w + n
    student = torch.randn(batch, width, vocab, requires_grad=True)
    teacher = torch.randn(batch, width, vocab)
    mismatch, block_len = torch.tensor([0, 2, 3]), torch.tensor([4, 4, 3])
    ours = consistency_loss(student, teacher, consistency_positions(mismatch, block_len, prefix_w, width))
    ce = entropy = 0.0
    count = 0
    for b in range(batch):
        for p in range(prefix_w + int(mismatch[b]) - 1, prefix_w + int(block_len[b]) - 1):
            probs = F.softmax(teacher[b, p], -1)
            ce = ce - (probs * F.log_softmax(student[b, p], -1)).sum()
            entropy = entropy - (probs * probs.log()).sum()
            count += 1
    assert count == ours.count == 4 + 2 + 0
    # two formulas: each position sums over the vocabulary (softmax, log-softmax, the KL), then the mean
    expected = (ce - entropy) / count
    torch.testing.assert_close(
        ours.loss, expected, **kernel_tolerance(torch.float32, 3 * vocab + count, float(ce / count))
    )
    grad_ours = torch.autograd.grad(ours.loss, student)[0]
    grad_ref = torch.autograd.grad(ce / count, student)[0]
    torch.testing.assert_close(grad_ours, grad_ref, **kernel_tolerance(torch.float32, 2 * vocab, 1 / count))


def test_positions_skip_the_prefix_the_correct_tokens_and_the_padding():
    # row 0: prefix 3 (left pad 2), n=4, m=1; row 1: prefix 5, n=3 (block pad 1), m=0; row 2: at its fixed point
    mask = consistency_positions(torch.tensor([1, 0, 4]), torch.tensor([4, 3, 4]), block_start=5, width=9)
    assert mask[0].nonzero().flatten().tolist() == [5, 6, 7]  # predictions of block tokens 1..3
    assert mask[1].nonzero().flatten().tolist() == [4, 5, 6]  # last prefix token predicts block token 0
    assert not mask[2].any()
    student = torch.randn(3, 9, 7)
    teacher = torch.randn(3, 9, 7)
    before = consistency_loss(student, teacher, mask).loss
    student[~mask] = torch.randn_like(student[~mask])  # prefix, correct tokens, pads: nothing changes
    assert consistency_loss(student, teacher, mask).loss == before


def test_teacher_gets_no_gradient_from_the_loss():
    student = torch.randn(4, 9, requires_grad=True)
    teacher = torch.randn(4, 9, requires_grad=True)
    consistency_loss(student, teacher).loss.backward()
    assert teacher.grad is None and student.grad is not None


def test_ar_loss_with_label_smoothing_matches_torch_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11)
    labels = torch.randint(0, 11, (2, 7))
    labels[0, :3] = -100  # a masked prompt
    labels[1, 5:] = -100  # padding
    ours = ar_loss(logits, next_token_targets(labels), label_smoothing=0.1)
    ref = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    # other formulas of the same values: the log-softmax and the smoothing's mean over the 11 classes, the
    # mean over the 8 tokens, terms up to the largest -log q
    tol = kernel_tolerance(torch.float32, 2 * 11 + 8, float(-F.log_softmax(logits, -1).min()))
    assert ours.count == 4 + 4
    torch.testing.assert_close(ours.loss, ref, **tol)
    by_hand = 0.9 * F.cross_entropy(logits[0, 3], labels[0, 4]) - 0.1 * F.log_softmax(logits[0, 3], -1).mean()
    single = ar_loss(logits[0, 3:4], labels[0, 4:5], 0.1).loss
    torch.testing.assert_close(single, by_hand, **tol)
    halved = ar_loss(logits, next_token_targets(labels), 0.1, num_items=2 * ours.count).loss
    torch.testing.assert_close(halved, ref / 2, **tol)


# --------------------------------------------------------------------------------------------------------
# Examples, batches, draws
def test_state_draws_are_uniform_over_non_fixed_states_and_reproducible():
    mismatch = torch.tensor([[0, 2, 4, 4], [4, 4, 4, 4], [1, 4, 4, 4]])
    block_len = torch.tensor([4, 4, 4])
    draws = torch.stack([draw_states(mismatch, block_len, torch.full((3,), u / 400)) for u in range(400)])
    assert (draws[:200, 0] == 0).all() and (draws[200:, 0] == 1).all()  # two candidates: halves of [0, 1)
    assert (draws[:, 1] == -1).all() and (draws[:, 2] == 0).all()  # no non-fixed state / a single one
    u = state_uniforms(0, 7, 0, range(3))
    assert torch.equal(u, state_uniforms(0, 7, 0, range(3)))  # a pure function of its arguments
    assert torch.equal(u[1:], state_uniforms(0, 7, 0, range(1, 3)))  # per row: micro-batching changes nothing
    assert not torch.equal(u, state_uniforms(0, 8, 0, range(3))) and not torch.equal(
        u, state_uniforms(0, 7, 1, range(3))
    )
    assert ((u >= 0) & (u < 1)).all()


def test_the_trainer_counts_the_positions_the_module_scores():
    from cllm_train.trainer import consistency_count

    batch = _batch(_cfg())
    batch["picks"] = torch.tensor([1, -1, 0])
    rows = torch.arange(3)
    mismatch = torch.where(batch["picks"] >= 0, batch["first_mismatch"][rows, batch["picks"].clamp(min=0)], 4)
    prefix_w = batch["input_ids"].shape[1] - 4
    mask = consistency_positions(mismatch, batch["block_len"], prefix_w, batch["input_ids"].shape[1])
    assert int(consistency_count(batch)) == int(mask.sum()) > 0


def test_examples_cut_the_prefix_on_the_left_and_build_ar_targets():
    rec = synthetic_records(1, n=4)[1]  # block 1: prefix = prompt + block 0
    plen, prefix, fixed = rec["prompt_len"], rec["prefix"], rec["fixed_point"]
    short = len(prefix) - 2 + 4  # two prefix tokens too many
    ex = build_examples([rec], _cfg(max_length=short, ar_target="fixed_point"))[0]
    assert ex["prefix"] == prefix[2:] and ex["ar_ids"] == prefix[2:] + fixed
    assert (
        ex["ar_labels"][: plen - 2] == [-100] * (plen - 2)
        and ex["ar_labels"][plen - 2 :] == ex["ar_ids"][plen - 2 :]
    )
    ex = build_examples([rec], _cfg(max_length=64, ar_target="labels"))[0]
    assert ex["ar_ids"] == prefix[:plen] + rec["labels"]
    assert ex["ar_labels"] == [-100] * plen + rec["labels"]
    ex = build_examples([rec], _cfg(max_length=64, ar_target="labels", mask_prompt=False))[0]
    assert ex["ar_labels"] == ex["ar_ids"]
    with pytest.raises(ConfigError, match=r"max_length=4 cannot hold one prefix token and a block of n=4"):
        build_examples([rec], _cfg(max_length=4))
    with pytest.raises(
        ConfigError, match=r"ar_target=labels but 2 of 2 records have labels=null.*fixed_point"
    ):
        build_examples(synthetic_records(1, labels=False), _cfg())
    assert "ar_ids" not in build_examples([rec], _cfg(ar_weight=0))[0]


def test_collate_aligns_every_block_at_one_column():
    recs = synthetic_records(2, n=4)[:2] + [synthetic_records(1, n=3, seed=5)[0]]
    batch = collate(build_examples(recs, _cfg(ar_target="fixed_point")), pad_id=0, ar_from_teacher=True)
    prefix_w = max(len(r["prefix"]) for r in recs)
    assert batch["input_ids"].shape == (3, prefix_w + 4) and batch["states"].shape[2] == 4
    for b, rec in enumerate(recs):
        n, lpad = len(rec["fixed_point"]), prefix_w - len(rec["prefix"])
        assert batch["input_ids"][b, lpad:prefix_w].tolist() == rec["prefix"]
        assert batch["input_ids"][b, prefix_w : prefix_w + n].tolist() == rec["fixed_point"]
        assert batch["attention_mask"][b].tolist() == [0] * lpad + [1] * (prefix_w - lpad + n) + [0] * (4 - n)
        assert batch["states"][b, len(rec["states"]) :, :n].eq(torch.tensor(rec["fixed_point"])).all()
        assert batch["first_mismatch"][b, : len(rec["states"])].tolist() == rec["first_mismatch"]
        assert (batch["first_mismatch"][b, len(rec["states"]) :] == n).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


# --------------------------------------------------------------------------------------------------------
# The training module against a plain Hugging Face forward
def _hf_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def _manual(model, batch: dict, picks: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """Consistency loss from HF logits, the teacher computed apart as a constant."""
    prefix_w = batch["input_ids"].shape[1] - batch["states"].shape[2]
    rows = torch.arange(len(picks))
    student_ids = torch.cat([batch["input_ids"][:, :prefix_w], batch["states"][rows, picks]], 1)
    with torch.no_grad():
        teacher = _hf_logits(model, teacher_ids, batch["attention_mask"])
    student = _hf_logits(model, student_ids, batch["attention_mask"])
    mismatch = batch["first_mismatch"][rows, picks]
    mask = consistency_positions(mismatch, batch["block_len"], prefix_w, student_ids.shape[1])
    return consistency_loss(student, teacher, mask).loss


@pytest.mark.parametrize("kind", ["global", "local"])
def test_module_loss_and_gradient_match_a_constant_teacher(tiny_llama, kind):
    """Gradient only through the student path; local pairs y(i) with y(i+1), global with y*."""
    model = copy.deepcopy(tiny_llama[0])
    cfg = _cfg(consistency_loss=kind, ar_weight=0.0)
    batch = _batch(cfg)
    picks = torch.tensor([0, 1, 0])
    rows = torch.arange(3)
    prefix_w = batch["input_ids"].shape[1] - batch["states"].shape[2]
    after = batch["states"][rows, picks + 1] if kind == "local" else batch["states"][rows, -1]
    teacher_ids = torch.cat([batch["input_ids"][:, :prefix_w], after], 1)
    module = ConsistencyLM(model, cfg)
    ours = module(**batch, picks=picks)["loss"]
    grads = torch.autograd.grad(ours, list(model.parameters()))
    ref = _manual(model, batch, picks, teacher_ids)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    # HF's forward in another batch layout: the student forward, its log-softmax and KL, the mean
    width, scored = batch["input_ids"].shape[1], int(batch["block_len"].sum())
    config = model.config
    torch.testing.assert_close(
        ours, ref, **model_tolerance(config, width, ref, 2 * config.vocab_size + scored)
    )
    assert ours.item() > 0
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **gradient_tolerance(config, width, scored, r))


@pytest.mark.parametrize(
    "loss,target,calls",
    [
        ("global", "labels", [(True, 6), (False, 3)]),  # student + AR rows with grad; teacher x+y* without
        ("global", "fixed_point", [(True, 6)]),  # the AR rows are the teacher rows: one forward
        ("both", "labels", [(True, 6), (False, 6)]),
        ("local", "fixed_point", [(True, 6), (False, 3)]),
    ],
)
def test_teacher_forwards_run_without_gradient(tiny_llama, loss, target, calls):
    cfg = _cfg(consistency_loss=loss, ar_target=target)
    module = ConsistencyLM(copy.deepcopy(tiny_llama[0]), cfg)
    seen = []
    module.m.layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((torch.is_grad_enabled(), args[0].shape[0])), with_kwargs=True
    )
    out = module(**_batch(cfg), picks=torch.tensor([0, 1, 0]))
    assert seen == calls
    assert out["loss_ar"] > 0 and out["loss_consistency"] > 0


def test_fused_teacher_equals_a_separate_no_grad_teacher(tiny_llama):
    model = tiny_llama[0]
    fused = _cfg(ar_target="fixed_point")
    batch = _batch(fused)
    with torch.no_grad():
        one = ConsistencyLM(model, fused)(**batch, picks=torch.tensor([0, 1, 0]))
        alone = ConsistencyLM(model, _cfg(ar_weight=0.0))(**batch, picks=torch.tensor([0, 1, 0]))
    # the teacher rows run beside the AR rows or alone: the same forward in another batch
    want, width = alone["loss_consistency"], batch["input_ids"].shape[1]
    extra = 2 * model.config.vocab_size + int(batch["block_len"].sum())  # the KL's sums and the mean
    torch.testing.assert_close(
        one["loss_consistency"], want, **model_tolerance(model.config, width, want, extra)
    )


def test_gradient_accumulation_gives_the_loss_of_one_large_batch(tiny_llama):
    model = tiny_llama[0]
    cfg = _cfg(consistency_loss="both")
    pool = synthetic_records(12, seed=3)
    records = [r for r in pool if len(r["states"]) >= 2][:3] + [r for r in pool if len(r["states"]) == 1][:1]
    examples = build_examples(records, cfg)
    module = ConsistencyLM(model, cfg).eval()
    picks = torch.tensor([0, 0, 0, -1])  # the last row has no non-fixed state: AR loss only
    whole = collate(examples, 0)
    halves = [collate(examples[:2], 0), collate(examples[2:], 0)]
    ar_items = int((next_token_targets(whole["labels"]) != -100).sum())
    rows = torch.arange(4)
    k_items = int((whole["block_len"] - whole["first_mismatch"][rows, picks.clamp(min=0)])[:3].sum())
    with torch.no_grad():
        full = module(**whole, picks=picks)["loss"]
        parts = [
            module(**h, picks=p, num_items_in_batch=ar_items, consistency_items=k_items)["loss"]
            for h, p in zip(halves, picks.split(2), strict=True)
        ]
    # halves of the batch: the same forward in other batches, the sums over the items split in two
    width, items = whole["input_ids"].shape[1], ar_items + k_items
    extra = 2 * model.config.vocab_size + items
    torch.testing.assert_close(sum(parts), full, **model_tolerance(model.config, width, full, extra))
