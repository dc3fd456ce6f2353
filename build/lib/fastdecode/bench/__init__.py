"""Speed benchmark of the decoders against each other and against Hugging Face ``generate``.

``config`` (job and method configs, checks before loading), ``engines`` (how each method is called and
counted), ``measure`` (warm-up and the interleaved, device-synchronised timing loop), ``stats`` (records and
summary), ``report`` and ``plots`` (JSON, CSV, Markdown, PNG), ``speed.run`` (all of it; ``eval/speed.py``).
"""
