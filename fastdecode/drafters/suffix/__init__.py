"""Suffix decoding (SuffixDecoding, Oliaro et al., 2025): the suffix index and its file, the row, global and
corpus indexes (``sources``), the proposer (alone, or a chain's first stage), ``decoder.suffix``.
"""
