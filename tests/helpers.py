"""Builders shared by several test modules: tiny models with lively weights, random prompts, exact target
distributions and chi-square p-values for the sampling tests, a chat jsonl, a free port."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import socket
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastdecode.decoding import DecodeConfig
from fastdecode.decoding.common import probabilities
from fastdecode.model import EarlyExitModel
from tests.conftest import _tiny


def write_chat_jsonl(path: Path, n: int = 32) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            reply = " ".join(str((i * j) % 10) for j in range(6))
            f.write(json.dumps({"prompt": f"Multiply {i} by one to six.", "response": reply}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RESIDUAL_WRITERS = ("o_proj", "down_proj", "out_proj", "fc2")  # modules that write into the residual stream


@functools.cache
def lively_model(name: str, upper_scale: float = 1.0, zero_from: int | None = None) -> EarlyExitModel:
    """A copy of a tiny model with larger random weights (std 0.2): the shared ones just repeat a token.

    ``upper_scale`` shrinks what layers >= 1 write into the residual stream, so early exits agree with the
    final output often (acceptance ~0.5-0.8); ``zero_from=E`` zeroes it for layers >= E (exit E == output).
    """
    model = copy.deepcopy(_tiny(name)[0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        for index, layer in enumerate(EarlyExitModel(model).layers):
            for pname, param in layer.named_parameters():
                if pname.split(".")[-2] in RESIDUAL_WRITERS:
                    param.mul_(upper_scale if index >= 1 else 1.0)
                    if zero_from is not None and index >= zero_from:
                        param.zero_()
    return EarlyExitModel(model)


def random_prompts(count: int, seed: int, vocab: int = 261, longest: int = 14) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=gen).tolist()
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.cache
def tiny_vocab_model() -> EarlyExitModel:
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return EarlyExitModel(LlamaForCausalLM(config).eval())


def exact_joint(m: EarlyExitModel, prompt: list[int], n: int, cfg: DecodeConfig) -> torch.Tensor:
    """P(t1..tn | prompt) of the target after cfg's logits processing: ``[V] * n``."""
    vocab = m.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=n - 1)))  # [V^(n-1), n-1]
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        probs = probabilities(m.hf(ids).logits[:, len(prompt) - 1 :], cfg)  # [V^(n-1), n, V]
    joint = torch.ones(len(prefixes))
    for i in range(n - 1):
        joint = joint * probs[torch.arange(len(prefixes)), i, prefixes[:, i]]
    return (joint[:, None] * probs[:, -1]).reshape([vocab] * n)


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected < 5 are pooled; a sample in an impossible cell gives 0."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: (X/k)^(1/3) is close to normal
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def pair_pvalues(tokens: list[list[int]], joint: torch.Tensor) -> list[float]:
    samples = torch.tensor(tokens)  # [N, n]
    n, vocab = samples.shape[1], joint.shape[0]
    pvalues = []
    for i in range(n - 1):
        keep = [d for d in range(n) if d not in (i, i + 1)]
        expected = joint.sum(keep) * len(samples) if keep else joint * len(samples)
        observed = torch.zeros(vocab, vocab).index_put_(
            (samples[:, i], samples[:, i + 1]), torch.ones(len(samples)), accumulate=True
        )
        pvalues.append(chi2_pvalue(observed, expected))
    return pvalues
