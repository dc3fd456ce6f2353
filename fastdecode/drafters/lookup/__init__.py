"""Prompt lookup: n-gram drafting from a row's own text (``ngram``), its token trees (``tree``), lookahead
decoding's n-gram drafts (``lookahead``), ``decoder.lookup``; the default first stage of a chain.
"""
