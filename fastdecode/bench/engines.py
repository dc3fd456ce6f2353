"""How the benchmark calls each method, and how every method's output is counted the same way.

Every runner takes token-id prompts and returns a ``DecodeOutput`` whose ``tokens`` hold the generated ids per
row, EOS included once and nothing after it (``cut_at_eos`` trims Hugging Face's padded output). ``HFRunner``
calls ``generate`` with a clean ``GenerationConfig`` that holds only the benchmark's knobs and the method's
options. Why: docs/design/bench.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from fastdecode.bench.config import Method, SpeedJob
from fastdecode.config import ConfigError, to_dataclass
from fastdecode.decoding.common import check
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.registry import get_decoder, memory_scope
from fastdecode.runtime.model import EarlyExitModel


def cut_at_eos(row: list[int], eos: set[int]) -> list[int]:
    """``row`` up to and including its first EOS token (all of it when there is none)."""
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row


class FastdecodeRunner:
    """One of our strategies (``fastdecode.registry.DECODERS``) with the method's ``DecodeConfig``."""

    def __init__(
        self, method: Method, m: EarlyExitModel, draft: EarlyExitModel | None, job: SpeedJob, eos: set[int]
    ) -> None:
        self.decode, self.name = get_decoder(method.spec.decoder or method.name), method.name
        self.m, self.draft = m, draft if method.spec.uses_draft else None
        shared = {
            "max_new_tokens": job.max_new_tokens,
            "top_k": job.top_k,
            "top_p": job.top_p,
            "seed": job.seed,
        }
        shared["eos_token_id"] = sorted(eos) or None
        self.cfg = to_dataclass(DecodeConfig, shared | method.options, f"decoder.{method.name}.options")
        self.counters = True

    def check(self, prompts: list[list[int]]) -> None:
        """Prompt and exit-layer checks against the loaded model (cheap; before any decoding)."""
        check(self.cfg, self.m, prompts)

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> DecodeOutput:
        cfg = dataclasses.replace(self.cfg, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        with memory_scope(self.name):  # each method its own memory of earlier outputs (suffix decoding)
            return self.decode(self.m, prompts, cfg, draft=self.draft)


class AutoRunner:
    """``generate(method="auto")`` of the library facade (``fastdecode.api.FastDecoder``) on the token ids:
    the plan's first candidate for the batch's size, with the options it was priced with."""

    def __init__(self, method: Method, decoder, job: SpeedJob, m: EarlyExitModel) -> None:
        self.decoder, self.m = decoder, m
        self.options = dict(method.options) | {"top_k": job.top_k, "top_p": job.top_p}
        if job.corpus:  # suffix decoding over it where the plan drafts by prompt lookup (choose.with_corpus)
            self.options["corpus"] = job.corpus
        self.counters = True
        self.ran: set[str] = set()  # the candidates it ran

    def check(self, prompts: list[list[int]]) -> None:
        check(DecodeConfig(max_new_tokens=1), self.m, prompts)

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> DecodeOutput:
        result = self.decoder.generate(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **self.options
        )
        self.ran.add(result.candidate.name)
        return result.output


@contextlib.contextmanager
def swapped_generation_config(models: list[nn.Module], config) -> Iterator[None]:
    """Give every model in ``models`` the generation config ``config`` for the duration of the block."""
    saved = [model.generation_config for model in models]
    try:
        for model in models:
            model.generation_config = config
        yield
    finally:
        for model, old in zip(models, saved, strict=True):
            model.generation_config = old


class HFRunner:
    """Hugging Face ``model.generate``: plain, ``assistant_early_exit=E`` or ``assistant_model=draft``."""

    def __init__(self, method: Method, model, draft, job: SpeedJob, eos: set[int], pad_id: int) -> None:
        self.model, self.assistant = model, draft if method.spec.uses_draft else None
        self.options, self.eos, self.pad_id = dict(method.options), eos, pad_id
        self.top_k, self.top_p = job.top_k, job.top_p
        self.counters = False
        exit_layer = self.options.get("assistant_early_exit")
        layers = model.config.num_hidden_layers
        if exit_layer is not None and not 1 <= exit_layer <= layers - 1:
            raise ConfigError(
                f"method '{method.name}': assistant_early_exit={exit_layer} but the model has {layers} layers; "
                f"use 1 <= exit_layer <= {layers - 1}."
            )

    def check(self, prompts: list[list[int]]) -> None:
        """Nothing to check beyond the constructor's: HF validates its own inputs."""

    def layers(self) -> list[nn.Module]:
        """The decoder layers this method runs: the model's, and the assistant's when there is one."""
        models = [self.model] + ([self.assistant] if self.assistant is not None else [])
        return [layer for model in models for layer in EarlyExitModel(model).layers]

    def _config(self, max_new_tokens: int, temperature: float):
        from transformers import GenerationConfig

        sampling = {}
        if temperature > 0:  # top_k=0 / top_p=1 switch HF's default top_k=50 off, as in our decoders
            sampling = {"temperature": temperature, "top_k": self.top_k or 0, "top_p": self.top_p or 1.0}
        eos = sorted(self.eos) or None
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=self.pad_id,
            **sampling,
            **self.options,
        )

    @torch.inference_mode()
    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> DecodeOutput:
        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        config = self._config(max_new_tokens, temperature)
        # The models' own config must not hold assistant_early_exit: the early-exit drafter's inner generate
        # fills its unset fields from it and would nest another assisted generation (re-prefilling the prompt
        # every round; transformers 5.24). The call's config carries it.
        own = copy.deepcopy(config)
        own.assistant_early_exit = None
        models = [self.model] + ([self.assistant] if self.assistant is not None else [])
        if temperature > 0:
            torch.manual_seed(seed)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        with swapped_generation_config(models, own):
            out = self.model.generate(
                ids.to(device), attention_mask=mask.to(device), generation_config=config, **extra
            )
        rows = out[:, width:].tolist()
        return DecodeOutput(tokens=[cut_at_eos(row, self.eos) for row in rows])


class LayerCounter:
    """Counts decoder-layer calls and layer x token applications with forward pre-hooks.

    Used on untimed passes only (the hooks cost a few microseconds per layer call): it measures how many layers
    HF's methods run per token, which ``generate`` does not report.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.calls = 0
        self.tokens = 0
        self._handles: list = []

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.calls += 1
        self.tokens += hidden.shape[0] * hidden.shape[1]

    def __enter__(self) -> LayerCounter:
        self._handles = [
            layer.register_forward_pre_hook(self._hook, with_kwargs=True) for layer in self.layers
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def count_layers(runner: HFRunner, prompts: list[list[int]], max_new_tokens: int, temperature: float):
    """Layers run per new token and sequential layer calls per token, for a method that does not report them.

    Two untimed calls, ``max_new_tokens`` and 1; their difference removes the prefill (of the model and, for an
    assistant, of the drafter). Counts the assistant's layers too. Returns ``(layers_per_token,
    layer_calls_per_token)``, or Nones when the call made no token after the first.
    """
    results = []
    for budget in (max_new_tokens, 1):
        with LayerCounter(runner.layers()) as counter:
            out = runner(prompts, budget, temperature, 0)
        results.append((counter.tokens, counter.calls, out.num_tokens, max(len(r) for r in out.tokens)))
    (tokens, calls, new, longest), (tokens_1, calls_1, new_1, _) = results
    if new <= new_1 or longest <= 1:
        return None, None
    return (tokens - tokens_1) / new, (calls - calls_1) / longest
