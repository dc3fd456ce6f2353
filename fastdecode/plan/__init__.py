"""The plan: the cost model measured on the loaded model (and its store), the acceptance a checkpoint records,
timing helpers, and ``choose``, which turns the drafters' offers into what ``auto`` runs.
"""
