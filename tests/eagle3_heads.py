"""Tiny EAGLE-3 heads for the decoder tests: trained for a few dozen steps with the training-time test loss
(``eagle3_train.losses.ttt_loss``) on a tiny target's own greedy continuations, so their drafts are accepted
(a random head's almost never are, and an equality test that accepts nothing proves little)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from eagle3_train.losses import ttt_loss
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.eagle3.files import save_eagle3
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.runtime.model import EarlyExitModel
from tests.helpers import tiny_model


def target_batch(m: EarlyExitModel, ids: torch.Tensor, aux: list[int]) -> dict[str, torch.Tensor]:
    """The training batch of ``ids [B, T]`` (no padding) from one forward of the target: embeddings,
    features at ``aux`` (Hugging Face's ``hidden_states[i]``), logits."""
    with torch.no_grad():
        out = m.hf(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in aux], -1)
    return {
        "input_ids": ids,
        "embeds": m.token_embed(ids).detach(),
        "features": features,
        "target_logits": out.logits,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
    }


def continuations(m: EarlyExitModel, count: int, seed: int, width: int = 8, new: int = 32) -> torch.Tensor:
    """``[count, width + new]``: random prompts of ``width`` tokens and the target's greedy continuation."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, m.vocab_size, (count, width), generator=gen).tolist()
    out = autoregressive(m, prompts, DecodeConfig(max_new_tokens=new)).tokens
    return torch.tensor([p + o for p, o in zip(prompts, out, strict=True)])


def head_config(m: EarlyExitModel, draft_vocab_size: int, **options) -> Eagle3Config:
    """A head for ``m``; norm before the residual (EAGLE-3's paper layer) unless ``options`` say otherwise: it
    learns the tiny models' text in the steps ``train_head`` gives it."""
    options = {"norm_before_residual": True, "aux_layer_ids": tiny_aux_layers(m.num_layers)} | options
    return Eagle3Config.from_target(m.config, draft_vocab_size=draft_vocab_size, **options)


def tiny_aux_layers(num_layers: int) -> list[int]:
    """Three feature ids for a tiny target, where the default rule ``[2, L // 2, L - 3]`` repeats ids."""
    return sorted({1, num_layers // 2, num_layers - 1})


def training_sequences(m: EarlyExitModel, seed: int = 0) -> torch.Tensor:
    """``[16, 40]``: 8-token random prompts and the target's 32-token greedy continuation. Any prefix of 8
    or more tokens of a row continues greedily as the row does: the prompts of the decoder tests."""
    return continuations(m, 16, seed)


def train_head(m: EarlyExitModel, *, steps: int = 150, seed: int = 0, **options) -> Eagle3Head:
    """A head trained ``steps`` Adam steps on ``training_sequences(m)`` (it learns them by heart: its drafts
    on their prefixes are accepted); its draft vocabulary is the tokens of those sequences (a subset of the
    target's: drafts map draft ids to target ids). ``options``: ``Eagle3Config`` fields."""
    torch.manual_seed(seed)
    ids = training_sequences(m, seed)
    seen = ids.unique().tolist()
    head = Eagle3Head(head_config(m, len(seen), **options))
    head.set_draft_vocab(seen)
    batch = target_batch(m, ids, head.config.aux_layer_ids)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            loss, count, _ = ttt_loss(head, batch, steps=3, kind="ce")
            optimizer.zero_grad()
            (loss / count).backward()
            optimizer.step()
    return head.eval()


@functools.cache
def head_dir(m: EarlyExitModel, steps: int = 150) -> str:
    """The directory of ``train_head(m)`` saved with ``save_eagle3`` (one per model for the session)."""
    head = train_head(m, steps=steps)
    out = Path(tempfile.mkdtemp(prefix="fastdecode-eagle3-")) / "head"
    save_eagle3(head, head.config, out, verifier_name="tiny")
    return str(out)


def random_head_dir(out: Path, name: str = "tiny-llama") -> str:
    """A random-init head for the tiny model ``name``, saved in ``out/eagle3``: for checks of the files only."""
    config = tiny_model(name)[0].config
    aux = tiny_aux_layers(config.num_hidden_layers)
    head = Eagle3Head(Eagle3Config.from_target(config, draft_vocab_size=config.vocab_size, aux_layer_ids=aux))
    return str(save_eagle3(head, head.config, out / "eagle3", verifier_name=name))


def random_tiny_vocab_head(m: EarlyExitModel, out: Path) -> str:
    """A random-init head for ``tests.helpers.tiny_vocab_model()`` over 6 of its 8 tokens (its q far from p
    and far from one-hot: what sampling tests need), saved in ``out/head``."""
    config = Eagle3Config.from_target(m.config, draft_vocab_size=6, aux_layer_ids=[0, 1, 1])
    torch.manual_seed(0)
    head = Eagle3Head(config)
    head.set_draft_vocab([0, 1, 2, 3, 5, 7])
    return str(save_eagle3(head, config, out / "head", verifier_name="tiny"))
