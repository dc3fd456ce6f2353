"""Speed benchmark: every decoder config composes; an end-to-end run on tiny-llama writes valid reports with the
same token counting for every method; bad input fails before any model loads."""

from __future__ import annotations

import csv
import json

import pytest
from hydra.errors import MissingConfigException

from fastdecode.bench.config import Method, MethodConfig, SpeedJob, plan
from fastdecode.bench.engines import FastdecodeRunner, HFRunner, LayerCounter, cut_at_eos
from fastdecode.bench.speed import tokenize_prompts
from fastdecode.bench.stats import Record, oracle_report, token_match
from fastdecode.config import ConfigError, ModelConfig, group_choices, load_group, to_dataclass
from fastdecode.data.config import DataConfig
from fastdecode.decoding import DECODERS, DecodeConfig, DecodeOutput, JacobiOptions, SkipOptions
from tests.helpers import lively_model, random_prompts, tiny_llama_adapter
from tests.job_configs import speed_cfg, tiny_speed_cfg


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
    )
    assert list(cfg.decoder) == [name]  # each file is keyed by its own name
    spec = to_dataclass(MethodConfig, cfg.decoder[name], f"decoder.{name}")
    if spec.engine == "fastdecode" and (spec.decoder or name) not in DECODERS:
        pytest.skip(f"decoder '{spec.decoder}' is not registered in DECODERS yet")
    job, methods, _ = plan(cfg)
    assert [m.name for m in methods] == [name]
    if spec.uses_exit_layer:
        assert methods[0].exit_layer == 2


def test_default_speed_config_needs_an_exit_layer_for_self_speculation():
    with pytest.raises(ConfigError, match=r"method 'self_speculative' needs an exit layer E.*exit_layer=E"):
        plan(speed_cfg())
    job, methods, source = plan(speed_cfg("exit_layer=8"))
    assert job.output_dir == "outputs/speed/smollm2-135m" and source == "exit_layer"
    assert [m.name for m in methods] == ["autoregressive", "self_speculative", "hf_generate", "hf_early_exit"]
    assert methods[3].options["assistant_early_exit"] == 8


def test_exit_layer_comes_from_the_checkpoint_generation_config(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"assistant_early_exit": 3}))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))  # plan() checks the files are there
    (tmp_path / "tokenizer.json").write_text("{}")
    job, methods, source = plan(speed_cfg("model=tiny-llama", f"checkpoint={tmp_path}"))
    assert source.startswith("checkpoint") and methods[1].options["exit_layer"] == 3


def test_end_to_end_on_tiny_llama(tmp_path):
    from eval.speed import run

    result = run(tiny_speed_cfg(tmp_path, "exit_layer=2"))
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
    with open(out / "summary.csv") as f:
        assert [row["method"] for row in csv.DictReader(f)] == names
    assert "| hf_early_exit |" in (out / "speed.md").read_text()
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
        (["decoder=[autoregressive,assisted]"], r"'assisted' needs a draft model: pass draft_model="),
        (["exit_layer=2", "+decoder.self_speculative.options.draft_tokns=3"], r"Did you mean 'draft_tokens'"),
        (["exit_layer=2", "+decoder.self_speculative.options.temperature=1"], r"for every method alike"),
        (["exit_layer=2", "+decoder.hf_generate.options.do_sample=true"], r"sets do_sample"),
        (["exit_layer=2", "+decoder.hf_early_exit.options.num_assistant_tokns=3"], r"num_assistant_tokens"),
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
            r"'decoder.skipdecode.options.skip_max_budget' was renamed: use "
            r"'decoder.skipdecode.options.skip.max_budget'",
        ),
        (
            ["decoder=[autoregressive,jacobi]", "decoder.jacobi.options.jacobi.block=1"],
            r"decoder.jacobi.block=1: a Jacobi block needs n >= 2",
        ),
    ],
)
def test_bad_input_fails_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    import fastdecode.loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(fastdecode.loading, "load_model", refuse)
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
    out = DecodeOutput(tokens=[[1, 2, 3]])
    out.record([2], 4, [2])
    out.record([4], 4, [4])
    out.record([0], 0, [0])  # the budget's last round drafts nothing: not an oracle sample
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


def test_prompts_go_through_the_chat_template(tmp_path):
    from fastdecode.tokenizer import byte_tokenizer

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
