"""The two sides of ``tools.compare_trl``, each in its own process, writing one JSON line per GRPO step.

lit_grpo's side is the real ``lit-grpo fit`` with a generated config (``tools.compare_trl_spec.lit_config``),
whose ``StepRecorder`` callback writes the records. TRL's side is

    python -m tools.compare_trl_runs trl --spec SPEC.json --out RECORDS.jsonl

run by the interpreter of the environment that holds TRL (``--trl-python``): TRL's ``GRPOTrainer`` with ``GRPOConfig``
(``tools.compare_trl_spec.trl_config``), lit_grpo's model loader, prompts in lit_grpo's order and lit_grpo's
reward functions. TRL's code is run, never copied: a subclass times two of its methods around ``super()``.

The records file holds JSON lines: ``{"event": "start", ...}`` (versions, threads, checks), one
``{"event": "step", ...}`` per GRPO step, ``{"event": "end", ...}``; lit_grpo's also one ``{"event": "rollout",
"step", ...}`` per step once its rollout is over (the step's fields known by then, the CUDA peak so far). A step
record:

- ``step`` (1-based), ``start`` and ``end`` (``time.time()``): the step runs from the end of the previous step
  (the first: the start of training) to the end of its optimizer step, on both sides;
- ``step_s``: ``end - start``;
- ``rollout_s``: lit_grpo, from the step's start to ``on_train_batch_start``: the batch fetch, in which
  ``RolloutDataModule`` draws the prompts, generates (the engine), decodes, scores and computes advantages.
  TRL, the time in ``_generate_and_score_completions``: tokenizing the prompts, generating, decoding, scoring,
  advantages (no old log-probs: generation and optimizer steps are aligned);
- ``generate_s``: the generation alone: lit_grpo, the engine's ``RolloutStats.wall_s`` (prefill, decode, slot
  scheduling); TRL, the time in ``_generate`` (prompt tokenization, ``generate``, decoding to text);
- ``update_s``: ``step_s - rollout_s``: the micro-batched forward and backward passes, clipping, the optimizer
  step, and each side's per-step bookkeeping;
- ``reward_mean``: the mean total reward of the step's B x G completions; ``completion_tokens``: their tokens;
- ``prompts``: the step's prompts, as their indices in lit_grpo's prompt list (to check both saw the same);
- ``cuda_peak_bytes`` (CUDA only): ``torch.cuda.max_memory_allocated`` over the step (reset at its start);
- lit_grpo only, its engine's rollout (``RolloutStats``): ``slots`` (its ``num_slots``) and, as
  ``RolloutProfiler`` logs them under ``rollout/``, ``decode_steps``, ``ms_per_step``, ``decode_ms_per_step``,
  ``floor_ms_per_step`` and ``roofline_ratio`` (the decode step against the bytes it read at the device's read
  bandwidth, measured before the first step and given in the start record as ``read_bytes_per_s``),
  ``tokens_per_s``, ``capture_s``, ``peak_kv_bytes``: a run stopped at its deadline keeps them, where the fit
  summary's would be lost.

CPU memory is not measured here: the parent samples this process's RSS from outside (``tools.process_memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepLog:
    """Writes a run's records (module docstring), one JSON line each, flushed at once: a run killed at its
    deadline keeps the steps it finished."""

    def __init__(self, out: Path | str, cuda: bool) -> None:
        self.path = Path(out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cuda = cuda
        self.step = 0
        self._start: float | None = None
        self._fields: dict[str, Any] = {}

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def begin(self, **info: Any) -> None:
        """Training starts: the first step's window opens."""
        import torch

        self.write({"event": "start", "pid": os.getpid(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), **info})
        self._open()

    def _open(self) -> None:
        self._start = time.time()
        self._fields = {}
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def add(self, **fields: Any) -> None:
        """Figures of the current step, as they are known (times added up when given twice)."""
        for key, value in fields.items():
            if key.endswith("_s") and key in self._fields:
                value += self._fields[key]
            self._fields[key] = value

    def rollout_done(self, **fields: Any) -> None:
        """The step's rollout is over: its figures so far, also written as a ``rollout`` record (the CUDA peak
        so far included), so a run stopped during the update keeps what its rollout measured."""
        self.add(rollout_s=time.time() - self._start, **fields)
        record = {"event": "rollout", "step": self.step + 1, **self._fields}
        if self.cuda:
            import torch

            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        self.write(record)

    def end(self, **fields: Any) -> None:
        """The step's optimizer step is done: write its record and open the next step's window."""
        if self.cuda:  # the step ends when its queued kernels (the optimizer's) have run
            import torch

            torch.cuda.synchronize()
        end = time.time()
        self.add(**fields)
        self.step += 1
        record = {"event": "step", "step": self.step, "start": self._start, "end": end,
                  "step_s": end - self._start, **self._fields}
        if "rollout_s" in record:
            record["update_s"] = record["step_s"] - record["rollout_s"]
        if self.cuda:
            record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        self.write(record)
        self._open()

    def finish(self, **info: Any) -> None:
        self.write({"event": "end", "steps": self.step, "vm_hwm_bytes": _own_status("VmHWM"), **info})


def _own_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------------------ lit_grpo
class StepRecorder(Callback):
    """The step records of a ``lit-grpo fit`` run (module docstring), for ``tools.compare_trl``.

    Args:
        out: the JSON-lines file to append the records to.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.log: StepLog | None = None
        self.read_bytes_per_s: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        import lightning
        import transformers

        from lit_grpo.sampling.roofline import read_bandwidth

        # measured once per process (the fit summary's floor reads the same), before the first step's window
        self.read_bytes_per_s = read_bandwidth(trainer.strategy.root_device)
        self.log = StepLog(self.out, cuda=trainer.strategy.root_device.type == "cuda")
        self.log.begin(system="lit_grpo", lightning=lightning.__version__, transformers=transformers.__version__,
                       read_bytes_per_s=self.read_bytes_per_s)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.log.rollout_done(generate_s=float(batch.stats.wall_s), **engine_figures(batch.stats,
                                                                                       self.read_bytes_per_s))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.log.end(reward_mean=float(batch.rewards.float().mean()),
                     completion_tokens=int(batch.completion_lengths.sum()), prompts=[int(i) for i in batch.indices])

    def on_train_end(self, trainer, pl_module) -> None:
        self.log.finish()


def engine_figures(stats, read_bytes_per_s: float) -> dict[str, Any]:
    """A rollout's engine figures of a step record (module docstring), from its ``RolloutStats``."""
    from lit_grpo.callbacks.rollout_profiler import profile

    names = ("decode_steps", "ms_per_step", "decode_ms_per_step", "floor_ms_per_step", "roofline_ratio",
             "tokens_per_s", "capture_s", "peak_kv_bytes")
    values = profile(stats, read_bytes_per_s)
    return {"slots": stats.num_slots, **{name: values.get(f"rollout/{name}") for name in names}}


# ------------------------------------------------------------------------------------------------ TRL
def lit_prompt_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompts lit_grpo trains on for ``spec``'s steps, in its order, as TRL dataset rows: ``prompt`` (the
    chat: the system prompt and the user message), ``answer``, ``entry_json`` (the reasoning-gym entry, for the
    reward) and ``index`` (the prompt's index in lit_grpo's prompt list, as ``RolloutBatch.indices`` has it). The
    RolloutDataModule is the one the lit_grpo run builds from the same config, so its prompt sampler draws the same
    prompts."""
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from tools.compare_trl_spec import lit_config

    data = RolloutDataModule(**lit_config(spec, os.devnull)["data"])
    data.setup("fit")
    system = data.system_prompt
    rows = []
    for _ in range(spec["steps"]):
        for position in data.sampler.draw(spec["prompts_per_step"]):
            index = data.train_indices[position]
            example = data.examples[index]
            if example.messages:
                raise ValueError("chat-history prompts are not supported by the comparison")
            text = data.prompt_template.replace("{prompt}", example.prompt)  # as render_prompt: other braces kept
            chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            rows.append({"prompt": chat, "answer": example.answer, "index": index,
                         "entry_json": json.dumps(example.entry, default=str)})
    return rows


def trl_reward_funcs(spec: dict[str, Any], eos_token_ids: set[int], step_log: StepLog) -> list:
    """lit_grpo's reward functions of ``spec``, each wrapped into TRL's reward-function signature."""
    from lit_grpo.rollout.prompts import message_text
    from lit_grpo.rollout.rewards import build_reward_funcs

    def wrap(reward):
        def reward_func(prompts, completions, completion_ids, answer=None, entry_json=None, index=None,
                        **kwargs):
            texts, questions = list(map(message_text, completions)), list(map(message_text, prompts))
            lengths = [len(ids) for ids in completion_ids]
            columns = {"answer": answer, "entry": [json.loads(e) for e in entry_json],
                       "completion_ids": completion_ids, "completion_length": lengths,
                       "truncated": [n >= spec["max_new_tokens"] and (not ids or ids[-1] not in eos_token_ids)
                                     for n, ids in zip(lengths, completion_ids)],
                       "max_new_tokens": [spec["max_new_tokens"]] * len(texts)}
            step_log.add(prompts=list(dict.fromkeys(index)))  # one per group, in order
            # TRL's own keywords (trainer_state, log_metric, log_extra) go on, and the function is called its way
            passed = {key: kwargs[key] for key in ("trainer_state", "log_metric", "log_extra") if key in kwargs}
            return list(reward.call(questions, texts, **columns, **passed))

        reward_func.__name__ = reward.name
        return reward_func

    return [wrap(reward) for reward in build_reward_funcs(spec["data"].get("reward_funcs"))]


def lit_optimizer(model, spec: dict[str, Any]):
    """lit_grpo's optimizer and learning-rate schedule (``GRPOModule.configure_optimizers``) for TRL's model: AdamW
    fused where lit_grpo's is (weights on a GPU; no loss scaler in either side's precisions), its weight decay
    grouped as both sides group it (``weight_decay_groups``, the Trainer's rule)."""
    import torch

    from lit_grpo.update.lr_schedule import lr_lambda
    from lit_grpo.update.module import fused_adamw, weight_decay_groups

    groups = weight_decay_groups(model, spec["weight_decay"])
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=spec["lr"], weight_decay=spec["weight_decay"],
                                  betas=tuple(spec["betas"]), fused=fused_adamw(params) or None)
    schedule = lr_lambda(spec["lr_schedule"], spec["lr_warmup_steps"], spec["steps"] * spec["num_iterations"],
                         spec.get("min_lr_ratio", 0.0))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def run_trl(spec: dict[str, Any], out: Path) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_grpo.rollout.prompts import render_prompt
    from lit_grpo.runtime.models import load_model_and_tokenizer
    from tools.compare_trl_spec import trl_config

    log = StepLog(out, cuda=spec["device"] == "cuda")

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer; two of its methods timed around ``super()``, which does all the work."""

        def _generate_and_score_completions(self, inputs):
            start = time.time()
            output = super()._generate_and_score_completions(inputs)
            metrics = self._metrics["train"]
            log.add(rollout_s=time.time() - start, reward_mean=float(metrics["reward"][-1]),
                    completion_tokens=round(metrics["completions/mean_length"][-1] * len(inputs)))
            return output

        def _generate(self, prompts):
            start = time.time()
            output = super()._generate(prompts)
            log.add(generate_s=time.time() - start)
            return output

    class StepEnds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            log.begin(system="trl", trl=trl.__version__, transformers=transformers.__version__,
                      prompt_ids_match=prompt_ids_match)

        def on_step_end(self, args, state, control, **kwargs):
            log.end()

    # on the run's device, as lit_grpo's configure_model builds its own: a random model's weights are drawn by the
    # generator of the device it is built on, so both sides start from the same ones
    model, tokenizer = load_model_and_tokenizer(spec["model"], dtype=spec["dtype"], device=spec["device"])
    rows = lit_prompt_rows(spec)
    eos = {tokenizer.eos_token_id, *([model.generation_config.eos_token_id]
                                     if isinstance(model.generation_config.eos_token_id, int)
                                     else model.generation_config.eos_token_id or [])}
    config = GRPOConfig(**trl_config(spec, out.parent / f"{out.stem}_trl_output"))
    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, args=config,
                               reward_funcs=trl_reward_funcs(spec, eos, log),
                               train_dataset=Dataset.from_list(rows), optimizers=lit_optimizer(model, spec),
                               callbacks=[StepEnds()])
    # TRL's own rendering of the first prompt against lit_grpo's (the same tokens, or the comparison is off)
    trl_ids = trainer._tokenize_prompts([rows[0]["prompt"]])[0][0]
    user, system = rows[0]["prompt"][-1]["content"], spec["data"].get("system_prompt")
    prompt_ids_match = list(trl_ids) == render_prompt(tokenizer, user, system)
    trainer.train()
    log.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One side of tools.compare_trl (TRL's); see the docstring.")
    parser.add_argument("side", choices=["trl"])
    parser.add_argument("--spec", type=Path, required=True, help="the run's spec (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines records file")
    args = parser.parse_args(argv)
    run_trl(json.loads(args.spec.read_text()), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
