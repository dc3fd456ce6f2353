"""Reports that decode and score: the exits' agreement on the model's own answers (``exits``) and
SkipDecode's quality under a policy (``skipdecode``).
"""
