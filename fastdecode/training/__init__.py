"""Training-only code shared by the training packages (``layerskip_train``, ``cllm_train``,
``skipdecode_train``, ``adapter_train``, ``eagle3_train``) and the recipes: the module a Trainer trains
(``WrappedLM``), the Trainer logging mixin, the seeded draws of a training step, the feature cache of a frozen
model (``features.py``).

Nothing in the rest of ``fastdecode`` (the model, data, decoders, reports) imports this package
(``tests/test_architecture.py``), so decoding never pulls in Trainer-side code.
"""
