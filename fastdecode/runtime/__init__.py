"""The runtime: the model seam over Hugging Face (``model``, ``families``, ``engine_build``, ``exit_blocks``),
the decoding engine (``engine``, ``fast_linear``), the explicit KV cache, loading, and the machine's facts.
"""
