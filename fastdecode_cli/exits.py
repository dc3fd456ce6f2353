"""``fastdecode-exits`` / ``python eval/exits.py``: per-exit quality report, e.g. ``fastdecode-exits checkpoint=outputs/layerskip-smollm2-135m/final``.

Writes ``exits.json`` (per exit: agreement with the final layer, perplexity, the recommended exit) and
``exits.png`` into ``output_dir``. ``adapter=PATH`` adds the exit adapters of a ``recipe=exit_adapter`` run.
``record=true`` writes what was measured where ``auto`` reads it (``acceptance.json``, ``adapters.json``).
The report's contents are in docs/design/cli.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ModelConfig, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode.files.draft_vocab_file import DRAFT_VOCAB_FILE
from fastdecode_cli.launch import check_command_line, one_line_errors


@dataclasses.dataclass
class ExitsJob:
    model: ModelConfig
    data: DataConfig
    checkpoint: str | None = None
    compare_base: bool = True
    prompts: int = 16
    max_new_tokens: int = 64
    held_out_examples: int = 8
    max_draft: int = 8
    adapter: str | None = None
    record: bool = False
    output_dir: str = "outputs/exits"


def run(cfg: Any) -> dict:
    """Measure the model (and its base, with a checkpoint) and write the report; returns it."""
    from fastdecode.data.chat import build_datasets
    from fastdecode.data.config import check_data_files
    from fastdecode.files.io import atomic_write_json, check_writable
    from fastdecode.reports.exits import plot_reports
    from fastdecode.runtime.loading import load_model

    job = to_dataclass(ExitsJob, cfg, "")
    check_record(job)
    check_data_files(job.data)  # before any model loads
    check_writable(job.output_dir)
    targets = report_targets(job)  # a model that contradicts the checkpoint fails here, before any report
    if job.adapter:
        adapter_dirs(job)  # a bad index or mixed draft vocabularies fail here, before any model loads
    reports, held_out, measured = {}, None, {}
    for label, model_cfg in targets.items():
        model, tokenizer = load_model(model_cfg)
        if held_out is None:
            held_out = build_datasets(dataclasses.replace(job.data, max_samples=1), tokenizer)[1]
        reports[label] = model_report(label, model, tokenizer, held_out, job, measured=measured)
    out = Path(job.output_dir)
    atomic_write_json(out / "exits.json", reports)
    plot_reports(reports, str(out / "exits.png"))
    if job.record:
        write_records(job, reports, len(held_out[: job.prompts]))
    return reports


def check_record(job: ExitsJob) -> None:
    """``record=true`` writes into a checkpoint or an adapter run: it needs one, writable, before any work."""
    from fastdecode.config import ConfigError
    from fastdecode.files.io import check_writable

    if not job.record:
        return
    if not (job.checkpoint or job.adapter):
        raise ConfigError(
            "record=true writes acceptance.json into a checkpoint (checkpoint=PATH) or adapters.json beside "
            "exit adapters (adapter=PATH); give one of them, or drop record=true."
        )
    from fastdecode.drafters.exits.adapter import INDEX_FILE

    if job.adapter and not (Path(job.adapter) / INDEX_FILE).is_file():
        raise ConfigError(
            f"record=true with adapter={job.adapter}: the record is the {INDEX_FILE} of a recipe=exit_adapter "
            "run's final/ directory; pass that directory (it holds the E<exit>/ adapters)."
        )
    for path in (job.checkpoint, job.adapter):
        if path:
            check_writable(path)


def write_records(job: ExitsJob, reports: dict, prompts: int) -> None:
    """``record=true``: the checkpoint's ``acceptance.json`` and the adapters' ``adapters.json``."""
    from fastdecode.drafters.exits.record import write_adapter_record
    from fastdecode.plan.acceptance import exit_record, write_record

    label = "checkpoint" if job.checkpoint else "model"
    report = reports[label]
    if job.checkpoint:
        vocab = DRAFT_VOCAB_FILE if (Path(job.checkpoint) / DRAFT_VOCAB_FILE).is_file() else None
        measured_on = f"the model's own greedy answers to {prompts} held-out prompts ({job.data.name})"
        record = exit_record(report["generations"], draft_vocab=vocab, measured_on=measured_on)
        print(f"recorded: {write_record(job.checkpoint, record)}")
    if job.adapter:
        print(f"recorded: {write_adapter_record(job.adapter, report['adapters'])}")


def model_report(
    label: str, model: Any, tokenizer: Any, held_out: list[dict], job: ExitsJob, *, measured: dict
):
    """One model's report: its greedy generations, made once (the exit report and the adapter report score
    the same tokens), the exit report (and the adapters' agreement), then the exit choice on the cost model
    (``shared_costs``: measured once per run for models of one shape, ``measured``)."""
    from fastdecode.reports.exits import adapter_generation_report, exit_report, greedy_generations
    from fastdecode.runtime.model import EarlyExitModel
    from fastdecode.runtime.progress import phase

    prompts = [ex["prompt"] for ex in held_out][: job.prompts]
    what = f"{len(prompts)} greedy generations of up to {job.max_new_tokens} tokens"
    with phase(f"generations of the {label}", what, total=len(prompts), unit="prompt") as progress:
        generations = greedy_generations(model, tokenizer, prompts, job.max_new_tokens, progress)
    vocab = checkpoint_vocab(job, model) if label == "checkpoint" else None
    report = exit_report(
        model,
        tokenizer,
        held_out,
        prompts,
        job.max_new_tokens,
        max_examples=job.held_out_examples,
        generations=generations,
        name=f"exit report of the {label}",
        vocab=vocab,
    )
    m = EarlyExitModel(model)
    if job.adapter and label != "base":
        adapters, vocab = load_adapters(m, tokenizer, job)
        report["adapters"] = adapter_generation_report(m, adapters, generations, vocab)
    costs = shared_costs(m, measured)  # after the agreement: that ran on the HF modules, as the report's
    report |= recommend(report["generations"], costs, m, job.max_draft)
    if "adapters" in report:
        report["adapters"] |= adapter_choice(
            m, costs, adapters, vocab, report["adapters"], max_draft=job.max_draft
        )
    return report


def shared_costs(m: Any, measured: dict) -> Any:
    """The cost model of ``m`` on the engine decoding runs on (``decoding_costs``), measured once per run
    for every model of one shape (``measured``: architecture -> cost model). Timings depend on the shapes,
    the engine and the threads, not on the weights' values: a checkpoint and its base share one measurement.
    The engine is selected on ``m`` either way, so what is timed on it later (an adapter's draft) runs there."""
    from fastdecode.plan.cost import decoding_costs
    from fastdecode.runtime.engine import default_options

    key = (
        m.config.model_type,
        getattr(m.config, "hidden_act", None),
        str(m.device),
        tuple((name, tuple(p.shape), p.dtype) for name, p in m.hf.named_parameters()),
    )
    if key not in measured:
        measured[key] = decoding_costs(m)
    m.use_engine(default_options(m.device))
    return measured[key]


def checkpoint_vocab(job: ExitsJob, model: Any) -> Any:
    """The checkpoint's draft vocabulary ids (``draft_vocab.json``), scored too when ``record=true``."""
    if not (job.record and job.checkpoint and (Path(job.checkpoint) / DRAFT_VOCAB_FILE).is_file()):
        return None
    from fastdecode.files.draft_vocab_file import load_draft_vocab

    return load_draft_vocab(Path(job.checkpoint) / DRAFT_VOCAB_FILE)[0]


def recommend(generations: dict, costs: Any, m: Any, max_draft: int) -> dict:
    """The exit choice on the generations' agreement and replayed rounds, and the cost model it was made
    with, with the machine it was measured on."""
    from fastdecode.plan.choose import choose_exit
    from fastdecode.runtime.machine import machine_label

    agreement, rounds = generations["agreement"], generations.get("tokens_per_round")
    return {
        "recommended": choose_exit(agreement, costs, rounds=rounds, max_draft=max_draft),
        "costs": costs.to_json()
        | ({"measured_on": machine_label(m.device)} if costs.source == "measured" else {}),
    }


def report_targets(job: ExitsJob) -> dict[str, ModelConfig]:
    """What to measure: the model; with a checkpoint, its base (``model=`` when chosen, else the one its
    ``fastdecode.json`` records; skipped when neither) and the checkpoint, checked to agree before any load."""
    from fastdecode.files.checkpoint_info import CHECKPOINT_MODEL, base_model, check_agrees, checkpoint_model

    if not job.checkpoint:
        return {"model": job.model}
    after = checkpoint_model(job.model, job.checkpoint)
    base = base_model(job.checkpoint) if job.model.name == CHECKPOINT_MODEL else job.model
    if base is not None and job.compare_base:
        base = dataclasses.replace(base, dtype=job.model.dtype, device=job.model.device)
        from fastdecode.runtime.loading import model_config

        # another depth would mix two reports (an IndexError after the base's): its config.json decides
        check_agrees(base, job.checkpoint, model_config(base).num_hidden_layers)
        return {"base": base, "checkpoint": after}
    return {"checkpoint": after}


def adapter_dirs(job: ExitsJob) -> list[Path]:
    """The adapter directories ``adapter=`` names (a training run: every exit's), their records read and their
    draft vocabularies compared before any model loads (the report scores them all on one)."""
    from fastdecode.drafters.exits.adapter import INDEX_FILE, AdapterError, read_index, read_meta

    root = Path(job.adapter)
    dirs = (
        [root / n for n in read_index(root)["adapters"].values()] if (root / INDEX_FILE).is_file() else [root]
    )
    if len({(read_meta(d).get("draft_vocab") or {}).get("sha256") for d in dirs}) > 1:
        raise AdapterError(
            f"the adapters under {root} use different draft vocabularies, and the report scores them on one: "
            f"report them one by one (adapter={root}/E<exit>)."
        )
    return dirs


def load_adapters(m: Any, tokenizer: Any, job: ExitsJob) -> tuple[dict, Any]:
    """``(E -> ExitAdapter, draft vocabulary ids or None)`` of ``adapter=`` (``adapter_dirs``: a
    ``recipe=exit_adapter`` run's ``final/`` or one adapter directory; one draft vocabulary for all)."""
    from fastdecode.drafters.exits.adapter import load_adapter

    loaded = [load_adapter(d, m, tokenizer) for d in adapter_dirs(job)]
    return {a.exit_layer: a for a, _, _ in loaded}, loaded[0][2]


def adapter_choice(
    m: Any, costs: Any, adapters: dict, vocab: Any, agreement: dict, *, max_draft: int
) -> dict:
    """The head-aware exit choice with the adapters (``load_adapters``): each adapter's drafted token priced
    (timed on ``m``'s engine with a measured cost model), then ``choose_exit`` on the adapters' agreement
    (``adapter_generation_report``)."""
    from fastdecode.plan.choose import adapter_draft_costs, choose_exit

    draft_costs = adapter_draft_costs(costs, m, adapters, vocab)
    rounds = agreement["tokens_per_round"]["adapter"]
    recommended = choose_exit(
        agreement["adapter"], costs, draft_costs=draft_costs, rounds=rounds, max_draft=max_draft
    )
    return {"recommended": recommended, "draft_costs": draft_costs}


@hydra.main(config_path=str(CONFIG_DIR), config_name="exits", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    print("\n".join(summary_lines(run(cfg))))


def summary_lines(reports: dict) -> list[str]:
    """What a run printed: per model, the agreement per exit on its own generations and the exit choice as
    a sentence (with the machine its cost model was measured on); with adapters, raw -> adapter per exit."""
    from fastdecode.reports.exits import adapter_agreement_text, agreement_text, choice_sentence

    lines = []
    for label, report in reports.items():
        machine = report["costs"].get("measured_on")
        agreement = agreement_text(report["generations"]["agreement"])
        lines.append(f"{label}: agreement with the final layer on its own greedy generations: {agreement}")
        lines.append(f"{label}: {choice_sentence(report['recommended'], machine)}")
        if "adapters" in report:
            adapters = report["adapters"]
            lines.append(
                f"{label}: exit adapters, agreement raw exit -> adapter: {adapter_agreement_text(adapters)}"
            )
            lines.append(f"{label}: with the adapters, {choice_sentence(adapters['recommended'], machine)}")
    return lines


@one_line_errors
def main() -> None:
    check_command_line("exits")  # misspelt keys get our did-you-mean; --help lists this config's groups
    _main()


if __name__ == "__main__":
    main()
