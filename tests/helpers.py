"""Builders shared by several test modules: the tiny models (cached), tiny models with lively weights, draft
models, random exit adapters, random prompts and examples, synthetic CLLM records, exact target distributions
and chi-square p-values for the sampling tests, a chat jsonl, a free port, a second EOS id declared in a
model's generation config; the tolerances two computations of the same values are compared with (rounding
over the sums they chain: ``kernel_tolerance`` and its model, gradient, linear and EAGLE-3 forms). Composed
job configs are in ``tests/job_configs.py``, fake PyPI assets in ``tests/fake_assets.py``."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import random
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm_train.records import first_mismatch, validate_record
from fastdecode.config import ModelConfig, load_group
from fastdecode.data.chat import user_prompt_ids
from fastdecode.decoding.autoregressive import generate as autoregressive
from fastdecode.decoding.common import probabilities
from fastdecode.decoding.config import DecodeConfig
from fastdecode.drafters.exits.adapter import build_adapter, save_adapter
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from recipes.common import forward_reduction


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


@torch.no_grad()
def redraw_matrices(model: torch.nn.Module, std: float, seed: int) -> None:
    """Replace every 2-D parameter of ``model`` by N(0, std^2) draws (one generator, parameter order)."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.dim() == 2:
            param.copy_(torch.randn(param.shape, generator=gen) * std)


@functools.cache
def lively_model(name: str, upper_scale: float = 1.0, zero_from: int | None = None) -> EarlyExitModel:
    """A copy of a tiny model with larger random weights (std 0.2): the shared ones just repeat a token.

    ``upper_scale`` shrinks what layers >= 1 write into the residual stream, so early exits agree with the
    final output often (acceptance ~0.5-0.8); ``zero_from=E`` zeroes it for layers >= E (exit E == output).
    """
    model = copy.deepcopy(tiny_model(name)[0])
    redraw_matrices(model, 0.2, seed=0)
    m = EarlyExitModel(model)
    with torch.no_grad():
        for index, layer in enumerate(m.layers):
            for pname, param in layer.named_parameters():
                if pname.rsplit(".", 1)[0] in m.family.residual_writers:  # what writes into the residual
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


@functools.cache
def tiny_model(name: str):
    """``(hf_model, tokenizer)`` of a tiny random-init model (``configs/model/<name>.yaml``), fp32 on the CPU,
    shared by every test (do not train it)."""
    torch.use_deterministic_algorithms(False)
    model, tokenizer = load_model(load_group("model", name, ModelConfig, dtype="float32", device="cpu"))
    return model, tokenizer


def assisted_target() -> EarlyExitModel:
    """The tiny Llama target: 4 layers whose upper layers write little, so shallow copies draft well."""
    return lively_model("tiny-llama", 0.1)


@functools.cache
def draft_model(kind: str) -> EarlyExitModel:
    """``copy``: a 2-layer tiny Llama holding the target's embeddings, first two layers and head (so it
    drafts exactly like self-speculation with E=2). ``window``: the same weights in a 2-layer tiny *Mistral*
    (sliding window 16: windows across holes in the drafter's cache). ``other``: an unrelated 1-layer tiny
    Qwen2 of width 32 (attention biases): acceptance near 0, every rejection path."""
    name, overrides = {
        "copy": ("tiny-llama", {"num_hidden_layers": 2}),
        "window": ("tiny-mistral", {"num_hidden_layers": 2}),
        "other": ("tiny-qwen2", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}),
    }[kind]
    base = load_group("model", name, ModelConfig)
    cfg = load_group(
        "model",
        name,
        ModelConfig,
        dtype="float32",
        device="cpu",
        random_init={**base.random_init, **overrides},
    )
    model, _ = load_model(cfg)
    with torch.no_grad():
        if kind in ("copy", "window"):
            missing = model.load_state_dict(assisted_target().hf.state_dict(), strict=False).missing_keys
            assert not missing  # only the target's layers >= 2 are left over
        else:
            redraw_matrices(model, 0.2, seed=1)
    return EarlyExitModel(model)


@functools.cache
def tiny_vocab_draft() -> EarlyExitModel:
    """An unrelated 1-layer drafter over the 8-token vocabulary of ``tiny_vocab_model``."""
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,  # shorter than the target's 64
        initializer_range=0.15,
    )
    torch.manual_seed(1)
    return EarlyExitModel(LlamaForCausalLM(config).eval())


def random_examples(n: int = 6, length: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(5, 250, (length + i,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    return out


def perturbed_adapter(m: EarlyExitModel, exit_layer: int, kind: str, seed: int = 0, std: float = 0.05):
    """A random, untrained adapter: a copied layer plus noise, so its drafts differ from the raw exit's."""
    adapter = build_adapter(m, exit_layer, kind, "exit" if exit_layer % 2 else "last")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * std)
    return adapter


def tiny_llama_adapter(tmp_path: Path, exit_layer: int, kind: str = "block") -> str:
    """A random adapter for the shared tiny-llama (what ``model=tiny-llama`` loads), saved under tmp_path."""
    model, tokenizer = tiny_model("tiny-llama")
    m = EarlyExitModel(model)
    adapter = perturbed_adapter(m, exit_layer, kind, std=0.02)
    return str(save_adapter(adapter, tmp_path / f"adapter-E{exit_layer}", m, tokenizer))


def sharegpt_conversation(i: int, n_turns: int = 2) -> dict:
    turns = [
        {"from": "human" if k % 2 == 0 else "gpt", "value": f"turn {k} of conv {i} ✓"} for k in range(n_turns)
    ]
    return {"id": f"c{i}", "conversations": turns}


def synthetic_records(prompts: int = 6, n: int = 4, seed: int = 0, labels: bool = True) -> list[dict]:
    """Schema-valid trajectory records: two blocks per prompt, 0-3 non-fixed states each, ids in [5, 261)."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(5, 261) for _ in range(k)]

    records = []
    for p in range(prompts):
        prompt, reply = ids(rng.randint(3, 8)), ids(rng.randint(4, 10))
        prefix = list(prompt)
        for block in range(2):
            fixed = ids(n)
            states = []
            for m in sorted(rng.sample(range(n), rng.randint(0, 3))):  # increasing first mismatches
                wrong = fixed[m] + 1 if fixed[m] < 260 else 5
                states.append(fixed[:m] + [wrong] + ids(n - m - 1))
            states.append(fixed)
            rec = {
                "prompt_id": f"p{p}",
                "block": block,
                "prefix": list(prefix),
                "states": states,
                "first_mismatch": [first_mismatch(s, fixed) for s in states],
                "fixed_point": fixed,
                "eos": False,
                "labels": reply if labels else None,
                "prompt_len": len(prompt),
            }
            records.append(validate_record(rec))
            prefix += fixed
    return records


def declare_second_eos(model: torch.nn.Module, tokenizer) -> int:
    """Declare a second EOS id in ``model``'s generation config, beside the tokenizer's (as a chat model's
    ``generation_config.json`` lists its end-of-turn id): the token the model generates first after a chat
    prompt. The default tiny init repeats that one token whatever the prompt, so every path that stops at
    ``fastdecode.tokens.eos_ids`` ends each row after it; one that reads the tokenizer's EOS alone does not."""
    prompt = user_prompt_ids(tokenizer, "hello")
    first = autoregressive(EarlyExitModel(model), [prompt], DecodeConfig(max_new_tokens=1)).tokens[0][0]
    assert first != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    return first


def second_eos_loader(load: Callable, declared: list[int]) -> Callable:
    """``load`` (a ``load_model``) whose models declare a second EOS id (``declare_second_eos``), each id
    appended to ``declared``."""

    def loader(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        declared.append(declare_second_eos(model, tokenizer))
        return model, tokenizer

    return loader


def assert_drafted_and_accepted(out, *context) -> None:
    """``out`` (a speculative decoder's ``DecodeOutput``) came from drafting: tokens were drafted and some
    accepted. An equality test alone would pass with drafting off (every round a plain step)."""
    drafted, accepted = sum(out.drafted), sum(out.accepted)
    assert drafted > 0 and accepted > 0, (*context, f"drafted {drafted}, accepted {accepted}")


PAD = (1, 4, 4, 6, 6, 6)  # T = 1..6 positions verified as these many (``CostModel.run_length``)


def padded_verification(monkeypatch) -> list[tuple[int, int]]:
    """Make every speculative call price with the estimated costs, but verify T = 1..6 positions as ``PAD``
    (what a measured cost model asks where a larger T ran cheaper); returns the ``(k + 1, run)`` pairs the
    verifications were given, appended as they happen."""
    from fastdecode.decoding import kinds as drafters
    from fastdecode.decoding import speculative
    from fastdecode.plan.cost import estimate_costs

    def costs(m, source, *, batch=1):
        est = estimate_costs(m)
        return replace(est, tokens=(1, 2, 3, 4, 5, 6), layer=est.layer * 6, head=est.head * 6, pad=PAD)

    seen: list[tuple[int, int]] = []
    real = speculative.verify

    def verify(m, cache, r, draft, features=(), *, run=0):
        seen.append((draft.k + 1, run))
        return real(m, cache, r, draft, features, run=run)

    monkeypatch.setattr(drafters, "cost_model", costs)
    monkeypatch.setattr(speculative, "verify", verify)
    return seen


def kernel_tolerance(dtype: torch.dtype, reduction: int, magnitude: float) -> dict[str, float]:
    """``assert_close`` tolerances for two computations of the same values whose sums may run in another order
    or kernel (one row against a batch, a cache against a whole pass, AVX2 against AVX-512): the worst-case
    error of a dot product of ``reduction`` terms of size ``magnitude``, ``reduction * u * magnitude`` with u
    the unit roundoff of ``dtype`` (Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.5), and
    the same bound relative to the values. ``reduction``: the summed lengths of the reductions in the chain."""
    u = torch.finfo(dtype).eps / 2
    return {"atol": reduction * u * magnitude, "rtol": reduction * u}


def model_tolerance(config, positions: int, reference: torch.Tensor, extra: int = 0) -> dict[str, float]:
    """``kernel_tolerance`` for a model's outputs (logits, hidden states, keys) computed two ways: the sums of
    one forward of the HF ``config`` over ``positions`` (``recipes.common.forward_reduction``) plus ``extra``
    (a loss's log-softmax and mean), at the size of ``reference``'s largest value."""
    reduction = forward_reduction(config, positions) + extra
    return kernel_tolerance(reference.dtype, reduction, float(reference.abs().max()))


def gradient_tolerance(config, positions: int, tokens: int, reference: torch.Tensor) -> dict[str, float]:
    """``kernel_tolerance`` for the gradient of a language-model loss over ``tokens`` scored positions
    computed two ways: the loss's sums (the forward, the log-softmax over the vocabulary, the mean), the
    backward through the same sums transposed, and a weight's sum over the tokens; at the size of
    ``reference``'s largest value (the gradient of the same tensor)."""
    loss = forward_reduction(config, positions) + config.vocab_size + tokens
    return kernel_tolerance(reference.dtype, 2 * loss + tokens, float(reference.abs().max()))


def linear_tolerance(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> dict[str, float]:
    """``kernel_tolerance`` for ``F.linear(x, weight, bias)`` computed by two kernels: sums of the in-features
    (and the bias), of size the largest ``|x| @ |weight|.T + |bias|`` (Higham's ``|x|^T |y|``)."""
    size = x.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    return kernel_tolerance(x.dtype, weight.shape[1] + (bias is not None), float(size.max()))


def eagle3_reduction(cfg, keys: int) -> int:
    """The summed lengths of the sums one step of an EAGLE-3 head (``Eagle3Config`` ``cfg``) chains over
    ``keys`` attended positions: the fc over the three features (and their norms), the three RMS norms, q and k over the
    concatenated input, q.k, the softmax and its weighted sum, o_proj, the MLP, the final norm and the head."""
    hidden, attention = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    norms, qk, mlp = 3 * hidden, 2 * (2 * hidden), 2 * hidden + cfg.intermediate_size
    layer = norms + qk + cfg.head_dim + 2 * keys + attention + mlp
    features = (2 if cfg.fc_norm or cfg.norm_before_fc else 1) * 3 * cfg.target_hidden_size  # their norms
    return features + layer + 2 * hidden
