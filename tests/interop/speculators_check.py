"""Run the `speculators` package's own EAGLE-3 draft model on a head directory written by fastdecode.

Runs under the Python of a separate virtual environment that has ``speculators`` installed (its pins
clash with fastdecode's: transformers <= 5.19); it imports nothing from fastdecode. The slow test
``tests/test_eagle3_interop.py`` writes the head, the target and the inputs, runs this script and
compares the logits with ``fastdecode.drafters.eagle3.model.Eagle3Head``'s.

    python tests/interop/speculators_check.py CASE_DIR [CASE_DIR ...]

Each ``CASE_DIR`` holds ``head/``, the directory ``fastdecode.drafters.eagle3.files.save_eagle3`` wrote (its
``speculators_config`` names the verifier, a local Hugging Face directory, from which
``Eagle3DraftModel.from_pretrained`` takes the token embedding, as it does for any checkpoint), and
``inputs.pt``: a dict of ``hidden_states [1, T, 3H]``, ``input_ids [1, T]``, ``position_ids [1, T]``,
``document_ids [1, T]`` and ``ttt_steps`` (an int; ``T`` a multiple of 128, the block size of the
flex-attention mask speculators extends per step). The script writes ``CASE_DIR/speculators.pt``:
``logits``, one ``[1, T, draft_vocab_size]`` tensor per TTT step, taken from the model's ``lm_head`` as
its training forward runs, and ``versions``.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import torch
from speculators.models.eagle3 import Eagle3DraftModel


def draft_logits(head_dir: str, inputs: dict) -> list[torch.Tensor]:
    """The draft logits of every TTT step of ``Eagle3DraftModel.forward`` (no loss: no verifier states)."""
    model = Eagle3DraftModel.from_pretrained(head_dir, torch_dtype=torch.float32).eval()
    # speculators 0.9.0 under transformers 5.x: from_pretrained leaves embed_tokens.weight, absent from the
    # checkpoint, as uninitialised memory instead of its NaN marker, so load_verifier_weights ("load the
    # verifier's embedding if NaN") keeps whatever bytes were there (the NaN guard's flaw, as
    # vllm-project/speculators PR #962 describes it for DFlash). Its own loader, told to overwrite, puts the
    # verifier's embedding in, as the class means to.
    before = model.embed_tokens.weight.detach().clone()
    model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001
    if not torch.equal(before, model.embed_tokens.weight):
        print("speculators left embed_tokens uninitialised; reloaded it from the verifier", file=sys.stderr)
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(
            hidden_states=inputs["hidden_states"],
            input_ids=inputs["input_ids"],
            document_ids=inputs["document_ids"],
            position_ids=inputs["position_ids"],
            ttt_steps=int(inputs["ttt_steps"]),
        )
    hook.remove()
    return captured


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    versions = {name: version(name) for name in ("speculators", "transformers", "torch")}
    for case in map(Path, argv):
        logits = draft_logits(str(case / "head"), torch.load(case / "inputs.pt"))
        torch.save({"logits": logits, "versions": versions}, case / "speculators.pt")
        print(
            f"{case.name}: speculators {versions['speculators']}, {len(logits)} steps of {tuple(logits[0].shape)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
