"""Regenerate a dataset's answers with the model itself (self-distillation data).

``python -m fastdecode_cli.regenerate [model=smollm2-135m] [data=sharegpt] [num_prompts=256]``

Prompts are the first user turns of the data config's training split; answers are decoded greedily and
written, resumably, as a ``{"prompt", "response", "response_ids"}`` jsonl that ``data=jsonl`` trains on and
``fastdecode-suffix-index`` indexes (the ids as generated). With ``server.url=...`` an OpenAI-compatible server
answers instead (text only). Why and how: docs/design/cli.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from fastdecode.config import CONFIG_DIR, ConfigError, ModelConfig, to_dataclass
from fastdecode.data.chat import training_prompts, user_prompt_text
from fastdecode.data.config import DataConfig, check_data_files, check_trainable
from fastdecode.data.openai_client import OpenAIClient, ServerConfig
from fastdecode.files.io import atomic_write_text, check_writable
from fastdecode_cli.launch import check_command_line, one_line_errors

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RegenerateJob:
    model: ModelConfig
    data: DataConfig
    num_prompts: int = 256
    max_new_tokens: int = 192
    max_prompt_tokens: int = 256  # longer prompts are skipped (they would dominate a CPU batch)
    batch_size: int = 8
    weights: str = (
        "auto"  # decoder.weights: auto = a GGUF's 4-bit blocks where exact (fastdecode/runtime/weights.py)
    )
    output: str = "data/${data.name}-${model.name}.jsonl"
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)  # url None: in-process


def _prompts(job: RegenerateJob, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """(first user turn, chat-templated prompt ids) of the training split, in split order."""
    return training_prompts(job.data, tokenizer, job.num_prompts, job.max_prompt_tokens)


def _done(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line.strip()]


def run(cfg: Any) -> dict:
    """Write ``job.output``; returns counts. Resumes after the lines already written."""
    from fastdecode.decoding.config import DecodeConfig
    from fastdecode.registry import get_decoder
    from fastdecode.runtime.loading import load_model
    from fastdecode.runtime.model import EarlyExitModel
    from fastdecode.tokens import eos_ids

    job = to_dataclass(RegenerateJob, cfg, "")
    if job.num_prompts < 1 or job.batch_size < 1:
        raise ConfigError("num_prompts and batch_size must be >= 1.")
    check_trainable(job.data)  # prompts come from the training split: benchmarks are refused before loading
    check_data_files(job.data)
    out = Path(job.output)
    check_writable(out.parent, option="output")  # before the model loads
    lines = _done(out)
    if job.server.url is not None:
        return _run_on_server(job, out, lines)
    model, tokenizer = load_model(job.model)
    prompts = _prompts(job, tokenizer)
    if len(lines) >= len(prompts):
        return {"written": len(lines), "new": 0, "output": str(out)}
    m = EarlyExitModel(model)
    decode = get_decoder("autoregressive")
    eos = sorted(eos_ids(model, tokenizer))
    dcfg = DecodeConfig(max_new_tokens=job.max_new_tokens, eos_token_id=eos, weights=job.weights)
    logger.info("regenerate: the model's products read %s", m.resolve_weights(job.weights).label)
    start = len(lines)
    for b in range(start, len(prompts), job.batch_size):
        batch = prompts[b : b + job.batch_size]
        result = decode(m, [ids for _, ids in batch], dcfg)
        for (user, _), tokens in zip(batch, result.tokens, strict=True):
            answer = tokenizer.decode(tokens, skip_special_tokens=True)
            lines.append(json.dumps({"prompt": user, "response": answer, "response_ids": list(tokens)}))
        atomic_write_text(out, "\n".join(lines) + "\n")  # whole file each time: never half-written
        logger.info("regenerate: %d / %d answers", len(lines), len(prompts))
    return {"written": len(lines), "new": len(lines) - start, "output": str(out)}


def _run_on_server(job: RegenerateJob, out: Path, lines: list[str]) -> dict:
    """``run`` with the answers of the server ``job.server.url``: checked first, then the prompts after the
    ``lines`` already written, the file rewritten whole every ``server.chunk`` answers and once more with
    the answers received before an error (the run then resumes after them)."""
    from fastdecode.files.assets import model_load_path
    from fastdecode.runtime.loading import load_tokenizer

    client = OpenAIClient(job.server)
    served = client.check()  # an unreachable URL or an unserved model fails here, before any prompt
    path = None if job.model.source == "random" else model_load_path(job.model)
    tokenizer = load_tokenizer(job.model, path)  # the prompts and their lengths are those of in-process runs
    prompts = _prompts(job, tokenizer)
    start = len(lines)
    todo = ((user, user_prompt_text(tokenizer, user)) for user, _ in prompts[start:])
    logger.info(
        "regenerate: %d prompts on %s (%s, %s)", len(prompts) - start, client.url, served, job.server.endpoint
    )
    written = start
    try:
        for answer, (user, _) in zip(client.answers(todo, job.max_new_tokens), prompts[start:], strict=False):
            lines.append(json.dumps({"prompt": user, "response": answer}))
            if (len(lines) - start) % job.server.chunk == 0:
                written = _rewrite(out, lines, len(prompts))
    finally:  # after the last answer, and before an error or an interrupt propagates: no answer is lost
        if len(lines) > written:
            _rewrite(out, lines, len(prompts))
    return {"written": len(lines), "new": len(lines) - start, "output": str(out)}


def _rewrite(out: Path, lines: list[str], total: int) -> int:
    atomic_write_text(out, "\n".join(lines) + "\n")  # whole file each time: never half-written
    logger.info("regenerate: %d / %d answers", len(lines), total)
    return len(lines)


@hydra.main(config_path=str(CONFIG_DIR), config_name="regenerate", version_base="1.3")
@one_line_errors
def _main(cfg: DictConfig) -> None:
    print(run(cfg))


@one_line_errors
def main() -> None:
    check_command_line("regenerate")  # misspelt keys get our did-you-mean; --help lists this config's groups
    _main()


if __name__ == "__main__":
    main()
