"""Evaluation entry points (``python eval/<name>.py``); each module's ``run(cfg)`` is callable from tests."""
