"""Building a training step's batch: prompts in, a ``RolloutBatch`` out (no Lightning here).

``prompts`` and ``hf_dataset`` read prompt sources; ``builder`` asks the engine (``lit_grpo.sampling``, scheduled by
``lit_grpo.scheduling``) for G completions per prompt, scores them (``rewards``, ``reward_functions``,
``math_reward``), turns rewards into advantages (``advantages``) and packs the ``RolloutBatch``
(``lit_grpo.batch``), its settings grouped in ``config``; ``slot_memory`` decides the training engine's slot-cache
memory (``micro_group_size`` and ``keep_kv_cache`` ``auto``); ``metrics`` are the rollout's logged figures.
"""
