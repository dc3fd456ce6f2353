"""fastdecode as a library: one call loads a model with what its checkpoint records, one call generates.

    >>> fd = fastdecode.from_pretrained("outputs/layerskip-smollm2-135m/final")  # or a hub id, "tiny-llama"
    >>> out = fd.generate("What is 2 + 2?", max_new_tokens=32)  # out.text, out.method, out.acceptance

It owns ``FastDecoder`` (a model with its checkpoint's defaults and the plan ``auto`` runs) and
``GenerationResult``. It stands on the decoders and the loader only. Details: docs/design/core.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdecode.config import ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode.decoding.chain import Books, as_run, carrying
from fastdecode.decoding.common import configure_engine, streaming
from fastdecode.decoding.config import DecodeConfig, DecodeOutput, merged_options
from fastdecode.drafters.exits.adapter import CHECKPOINT_DIR, INDEX_FILE, META_FILE, resolve_adapter
from fastdecode.files.assets import is_local_path
from fastdecode.files.checkpoint_info import checkpoint_label, recommended_exit
from fastdecode.files.draft_vocab_file import DRAFT_VOCAB_FILE
from fastdecode.inputs import prompt_ids
from fastdecode.plan.acceptance import AcceptanceRecord, read_record
from fastdecode.plan.choose import PLAN_OWNED, Candidate, Plan, plan_decoding, plan_files, with_corpus
from fastdecode.plan.cost import cost_batch, cost_model
from fastdecode.registry import check_drafter, corpus_fingerprint, corpus_options, get_decoder, load_corpus
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from fastdecode.skipdecode import SkipOptions, read_trained_policy, trained_options, trained_policy_file
from fastdecode.tokens import eos_ids

try:
    __version__ = importlib.metadata.version("fastdecode")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# Hugging Face ``generate`` / ``GenerationConfig`` names -> ``DecodeConfig`` fields (same meaning).
ALIASES = {
    "assistant_early_exit": "exit_layer",
    "num_assistant_tokens": "draft_tokens",
    "num_assistant_tokens_schedule": "policy",
    "assistant_confidence_threshold": "confidence_threshold",
}
SCHEDULES = {"constant": "constant", "heuristic": "heuristic", "heuristic_transient": "heuristic"}
AUTO = "auto"  # generate(method=AUTO): the plan's first decoder (fastdecode/plan/choose.py)
# beside an EAGLE-3 head (recipe=eagle3's final/): a suffix corpus of the answers it was trained on, read by auto
DRAFTER_CORPUS = "corpus.sfx"
# DecodeConfig fields that select the execution engine and the cost model: what a plan depends on
ENGINE_FIELDS = ("fast_layers", "fast_linear", "linear_kernel", "static_cache", "compile", "costs", "weights")


@dataclasses.dataclass
class GenerationResult:
    """One ``generate`` call: ``texts``/``ids`` (new tokens only, one entry per input row, EOS kept in ids
    and dropped from texts), ``output`` (the decoder's ``DecodeOutput``: every count), the ``config`` used."""

    texts: list[str]
    ids: list[list[int]]
    output: DecodeOutput
    config: DecodeConfig
    method: str  # the decoder that ran (``auto`` resolved)
    single: bool  # the input was one prompt: ``text`` is its string
    candidate: Candidate | None = None  # what ``auto`` ran: the plan's candidate, with its expected speedup

    @property
    def text(self) -> str | list[str]:
        return self.texts[0] if self.single else self.texts

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens (speculative methods; None for the others)."""
        return self.output.acceptance_rate if self.output.drafted else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens emitted per verification and row: accepted + the verifier's own (None: no verification)."""
        if not self.output.accepted:
            return None
        return (sum(self.output.accepted) + len(self.output.accepted)) / len(self.output.accepted)

    @property
    def layers_per_token(self) -> float:
        return self.output.layers_per_token

    @property
    def ran(self) -> str:
        """``auto``'s candidate or the method, and when a chain's fallback retired (``fallback_retired``)."""
        return as_run(self.candidate.name if self.candidate else self.method, self.output.fallback_retired)

    def __repr__(self) -> str:
        return f"GenerationResult(ran={self.ran!r}, texts={self.texts!r}, acceptance={self.acceptance})"


def _model_config(source: str | ModelConfig, **placement: Any) -> tuple[ModelConfig, Path | None]:
    """``source`` -> (model config, the checkpoint directory it reads defaults from, if local)."""
    if isinstance(source, ModelConfig):
        cfg = dataclasses.replace(source, **placement)
        path = cfg.name_or_path
        return cfg, Path(path) if path and Path(path).is_dir() else None
    given, source = source, str(Path(source).expanduser()) if source.startswith("~") else source
    if Path(source).is_dir():
        cfg = ModelConfig(name=checkpoint_label(source), source="hub", name_or_path=str(source), **placement)
        return cfg, Path(source)
    if source in group_choices("model"):
        cfg = load_group("model", source, ModelConfig, **placement)
        path = cfg.name_or_path
        return cfg, Path(path) if path and Path(path).is_dir() else None
    if is_local_path(source):  # not a directory (above), so it is missing or a file
        what = "is not a directory" if Path(source).exists() else "does not exist"
        raise ConfigError(
            f"from_pretrained({given!r}): the path {what}; give a model directory (config.json, weights, "
            "tokenizer), a hub id (owner/name) or a configs/model name."
        )
    if "/" in source:  # a hub id: transformers names it if it does not exist
        return ModelConfig(name=source.split("/")[-1], source="hub", name_or_path=source, **placement), None
    raise ConfigError(
        f"from_pretrained({source!r}): neither a model directory, a hub id (owner/name) nor a configs/model "
        f"name ({', '.join(group_choices('model'))})."
    )


def from_pretrained(
    source: str | ModelConfig,
    *,
    device: str = "auto",
    dtype: str = "auto",
    adapter: str | None = None,
    skip_file: str | None = "auto",
    drafter: str | None = None,
) -> FastDecoder:
    """Load ``source`` (a checkpoint directory, a hub id, a ``configs/model`` name or a ``ModelConfig``) and
    its tokenizer; ``adapter``: an exit adapter directory (default: ``exit_adapter/`` inside the directory);
    ``skip_file``: the ``skipdecode.json`` whose SkipDecode policy ``method="skipdecode"`` keeps to
    (``"auto"``: the directory's own, when it has one; None: none, the options alone); ``drafter``: an EAGLE-3
    head or a DFlash drafter directory (``method="eagle3"``'s or ``method="dflash"``'s default, told apart by
    its config, ``registry.drafter_kind``; planned by ``auto`` when it records its acceptance)."""
    cfg, directory = _model_config(source, device=device, dtype=dtype)
    recommended_exit(directory)  # a recorded exit that is no layer of the model fails before the weights load
    skip_file = trained_policy_file(directory, skip_file)  # a bad file fails before the weights load
    trained_skip = read_trained_policy(skip_file) if skip_file else None
    record = read_record(directory)  # so does a damaged acceptance record
    if drafter is not None:
        check_drafter(drafter)  # and a missing or damaged drafter directory
    model, tokenizer = load_model(cfg)
    return FastDecoder(
        model,
        tokenizer,
        directory=directory,
        adapter=adapter,
        recommended=cfg.recommended_exit,
        skip_file=skip_file,
        trained_skip=trained_skip,
        record=record,
        drafter=drafter,
    )


def _one_call_at_a_time(method: Callable) -> Callable:
    """``method`` of a ``FastDecoder`` holds its model's lock (``EarlyExitModel.lock``, one per HF model) for
    the whole call: threads calling ``generate`` on one decoder, or on decoders sharing a model, take turns,
    so the engine a call selects, the plan cache, the books carried across calls and the tokenizer stay its
    own."""

    @functools.wraps(method)
    def call(self: FastDecoder, *args: Any, **kwargs: Any) -> Any:
        with self.m.lock:
            return method(self, *args, **kwargs)

    return call


class FastDecoder:
    """A model, its tokenizer and its checkpoint's decoding defaults; ``generate`` is the one call
    (thread-safe: calls on one model are serialised, ``_one_call_at_a_time``)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        directory: Path | None = None,
        adapter: str | None = None,
        recommended: int | None = None,
        skip_file: str | None = None,
        trained_skip: SkipOptions | None = None,
        record: AcceptanceRecord | None = None,
        m: EarlyExitModel | None = None,
        drafter: str | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.m = m if m is not None else EarlyExitModel(model)  # ``m``: share one wrapper (its engine, costs)
        self.directory = directory
        self.defaults = _checkpoint_defaults(directory, adapter, recommended)
        self.adapter = self.defaults["self_speculative"].get("adapter")
        self.drafter = drafter  # an EAGLE-3 head (decoder 'eagle3') or a DFlash drafter (decoder 'dflash')
        self._fingerprint: dict | None = None  # the tokenizer's, for corpus files (``_check_corpus``)
        if drafter is not None:
            self.defaults[check_drafter(drafter)] = {"drafter": drafter}  # its kind's default
        self.record = record if record is not None else read_record(directory)
        # the SkipDecode policy the checkpoint was trained with (``skip_file``), kept to by ``skipdecode``
        self.skip_file, self.trained_skip = skip_file, trained_skip
        self._plans: dict[tuple, Plan] = {}
        self._books: dict[str, Books] = {}  # per planned candidate: its chain judge's books (auto only)

    @_one_call_at_a_time
    def plan(self, batch: int = 1, **engine: Any) -> Plan:
        """The lossless decoders the cost model expects to pay on this model with what its checkpoint records
        (``fastdecode.plan.choose.plan_decoding``), for batches of ``batch`` rows on the execution engine that
        ``engine`` selects (``DecodeConfig``'s engine fields and ``costs``; default: the device's). One plan
        per engine, thread count, batch size and version of the head's and adapter's files (``plan_files``);
        the cost model is measured once per machine and kept on disk (``fastdecode/plan/cost_store.py``).
        ``drafter``: an EAGLE-3 head or a DFlash drafter to plan with (default: the one given at load)."""
        cfg = to_dataclass(DecodeConfig, {"max_new_tokens": 1} | engine, "plan()")
        drafter = cfg.drafter or self.drafter
        configure_engine(self.m, cfg)
        engine_options = None if self.m.engine is None else self.m.engine.options
        adapter = resolve_adapter(self.adapter) if self.adapter else None  # its record: adapters.json beside
        files = plan_files(drafter, adapter, adapter and adapter.parent / INDEX_FILE)  # changed: plan again
        key = (engine_options, torch.get_num_threads(), cost_batch(batch), cfg.costs, drafter, files)
        if key not in self._plans:
            costs = cost_model(self.m, cfg.costs, batch=batch)
            self._plans[key] = plan_decoding(
                self.m, costs, record=self.record, adapter=self.adapter, drafter=drafter
            )
        return self._plans[key]

    @_one_call_at_a_time
    def generate(
        self,
        inputs: str | list[str] | list[int] | list[list[int]] | torch.Tensor | dict,
        *,
        max_new_tokens: int = 64,
        method: str = AUTO,
        streamer: Any = None,
        chat: bool | None = None,
        corpus: str | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Decode ``inputs``: a text, a list of texts, token ids (``[T]`` list or tensor), a batch of them
        (``[[...], ...]``, ``[B, T]`` tensor) or a tokenizer batch (``input_ids`` + ``attention_mask``, left or
        right padded). ``method``: a decoder name (``fastdecode.registry.decoder_names()``), or ``auto``: the
        plan's first candidate for this batch size, run with exactly the options it was priced with
        (``plan``; a chain's judge keeps its books across calls, ``decoding/chain.py``: a fallback that does
        not pay on this workload stops costing trial rounds), or ``self_speculative`` when ``options`` name an
        exit or an adapter. ``options``: ``DecodeConfig`` fields or their HF aliases, the aliases renamed
        first (``num_assistant_tokens=5`` is ``draft_tokens=5``); given ones override the plan's and the
        checkpoint's defaults, an option group given as a mapping key by key (``suffix={"global_size": 0}``
        keeps the plan's other suffix options; an options object, ``SuffixOptions(...)``, states every field
        and replaces the group). ``chat``: render texts through the chat template (None: when the tokenizer
        has one). ``streamer``: an HF-style streamer (``put(ids)``, ``end()``), batch 1 only. ``corpus``: a
        suffix index file (``fastdecode-suffix-index``) for ``method="suffix"`` (or a chain with suffix
        decoding first: ``chain=True, suffix={"first": True}``; ``auto`` drafts by suffix decoding over it
        where it would draft by prompt lookup; without it, over the one beside its head, ``drafter_corpus``),
        checked against this model's tokenizer first, as is a corpus named by ``suffix={"corpus": PATH}``."""
        if corpus is not None:  # a foreign, damaged or too large file fails here, before any work
            self._check_corpus(corpus, options.get("suffix"))
        prompts, single = self._prompts(inputs, chat)
        options, candidate = _renamed(options), None  # aliases first: what the plan's options are merged with
        if method == AUTO and not {"exit_layer", "adapter"} & set(options):
            engine = {k: v for k, v in options.items() if k not in PLAN_OWNED and k in ENGINE_FIELDS}
            engine |= {"drafter": options["drafter"]} if options.get("drafter") else {}
            candidate = self.plan(len(prompts), **engine).best
            candidate = over_corpus(candidate, corpus, engine.get("drafter") or self.drafter)
            method, options = candidate.method, merged_options(candidate.options, options)
        elif method == AUTO:  # an exit or adapter given by hand: draft there
            method = "self_speculative"
        if corpus is not None:
            options = self._with_corpus(method, corpus, options)
        cfg = self.config(method, max_new_tokens=max_new_tokens, defaults=candidate is None, **options)
        named = cfg.groups.get("suffix")  # a corpus named by the options (suffix={"corpus": PATH}) too
        if corpus is None and named is not None and getattr(named, "corpus", None) is not None:
            self._check_corpus(named.corpus, named)
        if streamer is not None and len(prompts) > 1:
            raise ConfigError(f"streamer= streams one row; got a batch of {len(prompts)}: pass one prompt.")
        decoder = get_decoder(method)
        # a planned chain's judge keeps its books across calls: what pays on this workload is learnt
        books = self._books.setdefault(candidate.name, Books()) if candidate is not None else Books()
        with carrying(books):
            if streamer is None:
                out = decoder(self.m, prompts, cfg)
            else:
                streamer.put(torch.tensor([prompts[0]]))
                with streaming(lambda row, new: streamer.put(torch.tensor([new]))):
                    out = decoder(self.m, prompts, cfg)
                streamer.end()
        texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in out.tokens]
        return GenerationResult(texts, out.tokens, out, cfg, method, single, candidate)

    def _check_corpus(self, corpus: str, suffix: Any = None) -> None:
        """The corpus file checked against the model, its tokenizer and the given ``suffix`` options' size bound
        (loaded once per file version: decoding drafts from the same load)."""
        if self._fingerprint is None:  # the vocabulary hashed once, not every call
            self._fingerprint = corpus_fingerprint(self.tokenizer)
        load_corpus(corpus, self.m, self._fingerprint, suffix)

    def _with_corpus(self, method: str, corpus: str, options: dict) -> dict:
        """``options`` with ``decoder.suffix.corpus`` (``method="suffix"``, or a chain with suffix decoding first;
        ``auto`` plans one, ``choose.with_corpus``)."""
        read = corpus_options(options, corpus)
        if method != "suffix" and not read["suffix"].get("first"):  # a suffix-first chain reads it too
            raise ConfigError(
                f"corpus= is suffix decoding's: pass method='suffix', or chain=True with "
                f"suffix={{'first': True}} (got method={method!r})."
            )
        return read

    def config(self, method: str, *, defaults: bool = True, **options: Any) -> DecodeConfig:
        """The ``DecodeConfig`` of ``method``: the options (HF aliases renamed) over the checkpoint's
        defaults for that method (``merged_options``; ``defaults=False``: none, as ``auto`` runs a candidate), EOS
        from the tokenizer; a misspelt option names the closest field."""
        get_decoder(method)  # an unknown method lists the choices before anything else
        given = _renamed(options)
        if method == "skipdecode" and self.trained_skip is not None:  # refused here, before any decoding
            given["skip"] = trained_options(
                self.trained_skip,
                to_dataclass(SkipOptions, given.get("skip"), "generate(): skip"),
                source=str(self.skip_file),
                override="load the model with from_pretrained(..., skip_file=None)",
                keys="skip.",
            )
        node = self.defaults.get(method, {}) if defaults else {}
        node = node | {"eos_token_id": sorted(eos_ids(self.model, self.tokenizer))}
        if "adapter" in node and "exit_layer" in given:  # an explicit E drafts at that exit, raw
            node = {k: v for k, v in node.items() if k not in ("adapter", "draft_vocab")}
        cfg = to_dataclass(DecodeConfig, merged_options(node, given), "generate()")
        if method == "self_speculative" and cfg.exit_layer is None and cfg.adapter is None:
            raise ConfigError(
                "self_speculative needs an exit layer and this model records none: pass exit_layer=E (or "
                f"assistant_early_exit=E), 1 <= E <= {self.m.num_layers - 1}, or use method='autoregressive'."
            )
        return cfg

    def _prompts(self, inputs: Any, chat: bool | None) -> tuple[list[list[int]], bool]:
        """(token-id prompts, one prompt given); inputs of another form are refused (``fastdecode.inputs``)."""
        return prompt_ids(inputs, lambda text: self._encode(text, chat))

    def _encode(self, text: str, chat: bool | None) -> list[int]:
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat and not has_template:
            raise ConfigError("chat=True but the tokenizer has no chat template; pass chat=False or None.")
        if has_template and chat is not False:
            messages = [{"role": "user", "content": text}]
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(rendered, add_special_tokens=False).input_ids
        return self.tokenizer(text).input_ids


def drafter_corpus(drafter: str | Path | None) -> Path | None:
    """The suffix corpus beside an EAGLE-3 head (``<drafter>/corpus.sfx``: ``recipe=eagle3`` writes it from the
    answers the head was trained on), None when the directory holds none."""
    path = Path(drafter) / DRAFTER_CORPUS if drafter is not None else None
    return path if path is not None and path.is_file() else None


def over_corpus(candidate: Candidate, corpus: str | None, drafter: str | None) -> Candidate:
    """``auto``'s ``candidate`` drafting by suffix decoding over ``corpus`` where it drafts by prompt lookup
    (``choose.with_corpus``); without one, over the corpus beside the EAGLE-3 head ``drafter`` if it has one."""
    found = corpus if corpus is not None else drafter_corpus(drafter)
    return with_corpus(candidate, str(found)) if found is not None else candidate


def _renamed(options: dict) -> dict:
    """``options`` with each HF alias renamed to its ``DecodeConfig`` field (``ALIASES``; the schedules of
    ``num_assistant_tokens_schedule`` too); an option given under both names is refused."""
    given: dict[str, Any] = {}
    typed: dict[str, str] = {}  # field -> the name the caller used
    for key, value in options.items():
        name = ALIASES.get(key, key)
        if name in given:
            raise ConfigError(f"generate(): {typed[name]} and {key} are the same option; pass one of them.")
        if key == "num_assistant_tokens_schedule" and isinstance(value, str):
            value = SCHEDULES.get(value, value)
        given[name], typed[name] = value, key
    return given


def _checkpoint_defaults(directory: Path | None, adapter: str | None, recommended: int | None) -> dict:
    """Per method, the ``DecodeConfig`` options a checkpoint directory records (E, adapter, draft
    vocabulary); an explicit ``adapter`` wins over the one inside the directory. (The SkipDecode policy is
    not a default but a constraint: ``FastDecoder.config``.)"""
    exit_layer = recommended_exit(directory)[0] if directory else None
    exit_layer = recommended if exit_layer is None else exit_layer
    spec: dict[str, Any] = {} if exit_layer is None else {"exit_layer": exit_layer}
    if directory is not None and (directory / DRAFT_VOCAB_FILE).is_file():
        spec["draft_vocab"] = str(directory / DRAFT_VOCAB_FILE)
    if adapter is None and directory is not None and (directory / CHECKPOINT_DIR / META_FILE).is_file():
        adapter = str(directory / CHECKPOINT_DIR)
    if adapter is not None:  # the adapter has its own E and draft vocabulary
        spec = {"adapter": adapter}
    return {"self_speculative": spec}
