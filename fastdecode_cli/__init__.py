"""Entry points (the top layer): the Hydra ``main`` functions behind the console scripts and the scripts.

Every command is a console script (``pyproject.toml``) and, in a checkout, a thin file that calls it:
``fastdecode-train`` = ``python train.py``, ``fastdecode-collect`` = ``python collect_jacobi.py``,
``fastdecode-speed`` = ``python eval/speed.py``, ``fastdecode-exits`` = ``python eval/exits.py``,
``fastdecode-engine`` = ``python eval/engine.py``, ``fastdecode-skipdecode-quality`` =
``python eval/skipdecode_quality.py``, ``fastdecode-collect-throughput`` = ``python eval/collect_throughput.py``,
``fastdecode-train-cost`` = ``python eval/train_cost.py`` (argparse flags), ``fastdecode-regenerate`` =
``python -m fastdecode_cli.regenerate``. Each ``main`` is a thin ``@hydra.main`` around a plain ``run(cfg)``
that tests call directly, the work itself in the library (``fastdecode``, ``fastdecode.bench``, the training
packages); configs are read from the installed package (``fastdecode/configs``), so every command works from
any folder.
"""
