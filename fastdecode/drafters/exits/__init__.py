"""Early exits as drafters: self-speculation through the first E layers and the shared head, exit adapters
(Kangaroo) with their files and records, and an exit exported as a draft model.
"""
