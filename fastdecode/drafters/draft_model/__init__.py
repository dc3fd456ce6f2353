"""Two-model speculation: a separate, smaller draft model with the target's tokenizer, in its own cache."""
