"""Consuming a ``RolloutBatch``: the LightningModule that owns the policy and its update.

``module`` (``GRPOModule``) runs the update; ``logprobs`` and ``shared_prefix`` compute the policy's token
log-probs (the prompt once per group with the shared-prefix update); ``loss_config`` declares the loss settings
(``LossConfig``, YAML ``model.loss``), ``policy_losses`` builds the loss objects from it over the per-token terms
of ``surrogates``, and ``loss`` offers them as functions; ``sampler_correction`` reweights tokens sampled by older
weights or another sampler; ``reference_sync`` moves the frozen reference toward the policy (TR-DPO);
``metrics`` are the update's logged figures and ``held_out`` the validation's.
"""
