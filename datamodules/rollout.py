"""``RolloutDataModule``: prompts in, scored GRPO rollouts (``RolloutBatch``) out, one per training step.

Flow of one training step::

    train loader yields RolloutRequest(step)                (an endless-per-epoch stream, num_workers=0)
      -> on_before_batch_transfer(request)                  (Lightning calls it right before training_step)
           sampler.draw(prompts_per_step)                   (uniform, or the angle curriculum)
           engine.generate(prompt_ids)                      (the CURRENT policy, no_grad, eval mode, then train)
           score_rewards(...)                               (weighted reward functions)
           [dynamic sampling: drop all-equal groups, draw more, up to max_sampling_rounds]
           group_advantages(rewards, scale_rewards)
           sampler.update(accuracy)                         (curriculum feedback)
      -> RolloutBatch                                       (moved to the device, then GRPOModule.training_step)

Why the rollout is built in ``on_before_batch_transfer`` and not inside the dataset's iterator: Lightning's
training loop prefetches one batch ahead (to know which batch is the last), so an iterator that generated there
would sample step k+1 with the policy from before step k's update, and would draw the next prompts (and move
the curriculum) one step early. Building it in the hook that runs right before ``training_step`` keeps every
rollout strictly on-policy and makes the data state in a checkpoint exactly "the steps trained so far", which
exact resume needs. The hook also runs for validation batches: greedy rollouts (one sample per prompt) on the
held-out prompts.

The policy and tokenizer come from the trainer's LightningModule (``policy`` and ``tokenizer`` attributes, e.g.
``GRPOModule``); without a trainer call ``attach(model, tokenizer)``. ``scale_rewards`` is read from the module
too (it is part of the objective), else ``"group"``.

Distributed (ddp): every rank builds the same sampler and draws ``prompts_per_step x world_size`` indices per
step, keeping its own slice, so ranks get different prompts and groups never split across ranks. Dynamic
sampling's extra rounds are per rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset

from lit_grpo.advantages import group_advantages, zero_std_groups
from lit_grpo.batch import RolloutBatch, merge_stats, pad_left, pad_right
from lit_grpo.datamodules.curriculum import CURRICULA, angle_concentration, build_prompt_sampler
from lit_grpo.datamodules.prompts import PromptExample, load_prompts, render_prompt, split_examples
from lit_grpo.rewards import ON_ERROR, WeightedReward, build_reward_funcs, score_rewards
from lit_grpo.validation import check_int

DEFAULT_SYSTEM_PROMPT = None


@dataclass(frozen=True)
class RolloutRequest:
    """What the loaders yield: a token asking for a rollout, turned into a ``RolloutBatch`` at transfer time.

    Attributes:
        split: "train" or "val".
        step: the index of this request in its epoch.
        indices: for "val", the held-out prompt indices of this batch; None for "train" (the sampler decides).
    """

    split: str
    step: int
    indices: tuple[int, ...] | None = None


class _RequestStream(IterableDataset):
    """Yields ``RolloutRequest``s: ``num_steps`` train requests, or one val request per chunk of indices."""

    def __init__(self, split: str, num_steps: int, chunks: Sequence[Sequence[int]] | None = None):
        self.split, self.num_steps, self.chunks = split, num_steps, chunks

    def __iter__(self) -> Iterator[RolloutRequest]:
        if self.chunks is not None:
            for step, chunk in enumerate(self.chunks):
                yield RolloutRequest(self.split, step, tuple(chunk))
        else:
            for step in range(self.num_steps):
                yield RolloutRequest(self.split, step)

    def __len__(self) -> int:
        return len(self.chunks) if self.chunks is not None else self.num_steps


class _RequestLoader(DataLoader):
    """A DataLoader of ``RolloutRequest`` tokens that Lightning treats as resumable (``state_dict`` /
    ``load_state_dict``), so a mid-epoch resume is exact without the "dataloader is not resumable" warning.

    The requests carry no data: the prompt stream's position (sampler, engine counters, random streams) lives in
    ``RolloutDataModule.state_dict``, and Lightning's restored batch progress ends the resumed epoch where the
    original one ended.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        return None


def _rng_states() -> dict[str, Any]:
    """The global python / numpy / torch (CPU) random states, as plain lists and a tensor (so checkpoints load with
    ``torch.load(weights_only=True)``)."""
    import random

    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state()}


def _set_rng_states(states: Mapping[str, Any]) -> None:
    import random

    import numpy as np

    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "torch" in states:
        torch.set_rng_state(torch.as_tensor(states["torch"], dtype=torch.uint8))


class RolloutDataModule(LightningDataModule):
    """Streams GRPO rollouts built by the rollout engine with the current policy.

    Prompt source (exactly one):
        task: a reasoning-gym task name (e.g. "basic_arithmetic", "chain_sum"); ``size`` entries, ``data_seed``;
            ``task_config`` goes to the task's config (e.g. ``{min_terms: 2, max_digits: 1}``).
        jsonl_path: a JSONL file with ``prompt`` (or ``question``), optional ``answer`` and any other fields.
        prompts: an inline list of strings or ``{prompt, answer}`` dicts.
    Prompt rendering:
        system_prompt: optional system message; prompt_template: ``"...{prompt}..."`` for the user message; the
        tokenizer's chat template is applied (generation prompt added).
        val_size: held-out prompts (count or fraction) for validation; split with ``data_seed``.
    Rewards:
        reward_funcs: list of specs, see ``lit_grpo.rewards.build_reward_funcs`` (default ``["accuracy"]``).
        accuracy_reward: the reward function whose value is correctness (val/accuracy, curriculum feedback).
    Rollouts (the engine, see ``lit_grpo.sampling.RolloutEngine``):
        prompts_per_step: B, groups per training step (per rank). group_size: G (>= 2 for training: a lone
            completion has nothing to be compared with).
        micro_group_size: g, concurrent sequences; ``"auto"`` picks the largest g whose worst-case KV cache fits
            ``kv_budget_bytes`` (``lit_grpo.sampling.memory_budget``; logged as ``rollout/micro_group_size``).
        kv_budget_bytes: the KV-cache byte budget for ``micro_group_size="auto"``.
        strategy, max_new_tokens, temperature, top_p, top_k, seed, scheduler_options: engine settings.
        dynamic_sampling: drop groups whose G rewards are all equal and draw more prompts, at most
            ``max_sampling_rounds`` engine calls per step; if still short, dropped groups fill the batch (their
            advantages are 0, so they add no gradient) so every step has B groups.
        steps_per_epoch: training steps per epoch; default ``ceil(train prompts / (B x world_size))``.
    Reward errors:
        on_reward_error: ``"raise"`` (a reward function that raises stops training with an error naming the
            function and the prompt) or ``"skip_group"`` (the failing groups are scored 0, get zero advantages and
            no loss tokens, so they are never trained on; a warning names each, and ``reward/skipped_groups``
            counts them per step). Validation prompts that fail are left out of val/reward and val/accuracy.
    Validation:
        val_batch_size: prompts per greedy validation rollout; val_max_new_tokens: default ``max_new_tokens``.
    Curriculum:
        curriculum: "none" (uniform, epoch-style shuffling) or "angle" (GAIN-RL); curriculum_kwargs go to the
        sampler; score_batch_size: prompts per prefill when scoring angle concentration.
    """

    def __init__(
        self,
        task: str | None = None,
        task_config: dict[str, Any] | None = None,
        size: int = 1000,
        jsonl_path: str | None = None,
        prompts: list[Any] | None = None,
        data_seed: int = 0,
        val_size: int | float = 64,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prompt_template: str = "{prompt}",
        reward_funcs: list[Any] | None = None,
        accuracy_reward: str = "accuracy",
        prompts_per_step: int = 4,
        group_size: int = 8,
        micro_group_size: int | str | None = None,
        kv_budget_bytes: int | None = None,
        strategy: str = "infinite",
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        scheduler_options: dict[str, Any] | None = None,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        steps_per_epoch: int | None = None,
        val_batch_size: int = 32,
        val_max_new_tokens: int | None = None,
        curriculum: str = "none",
        curriculum_kwargs: dict[str, Any] | None = None,
        score_batch_size: int = 8,
        on_reward_error: str = "raise",
    ):
        super().__init__()
        check_int("size", size, 1)
        check_int("prompts_per_step", prompts_per_step, 1)
        check_int("group_size", group_size, 2)
        if micro_group_size == "auto":
            if kv_budget_bytes is None:
                raise ValueError("micro_group_size='auto' needs kv_budget_bytes (the KV-cache byte budget)")
            check_int("kv_budget_bytes", kv_budget_bytes, 1)
        elif micro_group_size is not None:
            if isinstance(micro_group_size, str):
                raise ValueError(f"micro_group_size={micro_group_size!r} must be an integer >= 1, 'auto' or None")
            check_int("micro_group_size", micro_group_size, 1)
        if on_reward_error not in ON_ERROR:
            raise ValueError(f"on_reward_error={on_reward_error!r} is not supported; use one of {list(ON_ERROR)}")
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("max_sampling_rounds", max_sampling_rounds, 1)
        check_int("val_batch_size", val_batch_size, 1)
        check_int("score_batch_size", score_batch_size, 1)
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch, 1)
        if val_max_new_tokens is not None:
            check_int("val_max_new_tokens", val_max_new_tokens, 1)
        if curriculum not in CURRICULA:
            raise ValueError(f"curriculum={curriculum!r} is not known; use one of {list(CURRICULA)}")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template={prompt_template!r} must contain '{{prompt}}'")
        self.save_hyperparameters(ignore=["prompts"])
        self.task, self.task_config, self.size, self.jsonl_path = task, task_config, size, jsonl_path
        self.inline_prompts = prompts
        self.data_seed, self.val_size = data_seed, val_size
        self.system_prompt, self.prompt_template = system_prompt, prompt_template
        self.reward_funcs: list[WeightedReward] = build_reward_funcs(reward_funcs)
        self.accuracy_reward = accuracy_reward
        self.prompts_per_step, self.group_size, self.micro_group_size = prompts_per_step, group_size, micro_group_size
        self.kv_budget_bytes, self.on_reward_error = kv_budget_bytes, on_reward_error
        self.resolved_micro_group_size: int | None = None  # the g the engine uses ("auto" resolved)
        self.strategy, self.max_new_tokens = strategy, max_new_tokens
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.scheduler_options = dict(scheduler_options or {})
        self.dynamic_sampling, self.max_sampling_rounds = dynamic_sampling, max_sampling_rounds
        self.steps_per_epoch = steps_per_epoch
        self.val_batch_size, self.val_max_new_tokens = val_batch_size, val_max_new_tokens or max_new_tokens
        self.curriculum, self.curriculum_kwargs = curriculum, dict(curriculum_kwargs or {})
        self.score_batch_size = score_batch_size

        self.examples: list[PromptExample] | None = None
        self.train_indices: list[int] = []
        self.val_indices: list[int] = []
        self.train_prompt_ids: list[list[int]] = []
        self.val_prompt_ids: list[list[int]] = []
        self.sampler = None
        self._engine = None
        self._val_engine = None
        self._model = None
        self._tokenizer = None
        self._pending_state: dict[str, Any] = {}
        self.steps_built = 0  # training rollouts built so far (the position in the prompt stream)

    # ------------------------------------------------------------------------------------------ policy
    def attach(self, model: torch.nn.Module, tokenizer: Any) -> None:
        """Use this model and tokenizer (for use without a trainer; with one, they come from the module)."""
        self._model, self._tokenizer = model, tokenizer

    def _module(self) -> Any:
        trainer = getattr(self, "trainer", None)
        return trainer.lightning_module if trainer is not None else None

    def _from_module(self, name: str, attached: Any) -> Any:
        """The trainer's module's ``name`` (tokenizer, policy) when it has one, else what ``attach`` gave."""
        module = self._module()
        value = getattr(module, name, None) if module is not None else None
        return value if value is not None else attached

    @property
    def tokenizer(self) -> Any:
        tokenizer = self._from_module("tokenizer", self._tokenizer)
        if tokenizer is None:
            raise RuntimeError("RolloutDataModule has no tokenizer: run it under a Trainer with a module that has "
                               "`tokenizer` (GRPOModule), or call attach(model, tokenizer)")
        return tokenizer

    @property
    def policy(self) -> torch.nn.Module:
        model = self._from_module("policy", self._model)
        if model is None:
            raise RuntimeError("RolloutDataModule has no policy model: run it under a Trainer with a module that has "
                               "`policy` (GRPOModule, after configure_model), or call attach(model, tokenizer)")
        return model

    @property
    def scale_rewards(self) -> str:
        module = self._module()
        scale = getattr(module, "scale_rewards", None) if module is not None else None
        return scale if scale is not None else "group"

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    # ------------------------------------------------------------------------------------------ data
    def setup(self, stage: str | None = None) -> None:
        """Load and tokenize the prompts, split them, and build the prompt sampler (once)."""
        if self.examples is not None:
            return
        examples = load_prompts(self.task, self.size, self.data_seed, self.task_config, self.jsonl_path,
                                self.inline_prompts)
        self.train_indices, self.val_indices = split_examples(examples, self.val_size, self.data_seed)
        tokenizer = self.tokenizer
        render = lambda i: render_prompt(tokenizer, examples[i].prompt, self.system_prompt,  # noqa: E731
                                         self.prompt_template)
        self.train_prompt_ids = [render(i) for i in self.train_indices]
        self.val_prompt_ids = [render(i) for i in self.val_indices]
        self.examples = examples
        world, _ = self._world()
        if self.prompts_per_step * world > len(self.train_indices):
            raise ValueError(f"prompts_per_step={self.prompts_per_step} x world_size={world} exceeds the "
                             f"{len(self.train_indices)} training prompts")
        self.sampler = build_prompt_sampler(self.curriculum, len(self.train_indices), self.seed,
                                            **self.curriculum_kwargs)
        if "sampler" in self._pending_state:
            self.sampler.load_state_dict(self._pending_state.pop("sampler"))

    def num_train_steps_per_epoch(self) -> int:
        world, _ = self._world()
        return self.steps_per_epoch or max(1, math.ceil(len(self.train_indices) / (self.prompts_per_step * world)))

    def train_dataloader(self) -> DataLoader:
        return _RequestLoader(_RequestStream("train", self.num_train_steps_per_epoch()), batch_size=None,
                              num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_indices:
            return []
        world, rank = self._world()
        positions = list(range(len(self.val_indices)))[rank::world]
        chunks = [positions[i:i + self.val_batch_size] for i in range(0, len(positions), self.val_batch_size)]
        return DataLoader(_RequestStream("val", len(chunks), chunks), batch_size=None, num_workers=0)

    # ------------------------------------------------------------------------------------------ engines
    def _make_engine(self, group_size: int, greedy: bool):
        from lit_grpo.sampling import RolloutEngine

        if greedy:
            engine = RolloutEngine(self.policy, self.tokenizer, group_size=1,
                                   micro_group_size=self.val_batch_size, strategy="continuous",
                                   max_new_tokens=self.val_max_new_tokens, temperature=0.0, seed=self.seed)
            engine.inference_mode = not self._sharded()
            return engine
        self.resolved_micro_group_size = self._resolve_micro_group_size()
        engine = RolloutEngine(self.policy, self.tokenizer, group_size=group_size,
                               micro_group_size=self.resolved_micro_group_size, strategy=self.strategy,
                               max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, seed=self.seed, **self.scheduler_options)
        engine.inference_mode = not self._sharded()
        return engine

    def _sharded(self) -> bool:
        """Whether the policy is FSDP2-sharded (its forward hooks gather weights: no inference_mode)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - old torch
            return False
        return isinstance(self.policy, FSDPModule)

    def _resolve_micro_group_size(self) -> int | None:
        """``micro_group_size``, with ``"auto"`` turned into the largest g that fits ``kv_budget_bytes``."""
        if self.micro_group_size != "auto":
            return self.micro_group_size
        from lit_grpo.sampling.memory_budget import auto_micro_group_size

        policy = self.policy
        dtype = next(policy.parameters()).dtype
        max_prompt_len = max((len(ids) for ids in self.train_prompt_ids), default=0)
        return auto_micro_group_size(policy.config, dtype, self.kv_budget_bytes, max_prompt_len, self.max_new_tokens,
                                     self.group_size, self.prompts_per_step)

    @property
    def engine(self):
        """The training rollout engine (built on first use; rebuilt, keeping its state, if the policy changed)."""
        model = self.policy
        if self._engine is None or self._engine.model is not model:
            state = self._engine.state_dict() if self._engine is not None else self._pending_state.pop("engine", None)
            self._engine = self._make_engine(self.group_size, greedy=False)
            if state is not None:
                self._engine.load_state_dict(state)
        return self._engine

    @property
    def val_engine(self):
        model = self.policy
        if self._val_engine is None or self._val_engine.model is not model:
            self._val_engine = self._make_engine(1, greedy=True)
        return self._val_engine

    @contextlib.contextmanager
    def _generation_mode(self):
        """No grad, model in eval mode (restored afterwards), inside the precision plugin's autocast if any."""
        model = self.policy
        was_training = model.training
        trainer = getattr(self, "trainer", None)
        precision = trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()
        model.eval()
        try:
            with torch.no_grad(), precision:
                yield model
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------------------------------ rollouts
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, RolloutRequest):
            return self.build_val_batch(batch.indices) if batch.split == "val" else self.build_train_batch()
        return batch

    def _epoch(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.current_epoch if trainer is not None else 0

    def _draw(self, count: int) -> list[int]:
        """``count`` positions into the train prompts for this rank (all ranks draw the same global batch)."""
        world, rank = self._world()
        drawn = self.sampler.draw(count * world)
        return drawn[rank * count:(rank + 1) * count]

    def _generate_and_score(self, engine, positions: list[int], split: str) -> dict[str, Any]:
        prompt_ids_all = self.train_prompt_ids if split == "train" else self.val_prompt_ids
        source = self.train_indices if split == "train" else self.val_indices
        prompt_ids = [prompt_ids_all[i] for i in positions]
        with self._generation_mode():
            result = engine.generate(prompt_ids)
        group_size = engine.group_size
        examples = [self.examples[source[i]] for i in positions]
        tokenizer = self.tokenizer
        texts = [[tokenizer.decode(ids, skip_special_tokens=True) for ids in group] for group in result.completion_ids]
        flat = lambda per_prompt: [v for v in per_prompt for _ in range(group_size)]  # noqa: E731
        columns = {
            "answer": flat([e.answer for e in examples]),
            "entry": flat([e.entry for e in examples]),
            "completion_ids": [ids for group in result.completion_ids for ids in group],
            "completion_length": [len(ids) for group in result.completion_ids for ids in group],
            "truncated": [t for group in result.truncated for t in group],
            "max_new_tokens": [engine.max_new_tokens] * (len(examples) * group_size),
        }
        extra_keys = sorted({k for e in examples for k in e.entry} - set(columns) - {"prompt", "question"})
        for key in extra_keys:
            columns[key] = flat([e.entry.get(key) for e in examples])
        scores = score_rewards(self.reward_funcs, flat([e.prompt for e in examples]),
                               [t for group in texts for t in group], columns, group_size=group_size,
                               on_error=self.on_reward_error)
        skipped = torch.zeros(len(examples), dtype=torch.bool)
        skipped[scores.skipped_groups] = True
        return {
            "positions": positions,
            "examples": examples,
            "prompt_ids": prompt_ids,
            "completion_ids": result.completion_ids,
            "logprobs": result.logprobs,
            "truncated": result.truncated,
            "texts": texts,
            "rewards": scores.total.view(len(examples), group_size),
            "components": {k: v.view(len(examples), group_size) for k, v in scores.components.items()},
            "skipped": skipped,
            "stats": result.stats,
        }

    def build_train_batch(self) -> RolloutBatch:
        """One training step's rollout: draw prompts, generate with the current policy, score, advantages."""
        if self.sampler is None:
            raise RuntimeError("RolloutDataModule.setup() must run before building rollouts")
        if self.sampler.needs_scores(self._epoch()):
            with self._generation_mode() as model:
                scores = angle_concentration(model, self.tokenizer, self.train_prompt_ids, self.score_batch_size)
            self.sampler.set_scores(scores, self._epoch())
        engine = self.engine
        rounds = [self._generate_and_score(engine, self._draw(self.prompts_per_step), "train")]
        keep = self._kept_groups(rounds)
        while self.dynamic_sampling and len(keep) < self.prompts_per_step and len(rounds) < self.max_sampling_rounds:
            rounds.append(self._generate_and_score(engine, self._draw(self.prompts_per_step - len(keep)), "train"))
            keep = self._kept_groups(rounds)
        chosen = keep[: self.prompts_per_step]
        if len(chosen) < self.prompts_per_step:  # fill with dropped groups (zero advantage) to keep B fixed
            dropped = [key for key in self._all_groups(rounds) if key not in set(chosen)]
            chosen = chosen + dropped[: self.prompts_per_step - len(chosen)]
        batch = self._assemble(rounds, chosen, engine, split="train")
        batch.metrics["rollout/sampling_rounds"] = float(len(rounds))
        batch.metrics["reward/skipped_groups"] = float(sum(int(part["skipped"].sum()) for part in rounds))
        if engine.micro_group_size is not None:
            batch.metrics["rollout/micro_group_size"] = float(engine.micro_group_size)
        self._curriculum_update(batch)
        self.steps_built += 1
        return batch

    def build_val_batch(self, positions: Sequence[int]) -> RolloutBatch:
        """Greedy completions (one per prompt) of some held-out prompts, scored."""
        engine = self.val_engine
        part = self._generate_and_score(engine, list(positions), "val")
        return self._assemble([part], [(0, p) for p in range(len(positions))], engine, split="val")

    def _all_groups(self, rounds: list[dict]) -> list[tuple[int, int]]:
        return [(r, p) for r, part in enumerate(rounds) for p in range(len(part["positions"]))]

    def _kept_groups(self, rounds: list[dict]) -> list[tuple[int, int]]:
        if not self.dynamic_sampling:
            return self._all_groups(rounds)
        return [(r, p) for r, part in enumerate(rounds) for p in range(len(part["positions"]))
                if not bool(zero_std_groups(part["rewards"])[p]) and not bool(part["skipped"][p])]

    def _assemble(self, rounds: list[dict], chosen: list[tuple[int, int]], engine, split: str) -> RolloutBatch:
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pick = lambda key: [rounds[r][key][p] for r, p in chosen]  # noqa: E731
        group_size = engine.group_size
        rewards = torch.stack([rounds[r]["rewards"][p] for r, p in chosen])
        components = {name: torch.stack([rounds[r]["components"][name][p] for r, p in chosen])
                      for name in rounds[0]["components"]}
        completion_ids = pick("completion_ids")
        flat_ids = [ids for group in completion_ids for ids in group]
        flat_logprobs = [lp for group in pick("logprobs") for lp in group]
        width = max((len(ids) for ids in flat_ids), default=1)
        ids_tensor, mask = pad_right(flat_ids, pad, width)
        logprobs_tensor, _ = pad_right(flat_logprobs, 0.0, width, dtype=torch.float32)
        prompt_ids, prompt_mask = pad_left(pick("prompt_ids"), pad)
        truncated = torch.tensor(pick("truncated"), dtype=torch.bool).view(len(chosen), group_size)
        lengths = mask.sum(dim=1).view(len(chosen), group_size)
        examples = pick("examples")
        all_rewards = torch.cat([part["rewards"] for part in rounds])
        skipped = torch.stack([rounds[r]["skipped"][p] for r, p in chosen])
        advantages = (self._advantages(rewards, skipped) if split == "train" else torch.zeros_like(rewards))
        return RolloutBatch(
            stats=merge_stats([part["stats"] for part in rounds]),
            prompts=[e.prompt for e in examples],
            completions=pick("texts"),
            rewards=rewards,
            completion_lengths=lengths,
            truncated=truncated,
            advantages=advantages,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=ids_tensor.view(len(chosen), group_size, -1),
            completion_mask=mask.view(len(chosen), group_size, -1),
            sampling_logprobs=logprobs_tensor.view(len(chosen), group_size, -1),
            reward_components=components,
            columns={"answer": [e.answer for e in examples], "entry": [e.entry for e in examples]},
            indices=[self._source(split)[rounds[r]["positions"][p]] for r, p in chosen],
            max_new_tokens=engine.max_new_tokens,
            temperature=engine.temperature,
            pad_token_id=pad,
            num_groups_generated=all_rewards.shape[0],
            num_groups_zero_std=int(zero_std_groups(all_rewards).sum()) if group_size > 1 else all_rewards.shape[0],
            split=split,
            skipped=skipped,
        )

    def _advantages(self, rewards: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` advantages; skipped groups get 0 and are left out of the batch statistics.

        ``scale_rewards="batch"`` under ddp: the standard deviation spans every rank's (kept) rewards, gathered
        with ``all_gather`` (all ranks have the same ``[B, G]`` shape), so all ranks scale by the same number.
        """
        scale = self.scale_rewards
        advantages = torch.zeros_like(rewards, dtype=torch.float32)
        world, _ = self._world()
        batch_rewards = None
        if scale == "batch" and world > 1:
            strategy = self.trainer.strategy
            device = strategy.root_device
            gathered = strategy.all_gather(rewards.float().to(device))        # [W, B, G]
            kept = strategy.all_gather(skipped.to(device).logical_not())      # [W, B]
            batch_rewards = gathered.reshape(-1, rewards.shape[1])[kept.reshape(-1)].cpu()
        keep = ~skipped
        if bool(keep.any()):
            advantages[keep] = group_advantages(rewards[keep], scale, batch_rewards=batch_rewards)
        return advantages

    def _source(self, split: str) -> list[int]:
        return self.train_indices if split == "train" else self.val_indices

    def accuracy_of(self, batch: RolloutBatch) -> float | None:
        """Mean correctness of a batch (the ``accuracy_reward`` component, None values ignored), or None."""
        values = batch.reward_components.get(self.accuracy_reward)
        if values is None:
            return None
        present = values[~torch.isnan(values)]
        return float(present.mean()) if present.numel() else None

    def _curriculum_update(self, batch: RolloutBatch) -> None:
        accuracy = self.accuracy_of(batch)
        if accuracy is None:  # no correctness reward: the mean reward, clamped to [0, 1]
            accuracy = float(batch.rewards.float().mean().clamp(0.0, 1.0))
        self.sampler.update(min(max(accuracy, 0.0), 1.0))
        batch.metrics.update(self.sampler.metrics())

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything exact resume needs from the data side: steps built, the prompt sampler / curriculum state,
        the engine's state (rollout counter, which keys every per-sample random stream, and the length
        predictor's state), and the global python / numpy / torch random states (saved from rank 0)."""
        state: dict[str, Any] = {"steps_built": self.steps_built, "rng": _rng_states()}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        elif "sampler" in self._pending_state:
            state["sampler"] = self._pending_state["sampler"]
        if self._engine is not None:
            state["engine"] = self._engine.state_dict()
        elif "engine" in self._pending_state:
            state["engine"] = self._pending_state["engine"]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the prompt stream of a checkpoint (works before or after ``setup``)."""
        self.steps_built = int(state_dict.get("steps_built", 0))
        if "rng" in state_dict:
            _set_rng_states(state_dict["rng"])
        if "sampler" in state_dict:
            if self.sampler is not None:
                self.sampler.load_state_dict(state_dict["sampler"])
            else:
                self._pending_state["sampler"] = state_dict["sampler"]
        if "engine" in state_dict:
            if self._engine is not None:
                self._engine.load_state_dict(state_dict["engine"])
            else:
                self._pending_state["engine"] = state_dict["engine"]

