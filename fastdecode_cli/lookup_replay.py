"""``fastdecode-lookup-replay`` / ``python eval/lookup_replay.py``: prompt lookup's variants replayed over the
model's own greedy answers to training prompts (which occurrence, the longest n, where EOS cuts; each under
the draft-length policies), with the acceptance prior ``fastdecode.plan.acceptance.MATCH_PRIOR`` holds.

``fastdecode-lookup-replay [model=smollm2-135m] [data=sharegpt] [num_prompts=128] [max_new_tokens=128]``

Answers are generated once and cached (``cache=``, resumable); the report (Markdown) is printed and written to
``output=`` when given. The work: ``fastdecode/bench/lookup_answers.py`` and ``lookup_replay.py``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, to_dataclass
from fastdecode.files.io import atomic_write_text
from fastdecode_cli.launch import check_command_line, one_line_errors

logger = logging.getLogger(__name__)


def run(cfg: Any) -> list[str]:
    """Replay every variant of the job; returns the report's Markdown lines."""
    from fastdecode.bench.lookup_answers import ReplayJob, prepare
    from fastdecode.bench.lookup_replay import Variant, measure, report
    from fastdecode.decoding.config import DecodeConfig

    job = to_dataclass(ReplayJob, cfg, "")
    job.check()  # before the model loads
    calls, costs, eos = prepare(job)
    base = DecodeConfig(
        max_new_tokens=job.max_new_tokens, draft_tokens=job.draft_tokens, eos_token_id=sorted(eos)
    )
    variants = [
        Variant(match, n, cut)
        for match, n, cut in itertools.product(job.matches, job.max_ngram_sizes, job.eos)
    ]
    found = measure(calls, base, costs, vocab_size=costs.vocab_size, variants=variants, policies=job.policies)
    verify = ", ".join(f"{costs.verify(t):.2f}" for t in range(1, job.draft_tokens + 2))
    lines = [
        f"Prompt lookup replay: {job.model.name}'s greedy answers to {len(calls)} prompts of {job.data.name} "
        f"(training split), <= {job.max_new_tokens} new tokens, K <= {job.draft_tokens}; cost model "
        f"{job.costs} (verifying T = 1..{job.draft_tokens + 1} tokens: {verify} plain steps).",
        "",
        *report(found, job.policies, job.draft_tokens),
    ]
    if job.output:
        atomic_write_text(Path(job.output), "\n".join(lines) + "\n")
    return lines


@hydra.main(config_path=str(CONFIG_DIR), config_name="lookup_replay", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    print("\n".join(run(cfg)))


@one_line_errors
def main() -> None:
    check_command_line(
        "lookup_replay"
    )  # misspelt keys get our did-you-mean; --help lists this config's groups
    _main()


if __name__ == "__main__":
    main()
