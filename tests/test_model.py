"""EarlyExitModel (the model seam, fastdecode/runtime/model.py) must reproduce HF's own forward for every supported
family (fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from fastdecode.config import ConfigError, ModelConfig, load_group
from fastdecode.runtime.families import FAMILIES
from fastdecode.runtime.model import EarlyExitModel
from tests.conftest import TINY_MODELS

TOL = 1e-5


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (batch, length), generator=gen)


def _hf_final_norm(model):
    """HF's own final norm module, looked up here independently of fastdecode.runtime.families.FAMILIES: the decoder's
    ``norm`` (Llama-style) or ``final_layer_norm`` (OPT-style)."""
    decoder = model.get_decoder()
    return decoder.norm if hasattr(decoder, "norm") else decoder.final_layer_norm


@torch.no_grad()
def test_full_depth_logits_equal_hf_forward(tiny):
    model, _ = tiny
    m = EarlyExitModel(model)
    ids = _ids(2, 37)
    ref = model(ids).logits
    assert (m.forward(ids) - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_cached_token_by_token_decoding_equals_full_forward(tiny):
    model, _ = tiny
    m = EarlyExitModel(model)
    ids = _ids(3, 40, seed=1)
    ref = model(ids).logits
    cache = m.new_cache(3, capacity=4)  # small on purpose: the cache must grow
    pieces = [m.forward(ids[:, :7], cache=cache)]
    pieces += [m.forward(ids[:, t : t + 1], cache=cache) for t in range(7, 30)]
    pieces.append(m.forward(ids[:, 30:], cache=cache))  # a multi-token chunk after the prefix
    assert (torch.cat(pieces, 1) - ref).abs().max().item() <= TOL
    assert cache.lengths == [40] * m.num_layers


@torch.no_grad()
def test_exit_logits_equal_head_of_hf_hidden_states(tiny):
    model, _ = tiny
    m = EarlyExitModel(model)
    ids = _ids(2, 25, seed=2)
    out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states  # L + 1 entries; the last one is already final-normed by HF
    assert len(hidden) == m.num_layers + 1
    norm = _hf_final_norm(model)
    for layer in range(m.num_layers - 1):
        expected = model.lm_head(norm(hidden[layer + 1]))
        assert (m.exit_logits(hidden[layer + 1]) - expected).abs().max().item() <= TOL, layer
    # The last exit is the model's own output; our run of layers [0, l+1) reproduces HF's hidden states.
    pos = torch.arange(25).expand(2, -1)
    h = m.embed(ids, pos)
    for layer in range(m.num_layers):
        h = m.run_layers(h, layer, layer + 1, pos)
        if layer < m.num_layers - 1:
            assert (h - hidden[layer + 1]).abs().max().item() <= TOL
    assert (m.exit_logits(h) - out.logits).abs().max().item() <= TOL


@torch.no_grad()
def test_layers_in_pieces_with_cache_equal_one_pass(tiny):
    """Running [0, k) then [k, L) over the same tokens (as self-speculation does) changes nothing."""
    model, _ = tiny
    m = EarlyExitModel(model)
    ids = _ids(1, 20, seed=3)
    ref = model(ids).logits
    cache = m.new_cache(1, 32)
    split = m.num_layers // 2
    out = []
    for t in range(20):
        pos = torch.tensor([[t]])
        cache.reserve(torch.ones(1, 1, dtype=torch.bool), t)
        h = m.run_layers(m.embed(ids[:, t : t + 1], pos), 0, split, pos, cache=cache)
        h = m.run_layers(h, split, m.num_layers, pos, cache=cache)
        out.append(m.exit_logits(h))
    assert (torch.cat(out, 1) - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_left_padded_batch_equals_rows_alone(tiny):
    model, _ = tiny
    m = EarlyExitModel(model)
    lengths = [9, 4, 13]
    rows = [_ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    pos = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - lengths[i] :] = row[0]
        valid[i, width - lengths[i] :] = True
        pos[i, width - lengths[i] :] = torch.arange(lengths[i])
    cache = m.new_cache(3, 32)
    prefill = m.forward(ids, cache=cache, position_ids=pos, valid=valid)
    nxt = _ids(3, 1, seed=99)
    step = m.forward(nxt, cache=cache, position_ids=torch.tensor(lengths)[:, None])
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, nxt[i : i + 1]], 1)).logits
        assert (prefill[i, width - lengths[i] :] - alone[0, :-1]).abs().max().item() <= TOL
        assert (step[i, 0] - alone[0, -1]).abs().max().item() <= TOL


@torch.no_grad()
def test_rollback_by_length_pointer(tiny_llama):
    model, _ = tiny_llama
    m = EarlyExitModel(model)
    ids = _ids(1, 16, seed=4)
    wrong = _ids(1, 5, seed=5)
    cache = m.new_cache(1, 8)
    m.forward(ids[:, :10], cache=cache)
    m.forward(wrong, cache=cache)  # tokens that get rejected
    cache.crop(10)
    resumed = m.forward(ids[:, 10:], cache=cache)
    assert (resumed - model(ids).logits[:, 10:]).abs().max().item() <= TOL


def test_unknown_family_lists_choices(tiny_llama):
    model, _ = tiny_llama
    model.config.model_type = "gpt_neox"
    try:
        with pytest.raises(ConfigError, match="Unknown model family 'gpt_neox'.*llama.*opt"):
            EarlyExitModel(model)
    finally:
        model.config.model_type = "llama"


def test_flash_attention_is_refused_with_the_fix(tiny_llama):
    model, _ = tiny_llama
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ConfigError, match="attn_implementation"):
            EarlyExitModel(model)
    finally:
        model.config._attn_implementation = "sdpa"


def test_every_registered_family_has_a_tiny_config_the_tests_run():
    """``TINY_MODELS`` is every ``configs/model/tiny-*.yaml``; each registered family has one, each one is of a
    registered family: a family added to the registry without its tiny config fails here."""
    families = {load_group("model", name, ModelConfig).family for name in TINY_MODELS}
    assert families == set(FAMILIES) and {"llama", "mistral", "qwen2", "opt"} <= families
