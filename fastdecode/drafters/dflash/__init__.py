"""DFlash block drafters (Chen et al., 2026): the drafter's shape (``model``) and network (``layer``), its files
in the native and speculators formats (``files``), the proposer and its kind, ``decoder.dflash``.
"""
