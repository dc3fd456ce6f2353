"""Entry points (the top layer): the Hydra ``main`` functions behind the console scripts and the scripts.

``fastdecode-train`` = ``python train.py``, ``fastdecode-collect`` = ``python collect_jacobi.py``,
``fastdecode-speed`` = ``python eval/speed.py``, ``fastdecode-exits`` = ``python eval/exits.py``,
``fastdecode-regenerate`` = ``python -m fastdecode_cli.regenerate``. Each ``main`` is a thin ``@hydra.main``
around a plain ``run(cfg)`` that tests call directly; configs are read from the installed package
(``fastdecode/configs``), so every command works from any folder.
"""
