"""LayerSkip training core: dropout rates and draws, per-sample dropping, exit weights, curricula, loss."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fastdecode.config import ConfigError
from fastdecode.runtime.cache import attention_mask
from fastdecode.runtime.model import EarlyExitModel
from layerskip_train.early_exit_loss import (
    SelfDistill,
    active_exits,
    early_exit_loss,
    scale_weights,
)
from layerskip_train.layer_dropout import (
    depth_scale,
    drop_mask,
    dropout_rates,
    parse_layers,
    plan_segments,
    run_with_layer_dropout,
    time_scale,
)
from tests.helpers import gradient_tolerance, kernel_tolerance, model_tolerance

SCALE_FNS = ["uniform", "linear_l", "sum_l", "sqrt_l", "inv_l", "inv_sqrt_l"]


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 261, (batch, length), generator=torch.Generator().manual_seed(seed))


def _positions(batch: int, length: int) -> torch.Tensor:
    return torch.arange(length).expand(batch, -1)


# --------------------------------------------------------------------------------------------------------
# Rates, layer selection, draws
def test_exp_rate_table_matches_paper():
    rates = dropout_rates(0.2, 32, ":", scale="exp", time_scale="constant", step=0)
    assert [round(rates[i], 3) for i in (0, 8, 16, 24, 31)] == [0.0, 0.039, 0.086, 0.142, 0.2]


def test_depth_and_time_scales():
    assert depth_scale("linear", 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert depth_scale("uniform", 3) == [1.0, 1.0, 1.0]
    for name in ("exp", "linear", "uniform"):
        assert depth_scale(name, 1) == [1.0]
    assert time_scale("constant", 7, None) == 1.0
    assert time_scale("exp", 0, 100) == 0.0
    assert time_scale("exp", 100, 100) == 1.0
    assert time_scale("exp", 50, 100) == pytest.approx(2**0.5 - 1)
    with pytest.raises(ConfigError, match="total_steps"):
        time_scale("exp", 5, None)
    rates = dropout_rates(0.2, 4, "1::2", scale="linear", time_scale="exp", step=50, total_steps=100)
    assert rates == pytest.approx([0.0, 0.2 * (2**0.5 - 1) / 3, 0.0, 0.2 * (2**0.5 - 1)])


@pytest.mark.parametrize("p_max", [-0.1, 1.0, 1.5])
def test_p_max_outside_unit_interval_is_rejected(p_max):
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        dropout_rates(p_max, 8)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (":", [0, 1, 2, 3, 4, 5, 6, 7]),
        (None, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("1::2", [1, 3, 5, 7]),
        ("-4:", [4, 5, 6, 7]),
        ("2:6", [2, 3, 4, 5]),
        ("::-3", [1, 4, 7]),
        ("0,4,5", [0, 4, 5]),
        ("5, 0, -1", [0, 5, 7]),
        ("3", [3]),
        ([6, 1, 1], [1, 6]),
        ([], []),
    ],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 8) == expected


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("0,8", ["'0,8'", "8", "0..7"]),
        ("-9", ["-9", "0..7"]),
        ("10:", ["'10:'", "10", "-8..8"]),
        ([1, 12], ["12", "0..7"]),
        ("a,b", ["'a'"]),
        ("1:2:3:4", ["at most two"]),
        ("::0", ["step"]),
        ("5:2", ["selects no layer"]),
    ],
)
def test_parse_layers_errors_name_spec_index_and_range(spec, fragments):
    with pytest.raises(ConfigError) as err:
        parse_layers(spec, 8)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "call, choices",
    [
        (lambda: depth_scale("expo", 4), ["exp", "linear", "uniform"]),
        (lambda: time_scale("linear", 0, 10), ["constant", "exp"]),
        (lambda: scale_weights("sum", [0, 3], 4), SCALE_FNS),
        (lambda: active_exits("rotate", [0, 1], 4, 0), ["gradual", "none", "rotational", "strided"]),
    ],
)
def test_unknown_names_list_the_choices(call, choices):
    with pytest.raises(ConfigError) as err:
        call()
    for choice in choices:
        assert choice in str(err.value)


def test_drop_mask_is_a_function_of_seed_and_step_only():
    rates = [0.0, 0.3, 0.5, 0.9]
    torch.manual_seed(0)
    a = drop_mask(rates, 64, seed=7, step=11)
    torch.manual_seed(123)
    torch.rand(1000)  # move the global RNG: the draw must not care
    b = drop_mask(rates, 64, seed=7, step=11)
    assert a.dtype == torch.bool and a.shape == (4, 64)
    assert torch.equal(a, b)
    assert not a[0].any()  # rate 0 never drops
    assert not torch.equal(a, drop_mask(rates, 64, seed=7, step=12))
    assert not torch.equal(a, drop_mask(rates, 64, seed=8, step=11))
    assert not torch.equal(a, drop_mask(rates, 64, seed=7, step=11, micro_step=1))
    assert not torch.equal(a, drop_mask(rates, 64, seed=7, step=11, rank=1))
    freq = torch.stack([drop_mask(rates, 256, seed=0, step=s) for s in range(20)]).float().mean((0, 2))
    assert freq.tolist() == pytest.approx(rates, abs=0.03)


# --------------------------------------------------------------------------------------------------------
# Exit weights and curricula
@pytest.mark.parametrize("name", SCALE_FNS)
@pytest.mark.parametrize("e_scale", [1.0, 0.1])
def test_weights_sum_to_one(name, e_scale):
    for exits in ([3], [0, 3], [1, 2], [0, 1, 2, 3]):
        w = scale_weights(name, exits, 4, e_scale)
        assert len(w) == len(exits) and sum(w) == pytest.approx(1.0) and min(w) > 0


def test_weight_values_and_e_scale():
    assert scale_weights("linear_l", [1, 3], 4, 0.5) == pytest.approx([1 / 5, 4 / 5])  # s = [2 * 0.5, 4]
    assert scale_weights("sum_l", [0, 1, 3], 4) == pytest.approx([1 / 11, 3 / 11, 7 / 11])  # cumsum 1, 2, 4
    assert scale_weights("inv_l", [0, 3], 4, 0.1) == pytest.approx([0.1 / 0.35, 0.25 / 0.35])
    assert scale_weights("uniform", [0, 1], 4, 0.1) == pytest.approx([0.5, 0.5])  # no final exit: cancels
    with pytest.raises(ConfigError, match="increasing"):
        scale_weights("uniform", [2, 1], 4)
    with pytest.raises(ConfigError, match="> 0"):
        scale_weights("uniform", [1, 3], 4, 0.0)


def test_strided_curriculum():
    """Ours (formerly spelt ``rotational`` + ``rotation``): candidate l iff (l - step) mod stride == 0."""
    all8 = list(range(8))
    assert active_exits("strided", all8, 8, step=0) == [0, 4, 7]
    assert active_exits("strided", all8, 8, step=1) == [1, 5, 7]
    assert active_exits("strided", all8, 8, step=2) == [2, 6, 7]
    assert active_exits("strided", all8, 8, step=3) == [3, 7]
    assert active_exits("strided", all8, 8, step=5) == [1, 5, 7]
    assert active_exits("strided", [1, 3, 5], 8, step=1) == [1, 5, 7]
    assert active_exits("strided", all8, 8, step=1, stride=2) == [1, 3, 5, 7]
    assert active_exits("none", [2, 4], 8, step=9) == [2, 4, 7]
    with pytest.raises(ConfigError, match="stride >= 1"):
        active_exits("strided", all8, 8, step=0, stride=0)


def test_gradual_curriculum():
    # L=8, T=100: layer l joins once step >= 6.25 * (8 - l); the last layer is always on.
    all8 = list(range(8))
    assert active_exits("gradual", all8, 8, 0, 100) == [7]
    assert active_exits("gradual", all8, 8, 7, 100) == [7]
    assert active_exits("gradual", all8, 8, 12, 100) == [7]
    assert active_exits("gradual", all8, 8, 13, 100) == [6, 7]
    assert active_exits("gradual", all8, 8, 25, 100) == [4, 5, 6, 7]  # boundary: 25 = 6.25 * 4 exactly
    assert active_exits("gradual", all8, 8, 49, 100) == [1, 2, 3, 4, 5, 6, 7]
    assert active_exits("gradual", all8, 8, 50, 100) == all8
    assert active_exits("gradual", [0, 2], 8, 99, 100) == [0, 2, 7]
    with pytest.raises(ConfigError, match="total_steps"):
        active_exits("gradual", all8, 8, 3)


# --------------------------------------------------------------------------------------------------------
# Early-exit loss
def _naive_loss(m, hiddens, labels, weights, num_items=None, distill=None):
    """Reference: materialised [B, T, V] logits per exit, HF-style shift, F.cross_entropy."""
    last = m.num_layers - 1
    targets = labels[:, 1:].reshape(-1)
    n = int((targets != -100).sum())
    denom = num_items if num_items is not None else n
    teacher = m.exit_logits(hiddens[last]).detach()[:, :-1].reshape(-1, m.vocab_size).float()
    total = 0.0
    for w, layer in zip(weights, sorted(hiddens), strict=True):
        logits = m.exit_logits(hiddens[layer])[:, :-1].reshape(-1, m.vocab_size).float()
        loss = F.cross_entropy(logits, targets, reduction="sum")
        if distill is not None and layer != last:
            t, keep = distill.temperature, targets != -100
            kl = F.kl_div(
                F.log_softmax(logits[keep] / t, -1), F.softmax(teacher[keep] / t, -1), reduction="sum"
            )
            loss = (1 - distill.weight) * loss + distill.weight * kl * t**2
        total = total + w * loss
    return total / denom


def _exit_inputs(m, batch=3, length=13, exits=(0, 2, 3), seed=0):
    gen = torch.Generator().manual_seed(seed)
    hiddens = {
        layer: torch.randn(batch, length, m.config.hidden_size, generator=gen).requires_grad_()
        for layer in exits
    }
    labels = _ids(batch, length, seed)
    labels[0, :4] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    return hiddens, labels


@pytest.mark.parametrize("num_items", [None, 50])
@pytest.mark.parametrize("distill", [None, SelfDistill(0.4, 2.0)])
def test_chunked_exit_loss_equals_naive_loss_and_gradients(tiny_llama, num_items, distill):
    m = EarlyExitModel(tiny_llama[0])
    hiddens, labels = _exit_inputs(m)
    weights = scale_weights("sum_l", sorted(hiddens), m.num_layers, 0.5)
    params = [m.lm_head.weight, tiny_llama[0].model.norm.weight]
    inputs = [*hiddens.values(), *params]
    ref = _naive_loss(m, hiddens, labels, weights, num_items, distill)
    ref_grads = torch.autograd.grad(ref, inputs)
    # chunk_size 7 does not divide the 30 label tokens: a ragged last chunk
    out = early_exit_loss(m, hiddens, labels, weights, num_items=num_items, chunk_size=7, distill=distill)
    grads = torch.autograd.grad(out.loss, inputs)
    assert out.num_tokens == 30
    # chunks against one pass: per exit the final norm and the head, the log-softmax (and the distillation's
    # softmax and KL) over the vocabulary, the sum over the 30 tokens; the backward through the same sums
    H, V = m.config.hidden_size, m.vocab_size
    loss_sums = len(hiddens) * (2 * H + 3 * V) + 30
    torch.testing.assert_close(out.loss, ref, **kernel_tolerance(torch.float32, loss_sums, float(ref)))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(
            g, r, **kernel_tolerance(torch.float32, 2 * loss_sums + 30, float(r.abs().max()))
        )
    assert set(out.ce) == set(hiddens) and set(out.kl) == ({0, 2} if distill else set())


def test_exit_loss_keeps_no_full_logits_tensor(tiny_llama):
    """Largest tensor created in forward + backward stays below one [B, T, V] logits tensor."""
    m = EarlyExitModel(tiny_llama[0])
    hiddens, labels = _exit_inputs(m, batch=2, length=200, exits=(0, 1, 2, 3))
    weights = scale_weights("uniform", sorted(hiddens), m.num_layers)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        early_exit_loss(m, hiddens, labels, weights, chunk_size=32).loss.backward()
    full_logits = 2 * 200 * m.vocab_size
    assert Largest.numel <= max(32 * m.vocab_size, m.vocab_size * m.config.hidden_size, 2 * 200 * 64)
    assert Largest.numel < full_logits / 4


def test_no_label_tokens_gives_zero_loss_and_zero_gradients(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    hiddens, labels = _exit_inputs(m, exits=(1, 3))
    out = early_exit_loss(m, hiddens, torch.full_like(labels, -100), [0.5, 0.5])
    grad = torch.autograd.grad(out.loss, m.lm_head.weight)[0]
    assert out.loss.item() == 0.0 and out.num_tokens == 0 and not grad.any()


# --------------------------------------------------------------------------------------------------------
# Per-sample layer dropout on a tiny Llama
def test_plan_segments_merges_drop_free_layers_until_an_exit():
    drops = torch.zeros(6, 3, dtype=torch.bool)
    drops[2, 1] = True
    drops[4] = True
    plan = plan_segments(drops, {1, 5}, 5)
    assert plan == [(0, 2, None), (2, 3, [0, 2]), (3, 4, None), (4, 5, []), (5, 6, None)]
    assert plan_segments(None, {3}, 3) == [(0, 4, None)]


def _left_padded(batch=3, length=11):
    ids = _ids(batch, length, seed=3)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :4] = False  # row 1 is left-padded
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    return ids, valid, positions


@torch.no_grad()
def test_layer_dropout_equals_per_row_reference_and_skips_compute(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    ids, valid, pos = _left_padded()
    mask = attention_mask(valid, 0, ids.shape[1], torch.float32)  # [B, 1, T, T]
    drops = torch.tensor([[0, 1, 0], [1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)  # [L=4, B=3]
    rows_seen: list[tuple[int, int]] = []
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: rows_seen.append((i, args[0].shape[0])))
        for i, layer in enumerate(m.layers)
    ]
    try:
        out = run_with_layer_dropout(m, m.embed(ids, pos), pos, mask, drops=drops, exit_layers={1, 3})
    finally:
        for h in hooks:
            h.remove()
    assert rows_seen == [(0, 2), (1, 1), (2, 3), (3, 1)]  # each layer ran on its kept rows only
    for b in range(3):
        h = m.embed(ids[b : b + 1], pos[b : b + 1])
        expected = {}
        for layer in range(4):
            if not drops[layer, b]:
                h = m.run_layers(h, layer, layer + 1, pos[b : b + 1], mask[b : b + 1])
            expected[layer] = h
        for layer in (1, 3):  # a row alone against the batch
            want = expected[layer][0]
            tol = model_tolerance(m.config, ids.shape[1], want)
            torch.testing.assert_close(
                out[layer][b], want, **tol, msg=lambda msg, b=b, layer=layer: f"{b, layer}: {msg}"
            )


def test_layer_dropout_gradients_equal_per_row_reference(tiny_llama):
    model = tiny_llama[0]
    m = EarlyExitModel(model)
    ids, valid, pos = _left_padded()
    labels = ids.masked_fill(~valid, -100)
    mask = attention_mask(valid, 0, ids.shape[1], torch.float32)
    drops = torch.tensor([[0, 1, 0], [1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = [0.3, 0.7]
    hiddens = run_with_layer_dropout(m, m.embed(ids, pos), pos, mask, drops=drops, exit_layers=[1, 3])
    loss = early_exit_loss(m, hiddens, labels, weights, num_items=40).loss
    grads = torch.autograd.grad(loss, params)
    ref = 0.0
    for b in range(3):
        h = m.embed(ids[b : b + 1], pos[b : b + 1])
        row: dict[int, torch.Tensor] = {}
        for layer in range(4):
            if not drops[layer, b]:
                h = m.run_layers(h, layer, layer + 1, pos[b : b + 1], mask[b : b + 1])
            row[layer] = h
        ref = ref + early_exit_loss(m, {1: row[1], 3: row[3]}, labels[b : b + 1], weights, num_items=40).loss
    ref_grads = torch.autograd.grad(ref, params)
    # each row alone against the batch, the exits' losses summed over 2 exits and the 3 rows
    width, config = ids.shape[1], model.config
    torch.testing.assert_close(loss, ref, **model_tolerance(config, width, ref, 2 * config.vocab_size + 40))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, **gradient_tolerance(config, width, 40, r))


@torch.no_grad()
def test_layers_past_the_deepest_exit_are_not_run(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    ids = _ids(2, 9)
    pos = _positions(2, 9)
    seen: list[int] = []
    hooks = [
        layer.register_forward_pre_hook(lambda *a, i=i: seen.append(i)) for i, layer in enumerate(m.layers)
    ]
    try:
        out = run_with_layer_dropout(m, m.embed(ids, pos), pos, exit_layers=[0, 1])
    finally:
        for h in hooks:
            h.remove()
    assert seen == [0, 1] and sorted(out) == [0, 1]
    ref = m.run_layers(m.embed(ids, pos), 0, 2, pos)
    assert torch.equal(out[1], ref)  # layers 0 and 1 in two calls, or in one: the same sums on the same rows


def test_every_block_gets_gradient_in_a_full_early_exit_step(tiny_llama):
    model = copy.deepcopy(tiny_llama[0])
    m = EarlyExitModel(model)
    ids = _ids(2, 12)
    pos = _positions(2, 12)
    exits = list(range(m.num_layers))
    drops = drop_mask(dropout_rates(0.0, m.num_layers), 2, seed=0, step=0)
    hiddens = run_with_layer_dropout(m, m.embed(ids, pos), pos, None, drops=drops, exit_layers=exits)
    early_exit_loss(m, hiddens, ids, scale_weights("uniform", exits, m.num_layers)).loss.backward()
    for i, layer in enumerate(m.layers):
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (i, name)
    assert model.model.norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("num_items", [None, 17])
def test_last_exit_only_equals_plain_causal_lm_fine_tuning(tiny_llama, num_items):
    model = copy.deepcopy(tiny_llama[0])
    ids, valid, pos = _left_padded()
    labels = ids.masked_fill(~valid, -100)
    labels[0, :3] = -100
    # The first real token of the padded row would be predicted from a pad query, whose output depends on
    # how a fully masked attention row is treated (HF and EarlyExitModel differ); prompts are unlabelled anyway.
    labels[1, 4] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    ref = model(ids, attention_mask=valid.long(), position_ids=pos, labels=labels, **extra).loss
    ref_grads = torch.autograd.grad(ref, params)

    m = EarlyExitModel(model)
    mask = attention_mask(valid, 0, ids.shape[1], torch.float32)
    drops = drop_mask([0.0] * m.num_layers, 3, seed=1, step=0)
    hiddens = run_with_layer_dropout(m, m.embed(ids, pos), pos, mask, drops=drops)  # last exit only
    out = early_exit_loss(m, hiddens, labels, [1.0], num_items=num_items, chunk_size=5)
    grads = torch.autograd.grad(out.loss, params)
    # HF's forward against EarlyExitModel's layers and the chunked loss over the labelled tokens
    width, scored, config = ids.shape[1], int((labels[:, 1:] != -100).sum()), model.config
    torch.testing.assert_close(
        out.loss, ref, **model_tolerance(config, width, ref, config.vocab_size + scored)
    )
    for p, g, r in zip(params, grads, ref_grads, strict=True):
        tol = gradient_tolerance(config, width, scored, r)
        torch.testing.assert_close(g, r, **tol, msg=lambda msg, p=p: f"{tuple(p.shape)}: {msg}")


def test_layer_skipped_by_every_row_gets_zero_gradient_with_touch(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    ids = _ids(2, 8)
    pos = _positions(2, 8)
    drops = torch.zeros(m.num_layers, 2, dtype=torch.bool)
    drops[1] = True  # every row skips layer 1
    skipped = list(m.layers[1].parameters())
    results = {}
    for touch in (False, True):
        hiddens = run_with_layer_dropout(m, m.embed(ids, pos), pos, None, drops=drops, touch_skipped=touch)
        loss = early_exit_loss(m, hiddens, ids, [1.0]).loss
        results[touch] = loss.item()
        grads = torch.autograd.grad(loss, skipped, allow_unused=True)
        if touch:
            assert all(g is not None and not g.any() for g in grads)
        else:
            assert all(g is None for g in grads)
    assert results[True] == results[False]


_DDP_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from fastdecode.config import ModelConfig, load_group
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from layerskip_train.early_exit_loss import early_exit_loss
from layerskip_train.layer_dropout import run_with_layer_dropout

dist.init_process_group("gloo")
rank = dist.get_rank()
model, _ = load_model(load_group("model", "tiny-llama", ModelConfig, dtype="float32", device="cpu"))


class Step(nn.Module):  # the loss is computed inside the DDP-wrapped forward
    def __init__(self, hf, touch):
        super().__init__()
        self.hf, self.m, self.touch = hf, EarlyExitModel(hf), touch

    def forward(self, ids, drops):
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        hidden = self.m.embed(ids, pos)
        hid = run_with_layer_dropout(self.m, hidden, pos, None, drops=drops, touch_skipped=self.touch)
        return early_exit_loss(self.m, hid, ids, [1.0]).loss


def train(touch):
    ddp = nn.parallel.DistributedDataParallel(Step(model, touch))  # find_unused_parameters=False
    drops = torch.zeros(4, 2, dtype=torch.bool)
    drops[1] = True  # every row of every rank skips layer 1
    for it in range(3):
        ids = torch.randint(5, 261, (2, 8), generator=torch.Generator().manual_seed(10 * rank + it))
        ddp.zero_grad()
        ddp(ids, drops).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(grads) for _ in range(2)]
    dist.all_gather(gathered, grads)
    assert torch.equal(gathered[0], gathered[1]), "gradients differ across ranks"
    assert not any(p.grad.any() for p in model.model.layers[1].parameters())


train(touch=True)
print("TOUCH-OK")
try:
    train(touch=False)
except RuntimeError as err:
    print("NO-TOUCH-FAILS" if "find_unused_parameters" in str(err) else err)
dist.destroy_process_group()
"""


def _run_ddp() -> tuple[int, str]:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=root)
        cmd = [sys.executable, "-c", _DDP_SCRIPT]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    return max(p.returncode for p in procs), "\n".join(outputs)


@pytest.mark.distributed
def test_ddp_with_a_fully_skipped_layer_needs_the_touch():
    """2 gloo processes, DDP without find_unused_parameters: the touch makes a skipped layer's grads 0."""
    rc, out = _run_ddp()
    assert rc == 0 and out.count("TOUCH-OK") == 2, out
    assert out.count("NO-TOUCH-FAILS") == 2, (
        out
    )  # without it DDP raises (and asks for find_unused_parameters)


def test_token_fraction_is_an_unbiased_estimate_of_the_exit_loss(tiny_llama):
    m = EarlyExitModel(tiny_llama[0])
    ids = _ids(2, 24, seed=7)
    pos = _positions(2, 24)
    with torch.no_grad():
        hiddens = run_with_layer_dropout(m, m.embed(ids, pos), pos, exit_layers=[0, 1, 3])
        exact = early_exit_loss(m, hiddens, ids, [0.3, 0.3, 0.4]).loss.item()
        same = early_exit_loss(m, hiddens, ids, [0.3, 0.3, 0.4], token_fraction=1.0).loss.item()
        gen = torch.Generator().manual_seed(0)
        draws = [
            early_exit_loss(m, hiddens, ids, [0.3, 0.3, 0.4], token_fraction=0.25, generator=gen).loss.item()
            for _ in range(400)
        ]
    assert same == exact
    assert len(set(draws)) > 10  # really subsampled
    assert sum(draws) / len(draws) == pytest.approx(exact, rel=0.01)
