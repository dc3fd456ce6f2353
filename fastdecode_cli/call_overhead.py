"""``fastdecode-call-overhead`` / ``python eval/call_overhead.py``: what ``FastDecoder.generate`` costs beyond
its decoder.

    fastdecode-call-overhead [--model smollm2-135m] [--tokens 1,48] [--method autoregressive] [--repeats 20]
                             [--threads 1] [--out overhead.json]

(a) the public call and (b) the decoder called directly, interleaved; a profile of the work outside the
decoder. Prints the report (and writes it as JSON to ``--out``). The code is ``fastdecode/bench/call_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastdecode_cli.launch import one_line_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="a configs/model name, a directory or a hub id"
    )
    parser.add_argument("--tokens", default="1,48", help="max_new_tokens values, comma-separated")
    parser.add_argument("--method", default="autoregressive", help="a decoder name")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds per token count")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile-calls", type=int, default=200, help="calls profiled at one new token")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from fastdecode.bench.call_overhead import run as measure
    from fastdecode.config import ConfigError

    try:
        tokens = [int(n) for n in args.tokens.split(",")]
    except ValueError:
        raise ConfigError(f"--tokens {args.tokens!r}: give integers separated by commas (1,48).") from None
    return measure(
        args.model,
        tokens=tokens,
        method=args.method,
        repeats=args.repeats,
        threads=args.threads,
        profile_calls=args.profile_calls,
    )


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    from fastdecode.bench.call_overhead import report

    args = parse_args(argv)
    result = run(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
