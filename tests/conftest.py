"""Shared fixtures: tiny random-init models of every supported family (built in code, no download)."""

from __future__ import annotations

import os

import pytest

from fastdecode.config import group_choices
from tests.helpers import tiny_model

# Every configs/model/tiny-*.yaml (one per registered family, tests/test_model.py checks): a new family's tiny
# config is covered by every test that runs the tiny models, without an edit here.
TINY_MODELS = [name for name in group_choices("model") if name.startswith("tiny-")]
# Execution paths the equality tests run on (DecodeConfig fields, fastdecode/runtime/engine.py): the HF modules on the
# dynamic cache (the reference), the CPU default (lean layers, kernels chosen by measurement), every projection
# and head packed (MKL at one row, oneDNN above), and the static-shape cache.
REFERENCE = {
    "fast_layers": False,
    "fast_linear": False,
    "linear_kernel": None,
    "static_cache": None,
    "compile": False,
}
ENGINES = {
    "hf": REFERENCE,
    "fast": {},
    "packed": {"linear_kernel": "mkl"},
    "static": {"static_cache": True, "linear_kernel": "dnn"},
}


@pytest.fixture(params=TINY_MODELS)
def tiny(request):
    """(hf_model, tokenizer) of one tiny family, fp32 on the CPU, shared across tests (do not train it)."""
    return tiny_model(request.param)


@pytest.fixture
def tiny_llama():
    return tiny_model("tiny-llama")


@pytest.fixture(autouse=True, scope="session")
def cost_store(tmp_path_factory):
    """Measured costs kept on disk for this test session only (fastdecode/plan/cost_store.py), never in the user's
    cache: a test measures on this machine as a user would, and no earlier session's numbers leak in."""
    saved = os.environ.get("FASTDECODE_COSTS")
    os.environ["FASTDECODE_COSTS"] = str(tmp_path_factory.mktemp("costs"))
    yield os.environ["FASTDECODE_COSTS"]
    if saved is None:
        os.environ.pop("FASTDECODE_COSTS", None)
    else:
        os.environ["FASTDECODE_COSTS"] = saved
