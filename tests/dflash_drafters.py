"""Tiny DFlash drafters for the decoder tests: trained for a few dozen steps on a tiny target's own greedy
continuations (every block of a sequence in one forward under ``layer.block_mask``, cross-entropy to the
target's tokens), so their drafts are accepted (a random drafter's almost never are, and an equality test that
accepts nothing proves little); random ones for the checks of the files and for sampling."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.dflash.files import save_dflash
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.drafters.dflash.model import DFlashConfig
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import tiny_model

MASK = 3  # the tiny byte tokenizer's prompts and answers never hold it (prompts: ids >= 5; EOS: 4)
BLOCK = 5  # an anchor and 4 masks: drafts of up to 4 tokens


def drafter_config(m: EarlyExitModel, mask: int = MASK, block: int = BLOCK) -> DFlashConfig:
    """A one-layer drafter for ``m`` (any family: OPT names its MLP width otherwise) reading every layer's
    output but the last (ids ``0 .. L - 2``)."""
    c = m.config
    heads = c.num_attention_heads
    return DFlashConfig(
        hidden_size=c.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=c.hidden_size // heads,
        intermediate_size=2 * c.hidden_size,
        vocab_size=m.vocab_size,
        target_layer_ids=list(range(m.num_layers - 1)),
        num_target_layers=m.num_layers,
        mask_token_id=mask,
        block_size=block,
    )


def training_sequences(m: EarlyExitModel, seed: int = 0) -> torch.Tensor:
    """``[8, 40]``: 8-token random prompts and the target's 32-token greedy continuation. Any prefix of 8
    or more tokens of a row continues greedily as the row does: the prompts of the decoder tests."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, m.vocab_size, (8, 8), generator=gen).tolist()
    out = autoregressive(m, prompts, DecodeConfig(max_new_tokens=32)).tokens
    return torch.tensor([p + o for p, o in zip(prompts, out, strict=True)])


def train_drafter(m: EarlyExitModel, *, steps: int = 80, seed: int = 0) -> DFlashDraft:
    """A drafter trained ``steps`` Adam steps on ``training_sequences(m)`` with an anchor at every position
    from 7 on (it learns them by heart: its drafts on their prefixes are accepted)."""
    torch.manual_seed(seed)
    ids = training_sequences(m, seed)
    draft = DFlashDraft(drafter_config(m))
    cfg, (rows, width) = draft.config, ids.shape
    with torch.no_grad():
        hidden = m.hf(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in cfg.feature_ids], -1)
    anchors = torch.arange(7, width - 1)
    slots = torch.arange(cfg.block_size)
    where = anchors[:, None] + slots  # [N, B']: each block slot's position
    block = torch.full((rows, len(anchors), cfg.block_size), cfg.mask_token_id)
    block[:, :, 0] = ids[:, anchors]
    labels = torch.where((where < width) & (slots > 0), ids[:, where.clamp(max=width - 1)], -100)
    mask = block_mask(
        anchors.expand(rows, -1), torch.ones(rows, len(anchors), dtype=torch.bool), width, len(slots)
    )
    noise, head = m.token_embed(block.reshape(rows, -1)).detach(), m.lm_head.weight.detach()
    positions, context = where.reshape(-1).expand(rows, -1), torch.arange(width).expand(rows, -1)
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    with torch.enable_grad():
        for _ in range(steps):
            out = draft(noise, positions, draft.context_kv(features, context), mask)
            loss = F.cross_entropy(F.linear(out, head).flatten(0, 1), labels.flatten(), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return draft.eval()


@functools.cache
def drafter_dir(m: EarlyExitModel) -> str:
    """The directory of ``train_drafter(m)`` saved with ``save_dflash`` (one per model for the session)."""
    out = Path(tempfile.mkdtemp(prefix="fastdecode-dflash-")) / "drafter"
    return str(save_dflash(train_drafter(m), out))


def random_drafter_dir(out: Path, m: EarlyExitModel | None = None, mask: int = MASK) -> str:
    """A random-init drafter for ``m`` (default: the tiny Llama), saved in ``out/dflash``."""
    m = m if m is not None else EarlyExitModel(tiny_model("tiny-llama")[0])
    torch.manual_seed(0)
    return str(save_dflash(DFlashDraft(drafter_config(m, mask)), out / "dflash"))
