"""``fastdecode-llamacpp`` / ``python eval/llamacpp.py``: llama.cpp beside fastdecode on the same GGUF.

    fastdecode-llamacpp [--model smollm2-135m] [--gguf PATH] [--data mt_bench] [--prompts 8] [--rounds 3]
                        [--max-new-tokens 96] [--threads 1,2] [--method auto --method auto:weights=int4] [--out DIR]

Needs the ``llamacpp`` extra (llama-cpp-python; pyproject.toml says how to build it). Prints the Markdown table,
writes ``llamacpp.json`` and ``llamacpp.md`` into ``--out`` (default ``outputs/llamacpp/<model>``). The work:
``fastdecode/bench/llamacpp.py`` (the driver), ``fastdecode/bench/llamacpp_worker.py`` (a process per side)."""

from __future__ import annotations

import argparse

from fastdecode.bench.llamacpp import LlamaCppJob
from fastdecode.config import ConfigError
from fastdecode_cli.launch import one_line_errors


def _ints(option: str, text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{option} {text!r}: give integers separated by commas (e.g. 1,2).")
    return values


def parse_args(argv: list[str] | None = None) -> LlamaCppJob:
    """The command line as a ``LlamaCppJob`` (checked by ``run``)."""
    defaults = LlamaCppJob()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=defaults.model, help="a configs/model name (fastdecode's side)")
    parser.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs; default: the model config's")
    parser.add_argument("--data", default=defaults.data, help="a configs/data name (the speed benchmark's)")
    parser.add_argument("--prompt-split", default=defaults.prompt_split, help="auto | all | held_out | ...")
    parser.add_argument("--prompts", default=str(defaults.n_prompts), help="how many prompts; all: every one")
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="timed passes over the prompts")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed answers per side first")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument(
        "--method",
        action="append",
        default=None,
        help="a fastdecode method, NAME[:KEY=VALUE,...] (generate options, passed through); repeat it. "
        "Default: autoregressive and auto",
    )
    parser.add_argument("--out", default=None, help="output directory (default outputs/llamacpp/<model>)")
    args = parser.parse_args(argv)
    return LlamaCppJob(
        model=args.model,
        gguf=args.gguf,
        data=args.data,
        prompt_split=args.prompt_split,
        n_prompts=None if args.prompts == "all" else _ints("--prompts", args.prompts)[-1],
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=_ints("--threads", args.threads),
        methods=args.method or defaults.methods,
        output_dir=args.out,
    )


def run(job: LlamaCppJob) -> dict:
    from fastdecode.bench.llamacpp import run as compare

    return compare(job)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    from fastdecode.bench.llamacpp import to_markdown

    print(to_markdown(run(parse_args(argv))))


if __name__ == "__main__":
    main()
