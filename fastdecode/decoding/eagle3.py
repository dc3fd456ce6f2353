"""EAGLE-3 speculative decoding (Li et al., 2025): a one-layer head trained on the target's features drafts,
the target verifies; lossless (greedy and sampling).

``decoder.drafter`` names the head's directory (``fastdecode/eagle3_files.py``: the speculators dialect, or
SGLang's). Its configuration is checked against the target before its weights load (hidden size, vocabulary,
feature layers); the head is loaded once per model and version of its files, on the target's device and
dtype. The proposer is ``eagle3_proposer.Eagle3Proposer``: verification hands it the target's hidden states at
the head's feature layers (``speculative.run_capturing``), with no extra pass. With ``decoder.chain=true``
rows draft by prompt lookup where their text matches, by the head elsewhere.

``offers`` tells ``auto`` (``fastdecode/choose.py``) about the head given with the model
(``PlanInputs.drafter``) when its directory records the head's acceptance (``<dir>/acceptance.json``,
``fastdecode/acceptance.py``, drafter ``eagle3``): first-draft acceptance and tokens per round per K.
"""

from __future__ import annotations

from pathlib import Path

from fastdecode.acceptance import read_record
from fastdecode.config import ConfigError
from fastdecode.cost import CostModel, block_parameters
from fastdecode.decoding.common import DecodeConfig
from fastdecode.decoding.drafters import Offer, PlanInputs, ProposerKind, Setup
from fastdecode.decoding.eagle3_proposer import Eagle3Proposer
from fastdecode.eagle3 import Eagle3Config, Eagle3Head
from fastdecode.eagle3_files import CONFIG_FILE, WEIGHTS_FILE, load_eagle3, read_eagle3_config
from fastdecode.file_cache import FileCache
from fastdecode.model import EarlyExitModel

NAME = "eagle3"
_LOADED = FileCache(maxsize=4)  # per model (owner), head files' version, device and dtype


def check_head(cfg: Eagle3Config, m: EarlyExitModel, path: str) -> None:
    """Refuse a head built for another target: its widths, vocabulary and feature layers must fit ``m``."""
    target = m.config
    where = f"decoder.drafter={path!r}"
    found = {
        "target hidden size": (cfg.target_hidden_size, target.hidden_size),
        "hidden size (the width of the target's embedding)": (cfg.hidden_size, target.hidden_size),
        "vocabulary size": (cfg.vocab_size, target.vocab_size),
    }
    for what, (head, model) in found.items():
        if head != model:
            raise ConfigError(
                f"{where} is an EAGLE-3 head for a target of {what} {head}, but this model has {model}: "
                "give a head trained for this model."
            )
    if max(cfg.aux_layer_ids) > m.num_layers:
        raise ConfigError(
            f"{where} reads the target's hidden states {cfg.aux_layer_ids}, but this model has "
            f"{m.num_layers} layers (ids 0..{m.num_layers}): give a head trained for this model."
        )


def check(m: EarlyExitModel, prompts: list[list[int]], cfg: DecodeConfig, draft=None) -> None:
    """A head directory is named and fits the model (read from its config, before any weights load)."""
    if cfg.drafter is None:
        raise ConfigError(
            "decoder 'eagle3' needs decoder.drafter: the directory of an EAGLE-3 head trained for this model "
            "(fastdecode.eagle3_files.save_eagle3, or a speculators / SpecForge checkpoint)."
        )
    check_head(read_eagle3_config(cfg.drafter), m, cfg.drafter)


def load_head(path: str, m: EarlyExitModel) -> Eagle3Head:
    """The head in ``path`` on ``m``'s device and dtype, in eval mode; loaded once per model and version of
    its files. After ``check_head``."""
    folder = Path(path)

    def load() -> Eagle3Head:
        head, cfg = load_eagle3(folder)
        check_head(cfg, m, path)
        return head.to(device=m.device, dtype=m.dtype).eval().requires_grad_(False)

    files = [folder / CONFIG_FILE, folder / WEIGHTS_FILE]
    return _LOADED.get(files, load, key=(str(m.device), str(m.dtype)), owner=m)


def head_token_cost(costs: CostModel, m: EarlyExitModel, head: Eagle3Head) -> float:
    """One head forward, in plain decoding steps: its layer and ``fc`` as blocks of the target by weights
    read, and its ``lm_head`` over the draft vocabulary as part of the target's head."""
    layer = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("lm_head"))
    return costs.draft_token(
        0, head_rows=head.config.draft_vocab_size, extra_blocks=layer / block_parameters(m)
    )


def build(s: Setup) -> Eagle3Proposer:
    """The proposer of the head ``s.cfg.drafter`` names."""
    head = load_head(s.cfg.drafter, s.m)
    cost = head_token_cost(s.costs, s.m, head)
    return Eagle3Proposer(s.m, head, s.cfg, s.generator, costs=s.costs, head_cost=cost)


def offers(p: PlanInputs) -> list[Offer]:
    """The head given with the model (``PlanInputs.drafter``) when its directory records its acceptance."""
    if p.drafter is None:
        return []
    record = read_record(p.drafter)
    found = record.find(NAME) if record is not None else []
    if not found:
        return []
    cfg = read_eagle3_config(p.drafter)
    check_head(cfg, p.m, p.drafter)
    token = head_token_cost(p.costs, p.m, load_head(p.drafter, p.m))
    options = {"drafter": str(p.drafter), "exit_layer": None, "adapter": None, "draft_vocab": None}
    d, costs = found[0], p.costs
    # the row of the verifier's token and the catch-up pass: one head forward per round besides the drafts
    per_round = lambda k: costs.round_cost(k, token, 0) + token  # noqa: E731
    return [Offer(NAME, options, d.acceptance, token, 0, None, d.tokens_per_round, per_round)]


KIND = ProposerKind(NAME, build, check=check, chainable=True, offers=offers)
generate = KIND.generate
