"""``SamplingConfig``: what the rollout engine needs to know to sample, typed and checked once.

One frozen dataclass serves the engine (``RolloutEngine(model, tokenizer, config)``), the rollout builder and the
YAML (``data.sampling``), so a wrong value fails when the config is built (``Literal`` fields already when the YAML
is parsed), with a message that names the key and what is allowed::

    data:
      sampling:
        group_size: 8            # G, completions per prompt
        micro_group_size: 16     # g, concurrent slots (or "auto": from kv_budget_bytes, or a GPU's free memory)
        strategy: infinite
        max_new_tokens: 256
        scheduler: {preempt_tokens: 8}   # the "infinite" strategy's options (InfiniteSchedulerConfig)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from lit_grpo.runtime.validation import (SEED_MAX, check_choice, check_field, check_int, check_int_in_range,
                                         check_real, real_within, shown_setting)
from lit_grpo.sampling.cpu_linear import CpuLinear
from lit_grpo.sampling.decode_attention import DECODE_KERNELS, DecodeKernel
from lit_grpo.scheduling.config import InfiniteSchedulerConfig, LengthAwareConfig

Strategy = Literal["full", "micro", "continuous", "infinite"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
#: The smallest sampling temperature above 0 (vLLM's sampling epsilon): the logits are divided by it.
MIN_TEMPERATURE = 1e-5
#: The key the fields are named by in a refusal (YAML ``data.sampling.NAME``).
_KEY = "sampling."


@dataclass(frozen=True)
class SamplingConfig:
    """How a rollout samples B prompts x G completions on g slots.

    Attributes:
        group_size: G, completions per prompt (>= 1; training needs >= 2).
        micro_group_size: g, concurrent sequences of "micro", "continuous" and "infinite" (None: G). ``"auto"``:
            the largest g whose worst-case KV cache fits ``kv_budget_bytes``, resolved by the rollout builder from
            the model and the longest prompt (``lit_grpo.sampling.memory_budget``), in the dtype the cache stores
            (the autocast dtype under mixed precision); the engine itself needs an int.
        kv_budget_bytes: the KV-cache byte budget of ``micro_group_size="auto"``. None: on CUDA the device's free
            memory when the first rollout starts, less the rollout weights' copy, the optimizer state (and the
            gradients, which are freed after each optimizer step, under ``keep_kv_cache: true`` only) and a
            margin (``rollout.slot_memory.SlotMemory``); on a CPU "auto" needs it (an error says so).
        strategy: "full" (all B x G rows at once), "micro", "continuous", "infinite" (see RolloutEngine).
        max_new_tokens: the completion length cap.
        temperature: 0 means greedy. top_p in (0, 1]. top_k: 0 disables it. min_p in [0, 1): keep the tokens at
            least min_p times as likely as the most likely one (0 disables it).
        repetition_penalty: transformers' and vLLM's (TRL's ``repetition_penalty``), > 0, 1.0 off: the raw logit of
            every token id already in the sequence (the prompt's and the completion's so far) is divided by it where
            positive and multiplied by it where negative, before the temperature and the filters; above 1 makes
            repeats less likely. The sampling log-probs are those of the penalized distribution. The decode step
            keeps a ``[slots, vocab]`` bool of the ids each row has seen (priced by ``micro_group_size: auto``).
        stop_strings: a sample ends once its completion's text contains one of these (vLLM's ``stop``, transformers'
            ``stop_strings``); it keeps the token that completed the string, and is not truncated. Checked on the host
            after each decode step (``lit_grpo.sampling.stop_strings``); samples with replayed lengths ignore them.
        seed: base of every per-sample random stream.
        scheduler: options of the "infinite" strategy (ignored by the others, which have no options; the
            ``RolloutDataModule`` warns, naming them, when some are set for another strategy).
        cuda_graph: capture the decode step as a CUDA graph and replay it (None: on CUDA, unless the policy is
            FSDP-sharded; a capture that fails then warns and the step runs without a graph, whereas True raises).
            On CPU the same static-shape step runs eagerly.
        compile: compile the decode step with ``torch.compile`` (static shapes; paid once per step shape and
            process, counted in ``capture_s``); on CUDA the compiled step is what the graph captures. ``"auto"``:
            on CUDA with Triton present, unless the policy is FSDP-sharded; off on CPU. True asks for it anywhere
            (where no compiler is present, or the step fails to compile, it warns once and runs the step
            uncompiled). Off by default: each step shape (a new slot count or cache width) is compiled once, which a
            short run may not win back (docs/benchmarks.md).
        cpu_linear: the kernel of the policy's linear layers during a rollout on a CPU: "onednn" (oneDNN's inner
            product, faster than torch's float32 GEMM for the few rows of a decode step), "packed"
            (the same, with each weight reordered at the rollout's start into oneDNN's blocked layout for the
            decode step, a layer's query, key and value weights stacked into one, and its gate and up: faster
            again, for one more copy of the linears' weights held during the rollout), "torch"
            (torch's ``F.linear``), "auto": "packed" for a float32 policy on a CPU whose torch has oneDNN ("onednn"
            where FSDP shards the policy), unless the step is compiled. The update's linears have their own
            setting, ``GRPOModule``'s ``cpu_linear``.
        decode_attention: the decode step's attention kernel, on every device: "matmul" (two matmuls over the
            query heads grouped by key/value head, each KV head read once) or "sdpa_gqa" (experimental: torch's
            SDPA with ``enable_gqa``); ``lit_grpo.sampling.decode_attention``.
        keep_kv_cache: keep the slot cache (and its captured graphs) allocated between training rollouts: no
            re-allocation, no re-capture, but the KV memory stays held through the update. ``"auto"``: on CUDA,
            kept through an update where it fits beside the measured peak of an update at least as wide
            (``rollout.slot_memory.CacheKeeping``); elsewhere released. ``true`` / ``false``: always / never (``true``
            keeps the validation engines' caches too).
    """

    group_size: int = 8
    micro_group_size: int | Literal["auto"] | None = None
    kv_budget_bytes: int | None = None
    strategy: Strategy = "infinite"
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    scheduler: InfiniteSchedulerConfig = field(default_factory=InfiniteSchedulerConfig)
    cuda_graph: bool | None = None
    compile: bool | Literal["auto"] = False
    cpu_linear: CpuLinear = "auto"
    decode_attention: DecodeKernel = "matmul"
    keep_kv_cache: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        check_field(self, "group_size", check_int, 1, prefix=_KEY)
        if isinstance(self.micro_group_size, str) and self.micro_group_size != "auto":
            raise ValueError(f"{shown_setting('sampling.micro_group_size', self.micro_group_size)} must be an "
                             "integer >= 1, 'auto' or None")
        elif self.micro_group_size not in (None, "auto"):
            check_field(self, "micro_group_size", check_int, 1, prefix=_KEY)
        if self.kv_budget_bytes is not None:
            check_field(self, "kv_budget_bytes", check_int, 1, prefix=_KEY)
        check_choice("sampling.strategy", self.strategy, STRATEGIES)
        check_field(self, "max_new_tokens", check_int, 1, prefix=_KEY)
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise ValueError(f"{shown_setting('sampling.cuda_graph', self.cuda_graph)} must be true, false or null "
                             "(on CUDA, unless FSDP shards the policy)")
        if not isinstance(self.keep_kv_cache, bool) and self.keep_kv_cache != "auto":
            raise ValueError(f"{shown_setting('sampling.keep_kv_cache', self.keep_kv_cache)} must be true, false or "
                             "'auto'")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise ValueError(f"{shown_setting('sampling.compile', self.compile)} must be true, false or 'auto'")
        check_choice("sampling.cpu_linear", self.cpu_linear, get_args(CpuLinear))
        check_choice("sampling.decode_attention", self.decode_attention, DECODE_KERNELS)
        check_field(self, "temperature", _check_temperature, prefix=_KEY)
        check_field(self, "top_p", check_real, low=0, high=1, low_open=True, prefix=_KEY)
        check_field(self, "top_k", check_int, 0, hint="0 disables it: vLLM's and verl's -1", prefix=_KEY)
        check_field(self, "min_p", check_real, low=0, high=1, high_open=True, hint="0 disables it", prefix=_KEY)
        check_field(self, "repetition_penalty", check_real, low=0, low_open=True, prefix=_KEY,
                    hint="1.0 disables it; above 1 penalizes the tokens already in the sequence")
        if isinstance(self.stop_strings, (str, bytes)) or not isinstance(self.stop_strings, (list, tuple)) or \
                not all(isinstance(s, str) and s for s in self.stop_strings):
            shown = list(self.stop_strings) if isinstance(self.stop_strings, tuple) else self.stop_strings
            raise ValueError(f"{shown_setting('sampling.stop_strings', shown, 200)} must be a list of non-empty "
                             "strings")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))  # a YAML or Python list: hashable
        check_field(self, "seed", check_int_in_range, 0, SEED_MAX, prefix=_KEY)
        if isinstance(self.scheduler, dict):  # a plain mapping (Python callers): typed here
            object.__setattr__(self, "scheduler", InfiniteSchedulerConfig.from_options(self.scheduler))
        if not isinstance(self.scheduler, InfiniteSchedulerConfig):
            raise ValueError(f"{shown_setting('sampling.scheduler', self.scheduler)} must be an "
                             "InfiniteSchedulerConfig or a dict of its fields")

    def ignored_scheduler_options(self) -> list[str]:
        """The ``scheduler`` options set away from their defaults that this strategy ignores (all of them, unless
        it is "infinite")."""
        if self.strategy == "infinite":
            return []
        default = InfiniteSchedulerConfig()
        return [f.name for f in fields(InfiniteSchedulerConfig)
                if getattr(self.scheduler, f.name) != getattr(default, f.name)]

    def replace(self, **changes: Any) -> SamplingConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, base: SamplingConfig | None = None, **kwargs: Any) -> SamplingConfig:
        """``base`` (or the defaults) with sampling fields and "infinite" scheduler options given flat, as
        ``RolloutEngine(model, tokenizer, group_size=32, preempt_tokens=16)`` does; the length-aware method's
        fields given flat (``predictor="oracle"``, ``refill="sjf"``) turn it on.

        Raises:
            ValueError: scheduler options for a strategy other than "infinite".
            TypeError: an unknown keyword.
        """
        if base is not None and not kwargs:
            return base
        own = {f.name for f in fields(cls)}
        scheduler_fields = {f.name for f in fields(InfiniteSchedulerConfig)}
        length_aware_fields = {f.name for f in fields(LengthAwareConfig)}
        unknown = sorted(set(kwargs) - own - scheduler_fields - length_aware_fields)
        if unknown:
            raise TypeError(f"unknown sampling options {unknown}; allowed: {sorted(own)}, the scheduler's "
                            f"{sorted(scheduler_fields)} and the length-aware method's {sorted(length_aware_fields)}")
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in scheduler_fields and k not in own}
        length_aware = {k: kwargs.pop(k) for k in list(kwargs) if k in length_aware_fields}
        config = dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
        if options or length_aware:
            if config.strategy != "infinite":
                raise ValueError(f"options {sorted({**options, **length_aware})} only apply to strategy='infinite', "
                                 f"not {config.strategy!r}")
            if length_aware:
                current = config.scheduler.length_aware or LengthAwareConfig()
                options["length_aware"] = dataclasses.replace(current, **length_aware)
            config = config.replace(scheduler=config.scheduler.replace(**options))
        return config


def _check_temperature(name: str, value: Any) -> float:
    """``value`` as a plain float if it is 0 (greedy) or a finite number >= ``MIN_TEMPERATURE``, else a ValueError."""
    number = real_within(value, low=0)
    if number is None or 0 < number < MIN_TEMPERATURE:
        raise ValueError(f"{shown_setting(name, value)} must be 0 (greedy) or a finite number >= "
                         f"{MIN_TEMPERATURE:g} (below it the logits divided by it overflow)")
    return number
