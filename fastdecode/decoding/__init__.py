"""The one decoding loop and the decoders that are not speculation: free functions over ``EarlyExitModel`` and
its explicit KV cache. ``speculative`` verifies any ``Proposer`` (chains and token trees, ``tree``), ``chain``
puts a first stage before a drafter, ``policies`` choose draft lengths; ``autoregressive``, ``jacobi`` and
``skipdecode`` decode without drafts. The drafters live in ``fastdecode.drafters``, registered by
``fastdecode.registry``; nothing here imports them.
"""
