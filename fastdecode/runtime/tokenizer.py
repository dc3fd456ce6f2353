"""A byte-level tokenizer built in code, for the tiny random-init test models (no download, no files)."""

from __future__ import annotations

from functools import lru_cache

from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML, like SmolLM2 and Qwen2: the assistant turn ends with <|im_end|>, which is also EOS.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=1)
def _build() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the byte tokenizer: 5 special tokens + 256 bytes = 261 ids, ChatML chat template.

    Every byte string round-trips exactly. Its vocabulary fits any tiny test model with vocab_size >= 261.
    """
    import copy

    return copy.deepcopy(_build())
