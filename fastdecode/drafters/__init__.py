"""One package per drafter: its options, proposer, kind, model, files and tree builder. A drafter package
imports no other; ``fastdecode.registry`` registers them with the loop.
"""
