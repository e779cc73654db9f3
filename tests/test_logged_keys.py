"""Every callback logs exactly the keys its docstring lists, and docs/training.md's table lists the same keys.

Each callback runs alone on hand-built lit_grpo rollouts whose stats carry every optional figure (a length
predictor, counted bytes, scheduling decisions, preemption), so every key it can log on this machine is logged;
what it logged (scalars through any logger, images, histograms and text through TensorBoard) is compared with the
keys named in its docstring's **Logged keys** section.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import lightning.pytorch as pl
from callback_helpers import RolloutModule, events, make_rollout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from lit_grpo import callbacks
from lit_grpo.scheduling.base import Decision

ROOT = Path(__file__).resolve().parents[1]
#: A logged key: slash-separated words, ``<placeholder>`` allowed (no spaces, no operators: not a formula).
KEY = re.compile(r"^[A-Za-z0-9_<>]+(/[A-Za-z0-9_<>]+)+$")
#: Keys a docstring lists for CUDA alone; this machine has none.
CUDA_ONLY = re.compile(r"^memory/\w+_peak_reserved_bytes$")
#: What a docstring says of a callback that logs nothing.
LOGS_NOTHING = re.compile(r"\bLogs (no keys|nothing)\b")


class RecordingLogger(Logger):
    """Every scalar key written to a logger, and each write's (key, step)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()
        self.writes: list[tuple[str, int | None]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.keys.update(metrics)
        self.writes += [(key, step) for key in metrics]

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def expand(text: str) -> set[str]:
    """The keys a backticked name stands for: ``a/{b, c}_d`` -> ``{a/b_d, a/c_d}``; not a key -> empty."""
    match = re.search(r"\{([^{}]*)\}", text)
    if match is None:
        return {text} if KEY.match(text) else set()
    return set().union(*(expand(text[:match.start()] + part.strip() + text[match.end():])
                         for part in match.group(1).split(",")))


def listed_keys(text: str) -> set[str]:
    """The keys named in double or single backticks in ``text``."""
    names = re.findall(r"``([^`]+)``", text) or re.findall(r"`([^`]+)`", text)
    return set().union(set(), *(expand(name) for name in names))


def docstring_keys(callback_type: type) -> set[str] | None:
    """The keys of a callback docstring's **Logged keys** section (to the next bold heading or ``Args:``); None
    where it has none."""
    doc = callback_type.__doc__ or ""
    start = doc.find("**Logged keys**")
    if start < 0:
        return None
    rest = doc[start + len("**Logged keys**"):]
    end = min([i for i in (rest.find("\n    **"), rest.find("\n    Args:")) if i >= 0], default=len(rest))
    return listed_keys(rest[:end])


def docs_table_keys() -> dict[str, set[str]]:
    """docs/training.md's table of callbacks: each row's callback name -> the keys its cell names (none where the
    cell starts with "nothing" or "the bar only": the names there are paths and settings)."""
    rows = {}
    for line in (ROOT / "docs" / "training.md").read_text().splitlines():
        match = re.match(r"^\| `(\w+)` \| (.*) \|$", line)
        if match:
            cell = match.group(2)
            rows[match.group(1)] = set() if cell.startswith(("nothing", "the bar only")) else listed_keys(cell)
    return rows


def matches(key: str, listed: set[str]) -> bool:
    """Whether ``key`` is one of ``listed``, a ``<placeholder>`` standing for one name."""
    return any(re.fullmatch(re.sub(r"<\w+>", r"\\w+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">")), key)
               for name in listed)


def full_rollout(seed: int):
    """A rollout whose stats carry every optional figure."""
    rollout = make_rollout(seed)
    rollout.stats.preempting = 1.0
    rollout.stats.parked_samples, rollout.stats.parked_kv_bytes = 2, 300
    rollout.stats.decisions = [Decision(1, 0, (0, 0), "park", "preemption"), Decision(2, 0, (0, 0), "resume",
                                                                                       "least_attained")]
    return rollout


class ExportableModule(RolloutModule):
    """A rollout module holding a policy and a tokenizer, as ExportModel asks."""

    def __init__(self, rollouts) -> None:
        super().__init__(rollouts)
        from lit_grpo.runtime.models import load_model_and_tokenizer

        self.policy, self.tokenizer = load_model_and_tokenizer("tiny-llama")
        self.policy.requires_grad_(False)


def logged_keys(tmp_path: Path, callback, module: pl.LightningModule) -> set[str]:
    """Every key a fit of ``module`` with ``callback`` alone logs beyond what the module logs without it."""
    def run(folder: Path, extra: list) -> set[str]:
        recording = RecordingLogger()
        trainer = pl.Trainer(
            default_root_dir=folder, max_steps=len(module.rollouts), callbacks=extra, accelerator="cpu",
            logger=[TensorBoardLogger(folder, name="tb"), recording], log_every_n_steps=1,
            enable_checkpointing=isinstance(callback, pl.callbacks.ModelCheckpoint),
            enable_progress_bar=isinstance(callback, pl.callbacks.ProgressBar), enable_model_summary=False)
        trainer.fit(module)
        tags = events(trainer).Tags()
        written = {tag.removesuffix("/text_summary") for kind in ("images", "histograms", "tensors")
                   for tag in tags[kind]}
        return recording.keys | set(tags["scalars"]) | written

    return run(tmp_path / "with", [callback]) - run(tmp_path / "without", [])


CALLBACKS = [
    pytest.param(lambda: callbacks.PeakMemoryMonitor(), id="PeakMemoryMonitor"),
    pytest.param(lambda: callbacks.RolloutProfiler(read_bytes_per_s=1e9), id="RolloutProfiler"),
    pytest.param(lambda: callbacks.CompletionLogger(table_every_n_steps=1), id="CompletionLogger"),
    pytest.param(lambda: callbacks.SlotTimelineLogger(every_n_steps=1), id="SlotTimelineLogger"),
    pytest.param(lambda: callbacks.RewardForecast(min_points=5, check_every_n_steps=1), id="RewardForecast"),
    pytest.param(lambda: callbacks.FitSummary(), id="FitSummary"),
    pytest.param(lambda: callbacks.RunCheckpoint(every_n_train_steps=1), id="RunCheckpoint"),
    pytest.param(lambda: callbacks.GRPOProgressBar(), id="GRPOProgressBar"),
    pytest.param(lambda: callbacks.RankFailureWatch(), id="RankFailureWatch"),
    pytest.param(lambda: callbacks.ExportModel(), id="ExportModel"),
]


@pytest.mark.parametrize("make", CALLBACKS)
def test_a_callback_logs_the_keys_its_docstring_lists(tmp_path, make):
    callback = make()
    rollouts = [full_rollout(seed) for seed in range(6)]  # RewardForecast fits from its fifth point on
    module = ExportableModule(rollouts) if isinstance(callback, callbacks.ExportModel) else RolloutModule(rollouts)
    logged = logged_keys(tmp_path, callback, module)
    listed = docstring_keys(type(callback))
    if listed is None:
        assert LOGS_NOTHING.search(type(callback).__doc__), f"{type(callback).__name__}: no Logged keys section"
        assert logged == set()
        return
    assert listed, f"{type(callback).__name__}: its Logged keys section names no key"
    assert {key for key in logged if not matches(key, listed)} == set()  # logged, not listed
    expected = {key for key in listed if not CUDA_ONLY.match(key)}
    assert {name for name in expected if not any(matches(key, {name}) for key in logged)} == set()  # listed, not logged


@pytest.mark.parametrize("name", callbacks.__all__)
def test_the_docs_table_lists_each_callbacks_keys(name):
    callback_type = getattr(callbacks, name)
    if not isinstance(callback_type, type) or not issubclass(callback_type, Callback):
        return
    table = docs_table_keys()
    assert name in table, f"docs/training.md's callback table has no row for {name}"
    assert table[name] == (docstring_keys(callback_type) or set())


def test_the_key_reader_reads_braces_and_leaves_formulas_out():
    assert expand("memory/{rollout,update}_peak_bytes") == {"memory/rollout_peak_bytes", "memory/update_peak_bytes"}
    assert expand("a/{b, c}/{d,e}") == {"a/b/d", "a/b/e", "a/c/d", "a/c/e"}
    assert expand("generated_tokens / (decode_steps * slots)") == set()
    assert matches("rollout/decisions/park_preemption", {"rollout/decisions/<action>_<reason>"})
    assert not matches("rollout/decisions", {"rollout/decisions/<action>_<reason>"})


def module_docstring_keys(prefix: str) -> set[str]:
    """The keys starting with ``prefix`` that lit_grpo.update.module's docstring names (as prose, not backticked:
    ``val/{accuracy, reward}``)."""
    from lit_grpo.update import module

    names = re.findall(rf"{re.escape(prefix)}(?:\{{[^{{}}]*\}}|[\w<>/])+", module.__doc__)
    return {key for name in names for key in expand(name.rstrip("/")) if key.startswith(prefix)}


def test_grpomodules_validation_keys_are_those_its_docstring_and_the_docs_table_name(tmp_path):
    """What a validation logs (greedy and sampled, with a reward function's ``log_metric``) is what
    GRPOModule's row of docs/training.md's table and lit_grpo.update.module's docstring list under val/."""
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    def judged(prompts, completions, log_metric, **columns):
        log_metric("judge", 1.0)
        return [1.0] * len(completions)

    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    data = RolloutDataModule(prompts=prompts, val_size=2, prompts_per_step=2, val_num_samples=2,
                             reward_funcs=[judged, "accuracy"], sampling={"group_size": 2, "max_new_tokens": 2})
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path, enable_model_summary=False)
    trainer.validate(GRPOModule(model="tiny-llama"), datamodule=data)
    logged = {key for key in trainer.callback_metrics if key.startswith("val/")}
    (row,) = [line for line in (ROOT / "docs" / "training.md").read_text().splitlines()
              if line.startswith("| `GRPOModule` itself")]
    table = {key for key in listed_keys(row.split(" | ")[1]) if key.startswith("val/")}
    assert table == module_docstring_keys("val/")
    assert {key for key in logged if not matches(key, table)} == set()  # logged, not listed
    assert {name for name in table if not any(matches(key, {name}) for key in logged)} == set()  # listed, not logged


#: The callbacks that log at training steps, each logging every key it can at every step.
STEP_LOGGERS = CALLBACKS[:5]


@pytest.mark.parametrize("make", STEP_LOGGERS)
def test_under_gradient_accumulation_a_callback_writes_each_key_once_an_optimizer_step(tmp_path, make):
    """accumulate_grad_batches=2 on rollout batches (a module of its own: GRPOModule refuses accumulation): every
    scalar, image, histogram and text is written once per optimizer step, never once per micro-batch at the same
    step; the callback's keys at every step (RewardForecast's from its fifth point on)."""
    callback = make()
    recording = RecordingLogger()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=6, accumulate_grad_batches=2, callbacks=[callback],
                         accelerator="cpu", logger=[TensorBoardLogger(tmp_path, name="tb"), recording],
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(RolloutModule([full_rollout(seed) for seed in range(12)]))
    accumulator = events(trainer)
    tags = accumulator.Tags()
    writes = recording.writes + [(tag, event.step) for kind, read in (("images", accumulator.Images),
                                                                      ("histograms", accumulator.Histograms),
                                                                      ("tensors", accumulator.Tensors))
                                 for tag in tags[kind] for event in read(tag)]
    assert trainer.global_step == 6
    assert {write: count for write, count in Counter(writes).items() if count > 1} == {}
    listed = docstring_keys(type(callback))
    own_steps = {step for key, step in writes if matches(key.removesuffix("/text_summary"), listed)}
    # RewardForecast forecasts from its fifth point on
    assert own_steps == set(range(4 if isinstance(callback, callbacks.RewardForecast) else 0, 6))


def test_every_key_a_training_step_logs_is_named_by_grpomodules_docstring_and_the_docs_table():
    """``STEP_REDUCTIONS`` holds every key GRPOModule's training step logs (each must have its rule over ranks):
    each is in GRPOModule's row of docs/training.md's table, and each of its names in the module docstring."""
    from lit_grpo.rollout.metrics import STEP_REDUCTIONS
    from lit_grpo.update import module

    (row,) = [line for line in (ROOT / "docs" / "training.md").read_text().splitlines()
              if line.startswith("| `GRPOModule` itself")]
    table = listed_keys(row.split(" | ")[1])
    assert [key for key in STEP_REDUCTIONS if not matches(key, table)] == []
    words = set(re.findall(r"[\w]+", module.__doc__))
    assert [key for key in STEP_REDUCTIONS if not set(key.split("/")) <= words] == []
