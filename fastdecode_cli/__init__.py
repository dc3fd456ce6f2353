"""Entry points (the top layer): the Hydra ``main`` functions behind the console scripts and the scripts.

Every command is a console script (``pyproject.toml``) and, in a checkout, often also a thin file that calls
it (``train.py``, ``collect_jacobi.py``, ``eval/*.py``); docs/design/cli.md lists them. Most ``main``s are a
thin ``@hydra.main`` around a plain ``run(cfg)`` that tests call directly; the work itself is in the library.
Configs are read from the installed package (``fastdecode/configs``), so every command works from any folder.
"""
