"""``fastdecode-exits`` / ``python eval/exits.py``: per-exit quality report, e.g. ``fastdecode-exits checkpoint=outputs/layerskip-smollm2-135m/final``.

Writes ``exits.json`` (per exit: agreement with the final layer and perplexity on held-out data, agreement on
the model's own greedy generations, the recommended exit) and ``exits.png`` into ``output_dir``. With
``adapter=PATH`` (a ``recipe=exit_adapter`` run's ``final/`` or one adapter directory) the report adds, per
adapter exit, the agreement of the raw exit and of the exit through its adapter on the same generations (both
through the adapter's draft head), and the exit the head-aware cost model recommends with adapters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ModelConfig, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode_cli.launch import check_command_line, one_line_errors


@dataclasses.dataclass
class ExitsJob:
    model: ModelConfig
    data: DataConfig
    checkpoint: str | None = None
    compare_base: bool = True
    prompts: int = 16
    max_new_tokens: int = 64
    held_out_examples: int = 32
    max_draft: int = 8
    adapter: str | None = None
    output_dir: str = "outputs/exits"


def run(cfg: Any) -> dict:
    """Measure the model (and its base, with a checkpoint) and write the report; returns it."""
    from fastdecode.choose import choose_exit
    from fastdecode.cost import decoding_costs
    from fastdecode.data.chat import build_datasets
    from fastdecode.data.config import check_data_files
    from fastdecode.exit_report import exit_report, plot_reports
    from fastdecode.io import atomic_write_json, check_writable
    from fastdecode.loading import load_model
    from fastdecode.model import EarlyExitModel

    job = to_dataclass(ExitsJob, cfg, "")
    check_data_files(job.data)  # before any model loads
    check_writable(job.output_dir)
    targets = report_targets(job)  # a model that contradicts the checkpoint fails here, before any report
    adapters = adapter_dirs(job) if job.adapter else []  # a bad index or mixed vocabularies: here too
    reports, held_out = {}, None
    for label, model_cfg in targets.items():
        model, tokenizer = load_model(model_cfg)
        if held_out is None:
            held_out = build_datasets(dataclasses.replace(job.data, max_samples=1), tokenizer)[1]
        prompts = [ex["prompt"] for ex in held_out][: job.prompts]
        reports[label] = exit_report(
            model, tokenizer, held_out, prompts, job.max_new_tokens, max_examples=job.held_out_examples
        )
        agreement = reports[label]["generations"]["agreement"]
        costs = decoding_costs(EarlyExitModel(model))
        reports[label]["recommended"] = choose_exit(agreement, costs, max_draft=job.max_draft)
        reports[label]["costs"] = costs.to_json()
        if job.adapter and label != "base":
            reports[label]["adapters"] = adapter_report(model, tokenizer, job, prompts, adapters)
    out = Path(job.output_dir)
    atomic_write_json(out / "exits.json", reports)
    plot_reports(reports, str(out / "exits.png"))
    return reports


def report_targets(job: ExitsJob) -> dict[str, ModelConfig]:
    """What to measure: the model; with a checkpoint, its base (``model=`` when chosen, else the one its
    ``fastdecode.json`` records; skipped when neither) and the checkpoint, checked to agree before any load."""
    from fastdecode.checkpoint_info import CHECKPOINT_MODEL, base_model, check_agrees, checkpoint_model

    if not job.checkpoint:
        return {"model": job.model}
    after = checkpoint_model(job.model, job.checkpoint)
    base = base_model(job.checkpoint) if job.model.name == CHECKPOINT_MODEL else job.model
    if base is not None and job.compare_base:
        base = dataclasses.replace(base, dtype=job.model.dtype, device=job.model.device)
        from fastdecode.loading import model_config

        # another depth would mix two reports (an IndexError after the base's): its config.json decides
        check_agrees(base, job.checkpoint, model_config(base).num_hidden_layers)
        return {"base": base, "checkpoint": after}
    return {"checkpoint": after}


def adapter_dirs(job: ExitsJob) -> list[Path]:
    """The adapter directories ``adapter=`` names (a training run: every exit's), their records read and their
    draft vocabularies compared before any model loads (the report scores them all on one)."""
    from fastdecode.exit_adapter import INDEX_FILE, AdapterError, read_index, read_meta

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


def adapter_report(model, tokenizer, job: ExitsJob, prompts: list[str], dirs: list[Path]) -> dict:
    """Raw exit vs exit adapter (``dirs``) on the model's own greedy generations, and the head-aware choice."""
    from fastdecode.choose import adapter_draft_costs, choose_exit
    from fastdecode.cost import decoding_costs
    from fastdecode.exit_adapter import load_adapter
    from fastdecode.exit_report import adapter_generation_report, greedy_generations
    from fastdecode.model import EarlyExitModel

    m = EarlyExitModel(model)
    loaded = [load_adapter(d, m, tokenizer) for d in dirs]
    vocab = loaded[0][2]
    adapters = {a.exit_layer: a for a, _, _ in loaded}
    generations = greedy_generations(model, tokenizer, prompts, job.max_new_tokens)
    report = adapter_generation_report(m, adapters, generations, vocab)
    costs = decoding_costs(m)
    draft_costs = adapter_draft_costs(costs, m, adapters, vocab)
    report["recommended"] = choose_exit(
        report["adapter"], costs, draft_costs=draft_costs, max_draft=job.max_draft
    )
    report["draft_costs"] = draft_costs
    return report


@hydra.main(config_path=str(CONFIG_DIR), config_name="exits", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    reports = run(cfg)
    for label, report in reports.items():
        agreement = report["generations"]["agreement"]
        print(label, {k: round(v, 3) for k, v in agreement.items()}, report["recommended"])


@one_line_errors
def main() -> None:
    check_command_line("exits")  # misspelt keys get our did-you-mean; --help lists this config's groups
    _main()


if __name__ == "__main__":
    main()
