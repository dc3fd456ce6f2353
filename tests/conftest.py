"""Shared fixtures: tiny random-init models of every supported family (built in code, no download)."""

from __future__ import annotations

import functools

import pytest
import torch

from fastdecode.config import ModelConfig, load_group
from fastdecode.loading import load_model

TINY_MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-opt"]


@functools.cache
def _tiny(name: str):
    torch.use_deterministic_algorithms(False)
    model, tokenizer = load_model(load_group("model", name, ModelConfig, dtype="float32", device="cpu"))
    return model, tokenizer


@pytest.fixture(params=TINY_MODELS)
def tiny(request):
    """(hf_model, tokenizer) of one tiny family, fp32 on the CPU, shared across tests (do not train it)."""
    return _tiny(request.param)


@pytest.fixture
def tiny_llama():
    return _tiny("tiny-llama")
