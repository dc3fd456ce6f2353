"""Serve a target with vLLM's offline API, with or without a drafter, and write what it decoded.

Runs under the Python of a separate virtual environment with vLLM's CPU build (``make_vllm_venv.sh``); it
imports nothing from fastdecode. The slow test ``tests/test_vllm_serving.py`` writes the request, runs this
script once per speculative configuration and compares the tokens and acceptance with fastdecode's.

    python tests/interop/vllm_check.py REQUEST.json RESULT.json

``REQUEST.json``: ``target`` (a local Hugging Face directory), ``prompts`` (token ids, the chat template
already applied by the caller, so both sides start from the same ids), ``max_tokens``, ``max_model_len`` and
``speculative_config`` (vLLM's dict, or null for plain decoding; e.g. ``{"method": "dflash", "model": DIR,
"num_speculative_tokens": B - 1}`` for a DFlash drafter). Greedy; generation stops at the model's
EOS. ``RESULT.json``: ``outputs`` (new token ids per prompt, in the prompts' order), ``spec_decode`` (vLLM's
counters: ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``;
empty without a drafter), ``rounds`` (per prompt, the ``accepted`` and ``drafted`` counts of every
verify step, vLLM's per-request detailed metrics) and ``versions``.

vLLM's engine starts worker processes, hence the ``__main__`` guard; its spec-decode counters are kept only
with ``disable_log_stats=False``. The caller sets ``VLLM_CPU_KVCACHE_SPACE`` and preloads Intel OpenMP.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def spec_decode_counters(metrics: list) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters from ``LLM.get_metrics()`` (summed over engines)."""
    out: dict = {}
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name not in COUNTERS:
            continue
        if hasattr(metric, "values"):  # the per-position vector
            prev = out.get(name, [0] * len(metric.values))
            out[name] = [a + b for a, b in zip(prev, metric.values, strict=True)]
        else:
            out[name] = out.get(name, 0) + int(metric.value)
    return out


def per_step(metrics) -> dict:
    """One request's ``accepted``/``drafted`` per verify step, in order (empty without a drafter)."""
    if metrics is None:
        return {"accepted": [], "drafted": []}
    return {"accepted": list(metrics.per_step_accepted), "drafted": list(metrics.per_step_drafted)}


def serve(request: dict) -> dict:
    """Decode ``request["prompts"]`` greedily with the configured drafter -> the result written out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["target"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        disable_log_stats=False,
        seed=0,
        speculative_config=request["speculative_config"],
        # each request's accepted/drafted per verify step (refused without a drafter)
        **({"per_request_spec_decode_metrics": "detailed"} if request["speculative_config"] else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "rounds": [per_step(o.outputs[0].spec_decode_metrics) for o in outputs],
        "spec_decode": spec_decode_counters(llm.get_metrics()),
        "versions": {name: version(name) for name in ("vllm-cpu", "torch", "transformers")},
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text())
    result = serve(request)
    Path(argv[1]).write_text(json.dumps(result))
    print(f"vllm {result['versions']['vllm-cpu']}: {len(result['outputs'])} prompts, {result['spec_decode']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
