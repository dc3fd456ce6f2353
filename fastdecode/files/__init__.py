"""Files: atomic writes, locks, fault injection, file caches, checkpoints and their sidecars, tensor shards,
PyPI-packaged assets and the draft-vocabulary format. Nothing here knows a model.
"""
