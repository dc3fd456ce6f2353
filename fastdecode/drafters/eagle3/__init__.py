"""EAGLE-3 heads (Li et al., 2025): the head (``model``, ``layer``), its files in the speculators and
SGLang dialects (``files``), the proposer and its kind, EAGLE-2 dynamic trees (``tree``), ``decoder.eagle3``.
"""
