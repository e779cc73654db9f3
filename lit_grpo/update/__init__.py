"""Consuming a ``RolloutBatch``: the LightningModule that owns the policy and its update.

``module`` (``GRPOModule``) runs the update; ``logprobs`` and ``shared_prefix`` compute the policy's token
log-probs (the prompt once per group with the shared-prefix update); ``loss`` holds the loss objects, built from
``policy_losses`` and ``surrogates``; ``sampler_correction`` reweights tokens sampled by older weights or another
sampler; ``metrics`` are the update's logged figures.
"""
