"""An EAGLE-3 training step on a model's real shapes, and a random-init head written for decoding checks.

``python eval/eagle3_check.py model=random-llama2-7b model.device=cuda model.dtype=bfloat16 out=DIR``
(the console script ``fastdecode-eagle3-check``). It times one training step of the head on random weights,
writes the head to ``DIR/head`` for ``eval/speed.py drafter=DIR/head``, and prints one JSON line, also
written to ``DIR/eagle3_check.json``. Why and what it measures: docs/design/cli.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3_train.losses import ttt_loss
from fastdecode.config import ModelConfig, load_group
from fastdecode.drafters.eagle3.files import save_eagle3
from fastdecode.drafters.eagle3.model import Eagle3Config, Eagle3Head
from fastdecode.runtime.loading import load_model
from fastdecode.runtime.model import EarlyExitModel
from fastdecode_cli.launch import one_line_errors

DEFAULTS = {
    "model": "random-llama2-7b",
    "out": "outputs/eagle3_check",
    "batch": 2,
    "length": 512,
    "draft_vocab_size": 8192,
    "steps": 3,
    "seed": 0,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step(m: EarlyExitModel, head: Eagle3Head, batch: int, length: int, steps: int) -> dict:
    """One optimizer step of ``head`` on random tokens ``[batch, length]``: seconds of the target's feature
    pass and of the head's step (loss, backward, AdamW), and the peak memory (CUDA)."""
    aux = head.config.aux_layer_ids
    ids = torch.randint(0, m.vocab_size, (batch, length), device=m.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    _sync(m.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = m.hf(ids, output_hidden_states=True)
        data = {
            "input_ids": ids,
            "embeds": m.token_embed(ids).float(),
            "features": torch.cat([out.hidden_states[i] for i in aux], -1).float(),
            "target_logits": out.logits.float(),
            "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        }
    _sync(m.device)
    features_s = time.perf_counter() - start
    start = time.perf_counter()
    loss_sum, count, _ = ttt_loss(head, data, steps=steps)
    (loss_sum / max(count, 1)).backward()
    optimizer.step()
    _sync(m.device)
    peak = torch.cuda.max_memory_allocated(m.device) / 2**30 if m.device.type == "cuda" else None
    return {"features_s": features_s, "head_step_s": time.perf_counter() - start, "peak_gib": peak}


def run(argv: list[str]) -> dict:
    """The check of ``key=value`` arguments: ``DEFAULTS``' keys, and ``model.<field>`` overrides of the model config."""
    pairs = [a.split("=", 1) for a in argv]
    overrides = {k[len("model.") :]: OmegaConf.create({"v": v}).v for k, v in pairs if k.startswith("model.")}
    args = OmegaConf.merge(
        OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist([a for a in argv if not a.startswith("model.")])
    )
    cfg = load_group("model", args.model, ModelConfig, **overrides)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(cfg)
    m = EarlyExitModel(model.eval().requires_grad_(False))
    vocab = min(args.draft_vocab_size, m.vocab_size)
    layers = (
        model.config.num_hidden_layers
    )  # a tiny target, where the default ids repeat: three distinct ones
    aux = None if layers >= 7 else sorted({1, layers // 2, layers - 1})
    config = Eagle3Config.from_target(
        model.config, draft_vocab_size=vocab, aux_layer_ids=aux, norm_before_residual=False
    )
    head = Eagle3Head(config).to(m.device)  # trained in float32, as the recipe trains it
    result = {"model": args.model, "device": str(m.device), "dtype": str(m.dtype).replace("torch.", "")}
    result |= training_step(m, head, args.batch, args.length, args.steps)
    out = Path(args.out)
    save_eagle3(head.to(m.dtype), config, out / "head", verifier_name=args.model)
    result["head"] = str(out / "head")
    (out / "eagle3_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    """The console script: ``run`` on the command line's arguments (the result printed as one JSON line)."""
    run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
