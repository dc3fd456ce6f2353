"""Speed benchmark: every decoder config composes; an end-to-end run on tiny-llama writes valid reports with the
same token counting for every method; bad input fails before any model loads."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from fastdecode.bench.config import Method, MethodConfig, SpeedJob, plan
from fastdecode.bench.engines import FastdecodeRunner, HFRunner, LayerCounter, cut_at_eos
from fastdecode.bench.speed import tokenize_prompts
from fastdecode.bench.stats import Record, oracle_report, summarise, token_match
from fastdecode.config import ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode.decoding.config import DecodeConfig, DecodeOutput
from fastdecode.jacobi import JacobiOptions
from fastdecode.registry import DECODERS
from fastdecode.skipdecode import SkipOptions
from tests.dflash_drafters import random_drafter_dir
from tests.eagle3_heads import random_head_dir
from tests.helpers import lively_model, random_prompts, tiny_llama_adapter, tiny_model
from tests.job_configs import LIVELY, speed_cfg, tiny_speed_cfg


@pytest.mark.parametrize("name", group_choices("decoder"))
def test_every_decoder_option_composes_and_plans(name, tmp_path):
    cfg = speed_cfg(
        f"decoder=[{name}]",
        "model=tiny-llama",
        "exit_layer=2",
        "draft_model=tiny-llama",
        "baseline=null",
        "hf_baseline=null",
        f"adapter={tiny_llama_adapter(tmp_path, 2)}",
        f"drafter=[{random_head_dir(tmp_path)},{random_drafter_dir(tmp_path)}]",  # one of each kind
    )
    assert list(cfg.decoder) == [name]  # each file is keyed by its own name
    spec = to_dataclass(MethodConfig, cfg.decoder[name], f"decoder.{name}")
    # every fastdecode method names a registered decoder, or is `auto` (expanded after the model loads)
    assert spec.engine == "hf" or (spec.decoder or name) in DECODERS or spec.decoder == "auto"
    job, methods, _ = plan(cfg)
    assert [m.name for m in methods] == [name]
    assert methods[0].is_auto == (spec.decoder == "auto")
    if spec.uses_exit_layer:
        assert methods[0].exit_layer == 2


def test_each_drafter_method_takes_the_directory_of_its_kind(tmp_path):
    """``drafter=[E3DIR,DFDIR]``: the eagle3 methods take the EAGLE-3 head, the dflash ones the DFlash
    drafter; one path still serves its own kind; a method whose kind is missing, or given twice, is refused by
    name before any model loads."""
    heads, drafters = random_head_dir(tmp_path), random_drafter_dir(tmp_path)
    base = ("model=tiny-llama", "baseline=null", "hf_baseline=null")
    names = "eagle3,eagle3_chain,dflash,dflash_chain,dflash_suffix_chain"
    _, methods, _ = plan(speed_cfg(f"decoder=[{names}]", f"drafter=[{heads},{drafters}]", *base))
    assert {m.name: m.options["drafter"] for m in methods} == {
        n: heads if n.startswith("eagle3") else drafters for n in names.split(",")
    }
    _, methods, _ = plan(speed_cfg("decoder=[dflash]", f"drafter={drafters}", *base))
    assert methods[0].options["drafter"] == drafters
    with pytest.raises(ConfigError, match=r"method 'dflash' \(decoder 'dflash'\) needs one dflash drafter"):
        plan(speed_cfg("decoder=[eagle3,dflash]", f"drafter={heads}", *base))
    twice = str(tmp_path / "twice")
    random_drafter_dir(Path(twice))
    with pytest.raises(ConfigError, match="2 are given"):
        plan(speed_cfg("decoder=[dflash]", f"drafter=[{drafters},{twice}/dflash]", *base))


def test_eagle3_and_dflash_run_side_by_side_and_match_autoregressive(tmp_path):
    from eval.speed import run

    heads, drafters = random_head_dir(tmp_path), random_drafter_dir(tmp_path)
    methods = "eagle3,dflash,suffix_no_corpus,dflash_suffix_chain"
    cfg = tiny_speed_cfg(
        tmp_path, f"decoder=[autoregressive,{methods}]", f"drafter=[{heads},{drafters}]", "hf_baseline=null"
    )
    result = run(cfg)
    rows = {row["method"]: row for row in result["summary"]}
    for name in methods.split(","):  # lossless, each with the drafter of its kind
        assert rows[name]["match_rate"] == 1.0 and rows[name]["identical_rows"] == 1.0, name
    assert result["methods"]["dflash"]["options"]["drafter"] == drafters
    assert result["methods"]["eagle3"]["options"]["drafter"] == heads


def test_the_new_method_configs_are_among_the_options():
    names = set(group_choices("decoder"))
    assert {"prompt_lookup", "lookahead", "self_speculative_chain", "self_speculative_adapter_chain"} <= names
    assert "auto" in names


def test_default_speed_config_is_short_and_needs_no_exit_layer():
    job, methods, source = plan(speed_cfg())
    assert [m.name for m in methods] == ["autoregressive", "auto", "hf_generate"] and source == "unset"
    assert (job.n_prompts, job.max_new_tokens, job.repeats, job.warmup, job.ttft) == (8, 96, 1, 1, False)
    assert job.output_dir == "outputs/speed/smollm2-135m"
    assert plan(speed_cfg("n_prompts=null"))[0].n_prompts is None  # every prompt of the set
    selected = "decoder=[autoregressive,self_speculative,hf_generate,hf_early_exit]"
    with pytest.raises(ConfigError, match=r"method 'self_speculative' needs an exit layer E.*exit_layer=E"):
        plan(speed_cfg(selected))
    job, methods, source = plan(speed_cfg(selected, "exit_layer=8"))
    assert source == "exit_layer" and methods[3].options["assistant_early_exit"] == 8
    assert methods[1].options["draft_tokens"] == "auto"  # resolved once the model loads (bench/auto.py)


def test_exit_layer_comes_from_the_checkpoint_generation_config(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"assistant_early_exit": 3}))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))  # plan() checks the files are there
    (tmp_path / "tokenizer.json").write_text("{}")
    selected = ["decoder=[autoregressive,self_speculative]", "hf_baseline=null"]
    job, methods, source = plan(speed_cfg("model=tiny-llama", f"checkpoint={tmp_path}", *selected))
    assert source.startswith("checkpoint") and methods[1].options["exit_layer"] == 3


def test_end_to_end_on_tiny_llama(tmp_path):
    from eval.speed import run

    selected = "decoder=[autoregressive,self_speculative,hf_generate,hf_early_exit]"
    result = run(tiny_speed_cfg(tmp_path, "exit_layer=2", selected, "ttft=true"))
    out = tmp_path / "out"
    saved = json.loads((out / "speed.json").read_text())
    names = ["autoregressive", "self_speculative", "hf_generate", "hf_early_exit"]
    summary = {row["method"]: row for row in saved["summary"]}
    assert list(summary) == names and len(saved["prompts"]) == 3
    assert len(saved["records"]) == 2 * 3 * 4  # repeats x prompts (batch 1) x methods
    for name in ("self_speculative", "hf_generate"):  # lossless in fp32: the same tokens as our AR
        assert summary[name]["match_rate"] == 1.0 and summary[name]["identical_rows"] == 1.0
    assert summary["autoregressive"]["speedup_vs_baseline"] == 1.0
    assert summary["hf_generate"]["speedup_vs_hf"] == 1.0
    # The same counting everywhere: HF plain generate runs exactly our AR's layers per token.
    assert summary["hf_generate"]["layers_per_token"] == summary["autoregressive"]["layers_per_token"]
    assert summary["self_speculative"]["acceptance_rate"] is not None
    assert summary["self_speculative"]["decode_steps"] < summary["autoregressive"]["decode_steps"]
    for record in saved["records"]:
        assert 1 <= record["new_tokens"] <= 8 and record["ttft_s"] > 0 and record["wall_time_s"] > 0
    assert saved["meta"]["dtype"] == "float32" and saved["meta"]["hardware"]["cpu_cores"] >= 1
    assert "self_speculative" in saved["oracle"]
    assert saved["methods"]["self_speculative"]["draft_source"].startswith("adaptive")  # nothing recorded
    assert saved["plan"] is None and saved["categories"] is None and saved["category_summary"] == []
    with open(out / "summary.csv") as f:
        assert [row["method"] for row in csv.DictReader(f)] == names
    markdown = (out / "speed.md").read_text()
    assert "| hf_early_exit |" in markdown
    from fastdecode.runtime.machine import machine_label

    assert f"Measured on {machine_label()} (" in markdown  # the tok/s name the CPU and the threads
    assert saved["meta"]["hardware"]["machine"] == machine_label()
    for plot in ("speedup.png", "accept_hist.png", "oracle.png"):
        assert (out / plot).stat().st_size > 0
    assert result["summary"][0]["method"] == "autoregressive"


def test_sweep_grid_batches_and_skips(tmp_path):
    from eval.speed import run

    cfg = tiny_speed_cfg(
        tmp_path,
        "mode=sweep",
        "decoder=[autoregressive,self_speculative,hf_early_exit]",
        "hf_baseline=null",
        "sweep.exit_layers=[1,3]",
        "sweep.draft_tokens=[2]",
        "batch_sizes=[2]",
        "repeats=1",
        "ttft=false",
    )
    result = run(cfg)
    grid = [row for row in result["summary"] if row["grid"]]
    assert sorted(tuple(row["grid"]) for row in grid) == [(1, 2), (3, 2)]
    assert all(row["match_rate"] == 1.0 for row in grid)  # batched self-speculation is still exact
    assert result["skipped"] == []  # hf_early_exit is not a sweep method: not run at all
    assert (tmp_path / "out" / "sweep.png").is_file()

    skipped = run(
        tiny_speed_cfg(
            tmp_path,
            "exit_layer=2",
            "batch_sizes=[2]",
            "repeats=1",
            "ttft=true",
            "decoder=[autoregressive,hf_generate,hf_early_exit]",
        )
    )
    assert (
        skipped["skipped"][0]["method"] == "hf_early_exit" and "batch size" in skipped["skipped"][0]["reason"]
    )
    assert all(r["method"] != "hf_early_exit" for r in skipped["records"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["decoder.autoregressive.decoder=nope"], r"Unknown decoder 'nope'"),
        (["decoder=[autoregressive,self_speculative]"], r"'self_speculative' needs an exit layer"),
        (["+decoder.auto.options.exit_layer=2"], r"decoder.auto.options sets exit_layer: the plan chooses"),
        (["+decoder.auto.options.polcy=adaptive"], r"Did you mean 'policy'"),
        (["adapter=/nonexistent"], r"decoder.adapter='/nonexistent': no adapter.json there"),
        (["n_prompts=0"], r"n_prompts=0: must be >= 1"),
        (["decoder=[autoregressive,assisted]"], r"'assisted' needs a draft model: pass draft_model="),
        (["exit_layer=2", "+decoder.self_speculative.options.draft_tokns=3"], r"Did you mean 'draft_tokens'"),
        (["exit_layer=2", "+decoder.self_speculative.options.temperature=1"], r"for every method alike"),
        (["exit_layer=2", "+decoder.hf_generate.options.do_sample=true"], r"sets do_sample"),
        (
            [
                "exit_layer=2",
                "decoder=[autoregressive,hf_early_exit]",
                "hf_baseline=null",
                "+decoder.hf_early_exit.options.num_assistant_tokns=3",
            ],
            r"num_assistant_tokens",
        ),
        (["exit_layer=2", "decoder=[self_speculative]"], r"baseline=autoregressive is not among the methods"),
        (["exit_layer=2", "data.path=/nonexistent.jsonl"], r"not a file"),
        (["exit_layer=2", "checkpoint=/nonexistent"], r"not a model directory"),
        (["exit_layer=2", "draft_model=nope"], r"neither a configs/model name"),
        (["exit_layer=2", "batch_sizes=[0]"], r"batch_sizes"),
        (
            ["decoder=[autoregressive,jacobi]", "+decoder.jacobi.options.jacobi.blok=8"],
            r"Unknown key 'decoder.jacobi.options.jacobi.blok'. Did you mean 'block'\?",
        ),
        (
            ["decoder=[autoregressive,skipdecode]", "+decoder.skipdecode.options.skip_max_budget=3"],
            r"Unknown key 'decoder.skipdecode.options.skip_max_budget'\. Valid keys of "
            r"decoder.skipdecode.options: .*\bskip\b",
        ),
        (
            ["decoder=[autoregressive,jacobi]", "decoder.jacobi.options.jacobi.block=1"],
            r"decoder.jacobi.block=1: a Jacobi block needs n >= 2",
        ),
    ],
)
def test_bad_input_fails_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    import fastdecode.runtime.loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(fastdecode.runtime.loading, "load_model", refuse)
    from eval.speed import run

    with pytest.raises(ConfigError, match=message):
        run(tiny_speed_cfg(tmp_path, *overrides))


def test_nested_decoder_options_follow_hydra_overrides():
    cfg = speed_cfg(
        "decoder=[autoregressive,jacobi,skipdecode]",
        "model=tiny-llama",
        "hf_baseline=null",
        "decoder.jacobi.options.jacobi.block=8",
        "decoder.skipdecode.options.skip.max_budget=3",
        "decoder.skipdecode.options.skip.min_budget=2",
    )
    _, methods, _ = plan(cfg)
    decode = {m.name: to_dataclass(DecodeConfig, {"max_new_tokens": 4} | m.options, m.name) for m in methods}
    assert decode["jacobi"].jacobi == JacobiOptions(block=8, init="repeat")
    assert decode["skipdecode"].skip == SkipOptions(max_budget=3, min_budget=2, warmup_layers=4)
    assert (
        decode["autoregressive"].jacobi == JacobiOptions() and decode["autoregressive"].skip == SkipOptions()
    )


def test_unknown_method_names_the_missing_config():
    with pytest.raises(MissingConfigException, match=r"Could not load 'decoder/nope'"):
        speed_cfg("decoder=[autoregressive,nope]")


def test_hf_and_our_outputs_are_counted_alike_at_eos():
    """Rows cut after their first EOS (HF pads finished rows; we stop them), identical tokens per row."""
    m = lively_model("tiny-llama")
    prompts = random_prompts(3, seed=1)
    data = DataConfig(name="x", source="jsonl")
    job = SpeedJob(model=load_group("model", "tiny-llama", ModelConfig), data=data, max_new_tokens=12)
    free = FastdecodeRunner(Method("ar", MethodConfig(decoder="autoregressive"), {}), m, None, job, set())
    free_rows = free(prompts, 12, 0.0, 0).tokens
    eos = {free_rows[0][3]}  # a token row 0 emits at position 3 (other rows stop wherever they emit it)
    ours = FastdecodeRunner(Method("ar", MethodConfig(decoder="autoregressive"), {}), m, None, job, eos)
    hf = HFRunner(Method("hf", MethodConfig(engine="hf"), {}), m.hf, None, job, eos, pad_id=0)
    ours_rows, hf_rows = ours(prompts, 12, 0.0, 0).tokens, hf(prompts, 12, 0.0, 0).tokens
    assert ours_rows == hf_rows == [cut_at_eos(row, eos) for row in free_rows]
    assert len(ours_rows[0]) == 4 and all(row.count(next(iter(eos))) <= 1 for row in ours_rows)


def test_token_match_and_oracle_statistics():
    assert token_match([1, 2, 3], [1, 2, 3]) == (3, 3, None)
    assert token_match([1, 2, 3], [1, 5, 3]) == (2, 3, 1)
    assert token_match([1, 2, 3], [1, 2]) == (2, 3, 2)  # stopping early is a divergence
    out = DecodeOutput(tokens=[[1, 2, 3], [4, 5]])
    out.record([2, 0], [4, 0], [2, 0])  # ragged: row 1 drafted nothing (no n-gram match)
    out.record([4], [4], [4])
    out.record([0], [0], [0])  # the budget's last round drafts nothing: not an oracle sample
    record = Record(
        method="s",
        repeat=0,
        temperature=0.0,
        batch_size=1,
        batch=0,
        prompt_ids=["p"],
        out=out,
        wall_time_s=1.0,
        ttft_s=None,
        peak_memory_mb=None,
        counters=True,
    )
    report = oracle_report([record])["s"]
    assert report["verifications"] == 2 and report["histogram"] == {2: 1, 4: 1}
    assert report["draft_cap"] == 4 and report["capped_fraction"] == 0.5 and report["mean"] == 3.0
    (row,) = summarise([record], None, None)
    assert row["acceptance_rate"] == 6 / 8  # over the drafted lengths per row: 4 + 0 + 4 + 0
    assert row["mean_accepted_length"] == (3 + 1 + 5 + 1) / 4  # tokens per row verification
    assert row["position_acceptance"] == [1.0, 1.0, 0.5, 0.5]  # only rows that drafted position i count


def test_prompts_go_through_the_chat_template(tmp_path):
    from fastdecode.runtime.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    cfg = tiny_speed_cfg(tmp_path, "exit_layer=2", "n_prompts=2")
    job, _, _ = plan(cfg)
    records = [
        {
            "id": "a",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
            ],
        }
    ]
    ((pid, ids),) = tokenize_prompts(job, records, tok, context=512)
    assert (
        tok.decode(ids)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    job.chat_template = "never"
    assert tok.decode(tokenize_prompts(job, records, tok, context=512)[0][1]) == "S\n\nhi"
    job.max_prompt_tokens = 2
    with pytest.raises(ConfigError, match="no prompt fits"):
        tokenize_prompts(job, records, tok, context=512)


def test_hf_runner_uses_a_clean_generation_config():
    """A checkpoint's generation_config (here: assistant_early_exit) must not leak into plain HF generate."""
    m = lively_model("tiny-llama")
    job = SpeedJob(
        model=load_group("model", "tiny-llama", ModelConfig), data=DataConfig(name="x", source="jsonl")
    )
    hf = HFRunner(Method("hf", MethodConfig(engine="hf"), {}), m.hf, None, job, set(), pad_id=0)
    saved = m.hf.generation_config
    before = (saved.assistant_early_exit, saved.repetition_penalty)
    saved.assistant_early_exit, saved.repetition_penalty = 1, 5.0
    try:
        plain = hf(random_prompts(1, seed=2), 10, 0.0, 0).tokens
    finally:
        saved.assistant_early_exit, saved.repetition_penalty = before
    assert m.hf.generation_config is saved  # swapped back after the call
    free = FastdecodeRunner(Method("ar", MethodConfig(decoder="autoregressive"), {}), m, None, job, set())
    assert plain == free(random_prompts(1, seed=2), 10, 0.0, 0).tokens and len(plain[0]) == 10


def test_hf_early_exit_drafter_prefills_the_prompt_once():
    """A model config holding assistant_early_exit (as exported checkpoints do) must not make HF's drafter nest
    another assisted generation, which re-prefills the whole prompt every round."""
    model = lively_model("tiny-llama").hf
    job = SpeedJob(
        model=load_group("model", "tiny-llama", ModelConfig), data=DataConfig(name="x", source="jsonl")
    )
    options = {"assistant_early_exit": 2, "num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0}
    hf = HFRunner(Method("ee", MethodConfig(engine="hf"), options), model, None, job, set(), pad_id=0)
    prompt = list(range(5, 205))
    counts = []
    for budget in (16, 1):
        with LayerCounter(hf.layers()) as counter:
            hf([prompt], budget, 0.0, 0)
        counts.append(counter.tokens)
    drafting = counts[0] - counts[1]  # the drafter's one prefill (2 layers x 200) plus the decoding work
    assert 2 * len(prompt) <= drafting < 2 * 2 * len(prompt)


# --------------------------------------------------------------------------------------------------------
# The n-gram and chain methods, the auto method, MT-bench categories, the default run's size
@pytest.mark.parametrize(
    "methods,extra",
    [
        ("prompt_lookup,lookahead,self_speculative_chain", [LIVELY]),
        ("self_speculative_adapter_chain", []),  # the adapter fits the shared tiny-llama weights
    ],
)
def test_new_methods_run_and_match_autoregressive(tmp_path, methods, extra):
    from eval.speed import run

    if not extra:
        extra = [f"adapter={tiny_llama_adapter(tmp_path, 2)}"]
    cfg = tiny_speed_cfg(
        tmp_path,
        f"decoder=[autoregressive,{methods}]",
        "exit_layer=2",
        "hf_baseline=null",
        "repeats=1",
        *extra,
    )
    result = run(cfg)
    rows = {row["method"]: row for row in result["summary"]}
    assert list(rows) == ["autoregressive", *methods.split(",")]
    for name in methods.split(","):  # lossless: greedy output equals autoregressive's, row for row
        assert rows[name]["match_rate"] == 1.0 and rows[name]["identical_rows"] == 1.0, name
        assert rows[name]["decode_steps"] is not None
    if "self_speculative_chain" in rows:
        assert result["methods"]["self_speculative_chain"]["options"]["chain"] is True
        assert rows["self_speculative_chain"]["exit_layer"] == 2


def test_auto_without_records_is_prompt_lookup_and_the_run_says_its_size(tmp_path, capsys):
    from eval.speed import run

    result = run(tiny_speed_cfg(tmp_path, "repeats=1"))  # the default methods: autoregressive, auto, HF
    assert "4 methods x 3 prompts x 1 repeats = 12 timed calls (+ 6 warm-up calls)" in capsys.readouterr().out
    assert [c["name"] for c in result["plan"]["candidates"]] == ["prompt_lookup"]
    assert result["plan"]["not_paying"] == []  # no checkpoint: no exit to consider
    rows = {row["method"]: row for row in result["summary"]}
    assert list(rows) == ["autoregressive", "auto", "auto:prompt_lookup", "hf_generate"]
    assert rows["auto:prompt_lookup"]["auto_best"] is True and rows["autoregressive"]["auto_best"] is None
    assert rows["auto:prompt_lookup"]["match_rate"] == 1.0 and rows["auto"]["match_rate"] == 1.0
    assert rows["auto"]["ran"] == ["prompt_lookup"] and rows["auto"]["vs_best_candidate"] > 0
    assert result["methods"]["auto:prompt_lookup"]["decoder"] == "prompt_lookup"
    assert result["meta"]["costs"]["source"] == "measured" and result["meta"]["costs"]["num_layers"] == 4
    md = (tmp_path / "out" / "speed.md").read_text()
    assert "| auto:prompt_lookup (auto best) |" in md
    assert "auto planned prompt_lookup (expected " in md and "not expected to pay: none" in md
    assert "batch 1 auto ran prompt_lookup: " in md


def _checkpoint_with_report(tmp_path, agreement: dict[int, float]):
    """tiny-llama whose layers >= 1 write nothing (exit 1 is the output) exported as ``run/final``, with the
    acceptance.json a LayerSkip run writes into it."""
    model, tokenizer = lively_model("tiny-llama", zero_from=1).hf, tiny_model("tiny-llama")[1]
    final = tmp_path / "run" / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    drafters = [{"drafter": "exit", "exit_layer": k, "acceptance": v} for k, v in agreement.items()]
    (final / "acceptance.json").write_text(json.dumps({"format": 1, "drafters": drafters}))
    return final


def test_auto_with_a_recorded_acceptance_runs_the_chain_first(tmp_path, monkeypatch):
    import fastdecode.bench.auto
    from eval.speed import run
    from fastdecode.plan.cost import estimate_costs

    # The weights' cost model instead of timings, so the choice does not depend on how busy the machine is.
    monkeypatch.setattr(fastdecode.bench.auto, "decoding_costs", estimate_costs)
    final = _checkpoint_with_report(tmp_path, {1: 1.0, 3: 0.2})
    estimated = "+decoder.auto.options.costs=estimated"  # the plan's cost model (auto's own option)
    cfg = tiny_speed_cfg(
        tmp_path, f"checkpoint={final}", "decoder=[autoregressive,auto]", "hf_baseline=null", estimated
    )
    result = run(cfg)
    names = [c["name"] for c in result["plan"]["candidates"]]
    assert names == ["prompt_lookup+exit", "prompt_lookup"]
    chain = result["methods"]["auto:prompt_lookup+exit"]
    assert chain["decoder"] == "self_speculative" and chain["candidate"]["expected_speedup"] > 1.05
    assert chain["options"]["chain"] is True and chain["options"]["exit_layer"] == 1
    rows = {row["method"]: row for row in result["summary"]}
    assert list(rows) == ["autoregressive", "auto", "auto:prompt_lookup+exit", "auto:prompt_lookup"]
    assert sum(bool(row["auto_best"]) for row in rows.values()) == 1
    assert rows["auto"]["ran"] == ["prompt_lookup+exit"] and rows["auto"]["match_rate"] == 1.0
    for name in names:
        assert rows[f"auto:{name}"]["match_rate"] == 1.0
    assert rows["auto:prompt_lookup+exit"]["by_proposer"]  # the chain's acceptance per drafter
    assert result["meta"]["costs"]["source"] == "estimated"
    assert "auto planned prompt_lookup+exit (expected" in (tmp_path / "out" / "speed.md").read_text()


MT_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def _mt_bench_file(path, per_category: int = 2):
    """An MT-bench ``question.jsonl``: questions grouped by category, as the real file is."""
    with open(path, "w") as f:
        qid = 81
        for category in MT_CATEGORIES:
            for i in range(per_category):
                turns = [f"{category} question {i}: repeat {category} {category}.", "And again?"]
                f.write(json.dumps({"question_id": qid, "category": category, "turns": turns}) + "\n")
                qid += 1
    return path


def test_mt_bench_prompts_are_taken_round_robin_across_categories(tmp_path):
    from fastdecode.bench.speed import read_prompt_records
    from fastdecode.runtime.tokenizer import byte_tokenizer

    data = _mt_bench_file(tmp_path / "question.jsonl")
    base = ["model=tiny-llama", "data=mt_bench", f"data.path={data}", "decoder=[autoregressive]"]
    job, _, _ = plan(speed_cfg(*base, "hf_baseline=null"))  # the default n_prompts=8: one per category
    records = read_prompt_records(job)
    prompts = tokenize_prompts(job, records, byte_tokenizer(), context=2048)
    by_id = {r["id"]: r["category"] for r in records}
    assert [by_id[pid] for pid, _ in prompts] == MT_CATEGORIES
    job, _, _ = plan(speed_cfg(*base, "hf_baseline=null", "n_prompts=null"))
    records = read_prompt_records(job)
    prompts = tokenize_prompts(job, records, byte_tokenizer(), context=2048)
    assert [pid for pid, _ in prompts] == [f"mt_bench/{q}" for q in range(81, 97)]  # all, in file order


def test_per_category_rows_and_table(tmp_path):
    from eval.speed import run

    data = _mt_bench_file(tmp_path / "question.jsonl", per_category=1)
    cfg = tiny_speed_cfg(
        tmp_path,
        "data=mt_bench",
        f"data.path={data}",
        "n_prompts=3",
        "decoder=[autoregressive,prompt_lookup]",
        "hf_baseline=null",
        "repeats=1",
        "warmup=0",
    )
    result = run(cfg)
    assert result["categories"] == {f"mt_bench/{81 + i}": MT_CATEGORIES[i] for i in range(3)}
    assert [r["categories"] for r in result["records"][:2]] == [["writing"], ["writing"]]
    rows = result["category_summary"]
    assert {(r["method"], r["category"]) for r in rows} == {
        (method, category) for method in ("autoregressive", "prompt_lookup") for category in MT_CATEGORIES[:3]
    }
    for row in rows:
        assert row["calls"] == 1 and row["tokens_per_s"] > 0
        if row["method"] == "autoregressive":
            assert row["speedup_vs_baseline"] == 1.0 and row["acceptance_rate"] is None
        else:
            assert row["speedup_vs_baseline"] > 0 and row["match_rate"] == 1.0
    assert len(result["summary"]) == 2  # the overall rows are unchanged
    md = (tmp_path / "out" / "speed.md").read_text()
    assert "Speedup vs baseline per category (T=0.0, batch 1):" in md
    assert (
        "| method | writing | roleplay | reasoning |" in md
        and "| autoregressive | 1.00x | 1.00x | 1.00x |" in md
    )
    with open(tmp_path / "out" / "category_summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 6


# --------------------------------------------------------------------------------------------------------
# Prompts without twins (fastdecode.data.twins)
def test_prompts_with_a_twin_among_a_corpus_prompts_are_dropped_and_counted(tmp_path):
    """A prompt whose twin a corpus answers (``corpus=``, or the one beside ``drafter=``: the head's training
    prompts) is not benchmarked; the report says how many were dropped, per corpus."""
    from fastdecode.bench.speed import prompt_records
    from fastdecode.registry import corpus_fingerprint
    from fastdecode.training.answers import save_corpus

    fingerprint = corpus_fingerprint(tiny_model("tiny-llama")[1])
    corpus = tmp_path / "answers.sfx"
    save_corpus(corpus, [[40, 41, 42]], ["COUNT from 1 to 6", "unrelated"], fingerprint=fingerprint)
    head = Path(random_head_dir(tmp_path))
    save_corpus(head / "corpus.sfx", [[43]], ["count from 2 to 7!"], fingerprint=fingerprint)
    methods = ("decoder=[autoregressive,suffix]", "hf_baseline=null")
    job, _, _ = plan(tiny_speed_cfg(tmp_path, *methods, f"corpus={corpus}", f"drafter={head}"))
    records, twins = prompt_records(job)
    assert [r["messages"][0]["content"] for r in records] == ["Count from 0 to 5."]
    assert twins == {"training_split": 0, "corpora": {str(corpus): 1, str(head / "corpus.sfx"): 1}}
    job, _, _ = plan(tiny_speed_cfg(tmp_path, *methods, f"corpus={corpus}"))
    assert len(prompt_records(job)[0]) == 2 and prompt_records(job)[1]["corpora"] == {str(corpus): 1}
    save_corpus(corpus, [[40]], [f"count from {i} to {i + 5}" for i in range(3)], fingerprint=fingerprint)
    with pytest.raises(ConfigError, match="every prompt of data 'jsonl' .* has a twin"):
        prompt_records(job)


def test_the_report_counts_the_prompts_dropped_for_a_twin(tmp_path):
    from eval.speed import run
    from fastdecode.registry import corpus_fingerprint
    from fastdecode.training.answers import save_corpus

    corpus = tmp_path / "answers.sfx"
    fingerprint = corpus_fingerprint(tiny_model("tiny-llama")[1])
    save_corpus(corpus, [[40, 41, 42]], ["Count from 1 to 6"], fingerprint=fingerprint)
    cfg = tiny_speed_cfg(tmp_path, "decoder=[autoregressive,suffix]", "hf_baseline=null", f"corpus={corpus}")
    result = run(cfg)
    assert result["twins"] == {"training_split": 0, "corpora": {str(corpus): 1}}
    assert len(result["prompts"]) == 2
    saved = json.loads((tmp_path / "out" / "speed.json").read_text())
    assert saved["twins"] == result["twins"]
