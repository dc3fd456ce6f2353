"""The speed benchmark's typed config (``configs/speed.yaml``) and its checks, done before any model loads.

A *method* is one entry of the ``decoder`` group (``configs/decoder/<name>.yaml``; several can be selected).
``engine: fastdecode`` runs a decoder of ``fastdecode.registry.DECODERS`` with ``DecodeConfig`` options;
``engine: hf`` runs Hugging Face ``generate`` with ``GenerationConfig`` options. ``draft_tokens: auto`` and
the ``auto`` method wait for the loaded model (``fastdecode/bench/auto.py``); the rest of them is checked
here. The ``uses_*`` switches and the other method keys: docs/design/bench.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.config import (
    ConfigError,
    ModelConfig,
    group_choices,
    load_group,
    to_dataclass,
    unknown_name_error,
)
from fastdecode.data.config import DataConfig
from fastdecode.data.splits import SPLITS
from fastdecode.files.checkpoint_info import checkpoint_model, recommended_exit
from fastdecode.plan.acceptance import read_record

ENGINES = ("fastdecode", "hf")
MODES = ("compare", "sweep")
GRID_KEYS_HF = ("assistant_early_exit", "num_assistant_tokens")
JOB_OWNED = ("max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "seed")
HF_OWNED = ("do_sample", "num_beams", "pad_token_id", "min_new_tokens", "max_length")
AUTO = "auto"  # draft_tokens: auto (K from the cost model), and decoder: auto (the plan's candidates)
AUTO_DRAFT_CAP = 8  # draft_tokens: auto without a usable recorded acceptance -> the adaptive policy, K <= 8


@dataclass
class MethodConfig:
    """One ``configs/decoder/<name>.yaml`` entry (docs/design/bench.md)."""

    engine: str = "fastdecode"
    decoder: str | None = None
    uses_exit_layer: bool = False
    uses_adapter: bool = False
    uses_drafter: bool = False  # the job's ``drafter`` of this decoder's kind as ``decoder.drafter``
    uses_corpus: bool = False  # a suffix method that reads the job's ``corpus`` as ``decoder.suffix.corpus``
    uses_draft: bool = False
    max_batch_size: int | None = None
    sampling: bool = True  # false: greedy only (e.g. jacobi); skipped at temperature > 0 with the reason
    options: dict = field(default_factory=dict)
    description: str = ""


@dataclass
class SweepConfig:
    """``mode=sweep``: ``method`` run at every exit layer x draft length (constant K is the natural grid)."""

    method: str = "self_speculative"
    exit_layers: list[int] = field(default_factory=lambda: [2, 4, 8])
    draft_tokens: list[int] = field(default_factory=lambda: [2, 4, 8])


@dataclass
class SpeedJob:
    """``configs/speed.yaml``; comments there explain each key."""

    model: ModelConfig
    data: DataConfig
    decoder: dict = field(default_factory=dict)
    mode: str = "compare"
    checkpoint: str | None = None
    draft_model: str | None = None
    exit_layer: int | None = None
    adapter: str | None = None
    # a trained drafter's directory, or a list of them: each uses_drafter method takes the one whose kind is its
    # decoder (``registry.drafter_kind``: an EAGLE-3 head for 'eagle3', a DFlash drafter for 'dflash')
    drafter: str | list[str] | None = None
    corpus: str | None = None  # a suffix index file for the 'suffix' methods (decoder.suffix.corpus)
    n_prompts: int | None = 8  # None: every prompt of the set
    prompt_split: str = "auto"
    max_prompt_tokens: int = 1024
    chat_template: str = "auto"
    max_new_tokens: int = 128
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_k: int | None = None
    top_p: float | None = None
    repeats: int = 3
    warmup: int = 1
    ttft: bool = True
    count_hf_layers: bool = True
    seed: int = 0
    baseline: str | None = "autoregressive"
    hf_baseline: str | None = "hf_generate"
    sweep: SweepConfig = field(default_factory=SweepConfig)
    progress: bool = True
    output_dir: str = "outputs/speed"


@dataclass
class Method:
    """A method ready to run: its name, spec, and the resolved options (exit layer and draft included)."""

    name: str
    spec: MethodConfig
    options: dict
    exit_layer: int | None = None
    grid: tuple[int, int] | None = None  # sweep: (exit layer, draft tokens)
    draft_source: str | None = None  # how ``draft_tokens: auto`` was resolved (after the model loads)
    candidate: dict | None = None  # an ``auto`` method's plan candidate (``plan.choose.Candidate``)

    @property
    def is_auto(self) -> bool:
        """The ``auto`` method, before it is expanded into the plan's candidates."""
        return self.spec.engine == "fastdecode" and self.spec.decoder == AUTO


def _positive(job: SpeedJob) -> None:
    for key in ("n_prompts", "max_new_tokens", "repeats", "max_prompt_tokens"):
        if getattr(job, key) is not None and getattr(job, key) < 1:
            raise ConfigError(f"{key}={getattr(job, key)}: must be >= 1.")
    if job.warmup < 0:
        raise ConfigError(f"warmup={job.warmup}: must be >= 0.")
    if not job.batch_sizes or min(job.batch_sizes) < 1:
        raise ConfigError(f"batch_sizes={job.batch_sizes}: give at least one size, each >= 1.")
    if not job.temperatures or min(job.temperatures) < 0:
        raise ConfigError(f"temperatures={job.temperatures}: give at least one, each >= 0 (0 = greedy).")
    if job.mode not in MODES:
        raise unknown_name_error("mode", job.mode, list(MODES))
    if job.prompt_split not in ("auto", *SPLITS):
        raise unknown_name_error("prompt_split", job.prompt_split, ["auto", *SPLITS])
    if job.chat_template not in ("auto", "always", "never"):
        raise unknown_name_error("chat_template", job.chat_template, ["auto", "always", "never"])


def resolve_exit_layer(job: SpeedJob) -> tuple[int | None, str]:
    """E and where it came from: ``exit_layer``, the checkpoint's ``fastdecode.json`` (or generation config),
    ``model.recommended_exit``."""
    if job.exit_layer is not None:
        return job.exit_layer, "exit_layer"
    from_checkpoint, source = recommended_exit(job.checkpoint)
    if from_checkpoint is not None:
        return from_checkpoint, source
    if job.model.recommended_exit is not None:
        return job.model.recommended_exit, "model.recommended_exit"
    return None, "unset"


def draft_model_config(job: SpeedJob) -> ModelConfig | None:
    """The draft model: a ``configs/model`` name or a local HF directory, on the target's device and dtype."""
    if not job.draft_model:
        return None
    placement = {"dtype": job.model.dtype, "device": job.model.device}
    if job.draft_model in group_choices("model"):
        return load_group("model", job.draft_model, ModelConfig, **placement)
    config = Path(job.draft_model) / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"draft_model={job.draft_model}: neither a configs/model name ({', '.join(group_choices('model'))}) "
            "nor a directory with a config.json."
        )
    family = json.loads(config.read_text()).get("model_type")  # None: read from the weights
    name = Path(job.draft_model).name
    return ModelConfig(name=name, family=family, source="hub", name_or_path=job.draft_model, **placement)


def target_model_config(job: SpeedJob) -> ModelConfig:
    """The model to benchmark: ``model``, or a trained output directory given as ``checkpoint``."""
    return checkpoint_model(job.model, job.checkpoint)  # files checked, a contradicting model= refused


def resolve_adapter_path(job: SpeedJob) -> str | None:
    """The exit adapter for ``uses_adapter`` methods: ``adapter``, else ``checkpoint/exit_adapter`` if there."""
    if job.adapter:
        return job.adapter
    if job.checkpoint:
        from fastdecode.drafters.exits.adapter import CHECKPOINT_DIR, META_FILE

        if (Path(job.checkpoint) / CHECKPOINT_DIR / META_FILE).is_file():
            return str(Path(job.checkpoint) / CHECKPOINT_DIR)
    return None


def job_drafters(job: SpeedJob) -> list[str]:
    """The job's ``drafter`` directories as a list (one path, several, or none)."""
    given = job.drafter
    return [] if given is None else [given] if isinstance(given, str) else list(given)


def _method(
    name: str,
    node: Any,
    exit_layer: int | None,
    draft: bool,
    adapter: str | None = None,
    *,
    drafter: list[str] | None = None,
) -> Method:
    spec = to_dataclass(MethodConfig, node, f"decoder.{name}")
    if spec.engine not in ENGINES:
        raise unknown_name_error("engine", spec.engine, list(ENGINES), f"(decoder.{name}.engine)")
    owned = sorted(set(spec.options) & set(JOB_OWNED + (HF_OWNED if spec.engine == "hf" else ())))
    if owned:
        raise ConfigError(
            f"decoder.{name}.options sets {', '.join(owned)}: the benchmark sets these for every method alike "
            "(top level: max_new_tokens=, temperatures=, top_k=, top_p=, seed=; EOS and padding from the "
            "tokenizer)."
        )
    options = dict(spec.options)
    exit_key = "exit_layer" if spec.engine == "fastdecode" else "assistant_early_exit"
    if spec.uses_exit_layer and options.get(exit_key) is None:
        if exit_layer is None:
            raise ConfigError(
                f"method '{name}' needs an exit layer E and none is set: pass exit_layer=E (1 <= E < layers), "
                "or a checkpoint that records one (the LayerSkip recipe writes exit_layer into its "
                "fastdecode.json; a checkpoint of another recipe has none)."
            )
        options[exit_key] = exit_layer
    if spec.uses_draft and not draft:
        raise ConfigError(
            f"method '{name}' needs a draft model: pass draft_model=NAME (a configs/model option) or a path."
        )
    used_exit = options.get(exit_key)
    _drafter_files(name, spec, options, adapter, drafter)
    if options.get("adapter") is not None:
        from fastdecode.drafters.exits.adapter import read_meta

        used_exit = used_exit or read_meta(options["adapter"])["exit_layer"]  # a missing adapter fails here
    check_options(name, spec, options)
    return Method(name, spec, options, used_exit)


def _drafter_files(
    name: str, spec: MethodConfig, options: dict, adapter: str | None, drafters: list[str] | None
) -> None:
    """Put the job's exit adapter and trained drafter into ``options`` for the methods that draft with them
    (unless the options fix one); a missing one, or a drafter directory that cannot be read, fails here."""
    if spec.uses_adapter and options.get("adapter") is None:
        if adapter is None:
            raise ConfigError(
                f"method '{name}' drafts through an exit adapter and none is set: pass adapter=PATH (a "
                "directory written by `python train.py recipe=exit_adapter`, e.g. outputs/<run>/final)."
            )
        options["adapter"] = adapter
    if spec.uses_drafter and options.get("drafter") is None:
        options["drafter"] = _drafter_of(name, spec.decoder or name, drafters or [])
    if options.get("drafter") is not None:
        from fastdecode.registry import check_drafter

        check_drafter(options["drafter"])


def _drafter_of(name: str, decoder: str, drafters: list[str]) -> str:
    """The one directory of ``drafters`` whose kind is ``decoder`` (``registry.drafter_kind``); none, or two,
    refused naming the method, before any model loads."""
    from fastdecode.registry import check_drafter, drafter_kind

    if not drafters:
        raise ConfigError(
            f"method '{name}' drafts with a trained {decoder} drafter and none is set: pass drafter=PATH (an "
            "EAGLE-3 head's directory from python train.py recipe=eagle3 or a speculators / SpecForge "
            "checkpoint; a DFlash drafter's from recipe=dflash), or drafter=[PATH,...] for several methods."
        )
    kinds: dict[str, list[str]] = {}
    for path in drafters:
        check_drafter(path)  # a missing or damaged directory fails here, by name
        kinds.setdefault(drafter_kind(path), []).append(str(path))
    found = kinds.get(decoder, [])
    if len(found) != 1:
        given = "; ".join(f"{kind}: {', '.join(paths)}" for kind, paths in kinds.items())
        raise ConfigError(
            f"method '{name}' (decoder '{decoder}') needs one {decoder} drafter directory among drafter= and "
            f"{len(found)} are given ({given}): give exactly one per kind (drafter=[EAGLE3_DIR,DFLASH_DIR])."
        )
    return found[0]


def check_options(name: str, spec: MethodConfig, options: dict) -> None:
    """Unknown decoders and option keys fail here, before any model loads (``draft_tokens: auto`` is checked
    as an int K; the ``auto`` method's options as the ``DecodeConfig`` fields every candidate shares)."""
    if spec.engine == "fastdecode":
        from fastdecode.decoding.config import DecodeConfig
        from fastdecode.registry import get_decoder

        if spec.decoder == AUTO:
            from fastdecode.plan.choose import PLAN_OWNED

            owned = sorted(set(options) & set(PLAN_OWNED))
            if owned:
                raise ConfigError(
                    f"decoder.{name}.options sets {', '.join(owned)}: the plan chooses these per candidate "
                    "(fastdecode.plan.choose.plan_decoding); select the method itself (e.g. decoder=[...,"
                    "self_speculative_chain]) to fix them."
                )
        else:
            get_decoder(spec.decoder or name)
        checked = options | ({"draft_tokens": AUTO_DRAFT_CAP} if options.get("draft_tokens") == AUTO else {})
        to_dataclass(DecodeConfig, {"max_new_tokens": 1} | checked, f"decoder.{name}.options")
        return
    from transformers import GenerationConfig

    known = GenerationConfig()
    for key in options:
        if not hasattr(known, key):
            raise unknown_name_error(
                "GenerationConfig field", key, list(vars(known)), f"(decoder.{name}.options)"
            )


def _sweep_methods(job: SpeedJob, methods: list[Method], draft: bool) -> list[Method]:
    """The baselines plus ``sweep.method`` at every (exit layer, draft tokens) of the grid."""
    if job.sweep.method not in job.decoder:
        raise ConfigError(
            f"sweep.method={job.sweep.method} is not among the selected decoders ({', '.join(job.decoder)}); "
            f"add it: decoder=[{job.baseline or 'autoregressive'},{job.sweep.method}]."
        )
    if not job.sweep.exit_layers or not job.sweep.draft_tokens:
        raise ConfigError("sweep.exit_layers and sweep.draft_tokens need at least one value each.")
    kept = [m for m in methods if m.name in (job.baseline, job.hf_baseline)]
    base = to_dataclass(MethodConfig, job.decoder[job.sweep.method], f"decoder.{job.sweep.method}")
    keys = ("exit_layer", "draft_tokens") if base.engine == "fastdecode" else GRID_KEYS_HF
    for exit_layer in job.sweep.exit_layers:
        for k in job.sweep.draft_tokens:
            node = dataclasses.replace(base, options=dict(base.options) | {keys[0]: exit_layer, keys[1]: k})
            method = _method(f"{job.sweep.method}_E{exit_layer}_K{k}", dataclasses.asdict(node), None, draft)
            method.grid = (exit_layer, k)
            kept.append(method)
    return kept


def check_exit_layers(methods: list[Method], num_layers: int, exit_layer: int | None = None) -> None:
    """Every method's exit layer E must leave layers to verify with: 1 <= E < num_layers (from the model's
    config.json, before its weights load). So must the job's ``exit_layer`` when no method drafts at it: a
    value that could never be right is a typo or a mix-up of models, not an option to ignore."""
    for method in methods:
        if method.exit_layer is not None and not 1 <= method.exit_layer < num_layers:
            raise ConfigError(
                f"method '{method.name}': exit layer {method.exit_layer} must be in [1, {num_layers - 1}] (the "
                f"model has {num_layers} layers)."
            )
    if exit_layer is not None and not 1 <= exit_layer < num_layers:
        raise ConfigError(
            f"exit_layer={exit_layer} must be in [1, {num_layers - 1}] (the model has {num_layers} layers), "
            "even where no selected method drafts at an exit: set it in that range, or leave it out."
        )


def plan(cfg: Any) -> tuple[SpeedJob, list[Method], str]:
    """Convert and check the whole job: ``(job, methods, where E came from)``; raises ConfigError early."""
    job = to_dataclass(SpeedJob, cfg, "")
    _positive(job)
    if not job.decoder:
        raise ConfigError("no methods selected: pass decoder=[autoregressive,...] (configs/decoder options).")
    # An incomplete or contradicted checkpoint is named before anything else is read; the job then carries
    # the checkpoint's own model config (label, family, tokenizer) into the report.
    job.model = target_model_config(job)
    exit_layer, source = resolve_exit_layer(job)
    draft = draft_model_config(job) is not None
    adapter = resolve_adapter_path(job)
    if job.mode == "sweep":
        selected = [n for n in job.decoder if n in (job.baseline, job.hf_baseline)]
        methods = [
            _method(n, job.decoder[n], exit_layer, draft, adapter, drafter=job_drafters(job))
            for n in selected
        ]
        methods = _sweep_methods(job, methods, draft)
    else:
        methods = [
            _method(name, node, exit_layer, draft, adapter, drafter=job_drafters(job))
            for name, node in job.decoder.items()
        ]
    names = [m.name for m in methods]
    for key in ("baseline", "hf_baseline"):
        value = getattr(job, key)
        if value is not None and value not in names:
            raise ConfigError(
                f"{key}={value} is not among the methods ({', '.join(names)}): add it to decoder=[...] or set "
                f"{key}=null (speedups and token matches against it are then not reported)."
            )
    check_auto_records(job, methods, adapter)
    return job, methods, source


def check_auto_records(job: SpeedJob, methods: list[Method], adapter: str | None) -> None:
    """What the ``auto`` method and ``draft_tokens: auto`` will read once the model loads, read now: the
    checkpoint's ``acceptance.json`` and the adapter's records (a damaged one fails before any load)."""
    auto_k = any(m.options.get("draft_tokens") == AUTO for m in methods)
    if not auto_k and not any(m.is_auto for m in methods):
        return
    read_record(job.checkpoint)  # RecordError (a ConfigError) names the file and the fix
    if adapter is not None and any(m.is_auto for m in methods):
        from fastdecode.drafters.exits.record import recorded_adapter

        recorded_adapter(adapter)  # AdapterError (a ConfigError) names what is missing
