"""``ExportModel``: the trained policy as a transformers model directory when ``fit`` ends."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_grpo.export import ExportResult, check_dtype, export_policy
from lit_grpo.runtime.checkpoints import check_writable
from lit_grpo.runtime.validation import ConfigError, check_bool, check_folder

from ._paths import shown_path


class ExportModel(Callback):
    r"""Writes the policy (``pl_module.policy``, as ``GRPOModule`` and modules like it hold one) and its tokenizer
    with :func:`lit_grpo.export.export_policy` when training ends, and prints where, after the fit summary::

          model          lightning_logs/version_0/model (transformers model, float32, 513.2 MiB, 2.1 s)
                         -> AutoModelForCausalLM.from_pretrained("lightning_logs/version_0/model")

    The same directory ``lit-grpo export --ckpt_path last.ckpt --out DIR`` writes, its EOS ids those the rollouts
    stopped on (with ``data.tools``, the chat template's end-of-turn token too: ``tool_stop_token_ids``). Only rank 0
    writes. A module without a ``policy`` and a ``tokenizer`` is refused when ``fit`` starts, before any step, naming
    what it lacks. Logs no keys.

    Args:
        dirpath: the directory to write; default ``model/`` in the run's log folder (``version_N/model``), so each
            run keeps its own. Existing model files in it are replaced (a resumed run exports again).
        dtype: one of ``lit_grpo.export.EXPORT_DTYPES`` ("auto": the training dtype).
        adapter_only: a LoRA run: the adapter alone instead of the merged model.
    """

    def __init__(self, dirpath: str | None = None, dtype: str = "auto", adapter_only: bool = False) -> None:
        self.dirpath = check_folder("dirpath", dirpath, "model/ in the run's log folder")
        self.dtype = check_dtype(dtype)
        self.adapter_only = check_bool("adapter_only", adapter_only)
        self.result: ExportResult | None = None

    def _out(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "model"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.result = None  # a fit that ends before exporting reports no earlier fit's export
        missing = [name for name in ("policy", "tokenizer") if not hasattr(pl_module, name)]
        if stage == "fit" and missing:  # checked before training, not found missing after it
            raise ValueError(f"ExportModel exports a module's policy and tokenizer (as GRPOModule holds them); "
                             f"{type(pl_module).__name__} has no {' or '.join(missing)}")
        if stage == "fit" and getattr(getattr(pl_module, "hparams", None), "fsdp", False):
            raise ValueError("ExportModel cannot gather an FSDP-sharded policy; remove the callback and export the "
                             "run's checkpoint with lit-grpo export --ckpt_path CKPT --out DIR")
        if stage == "fit" and self.adapter_only and not getattr(pl_module.hparams, "peft_config", None):
            raise ValueError("ExportModel(adapter_only=True) needs a LoRA run (model.peft_config); this run has none")
        if stage == "fit" and self.dirpath is not None:  # found before training, not after it
            try:
                check_writable(self.dirpath, what="ExportModel dirpath", fix="give it a writable folder")
            except OSError as error:
                raise ConfigError(str(error)) from None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the last step (and the last validation), while the policy is still on the module. The folder is
        # resolved on every rank: trainer.log_dir broadcasts from rank 0, a collective they all join.
        out = self._out(trainer)
        if trainer.is_global_zero:
            stops = tool_stop_token_ids(getattr(trainer, "datamodule", None), pl_module.policy)
            self.result = export_policy(pl_module.policy, pl_module.tokenizer, out, dtype=self.dtype,
                                        adapter_only=self.adapter_only, overwrite=True, extra_eos_token_ids=stops)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # teardown runs after every on_fit_end, so the line lands under FitSummary's summary.
        if stage == "fit" and self.result is not None and trainer.is_global_zero:
            print(export_lines(self.result), flush=True)


def tool_stop_token_ids(datamodule: object, policy: object) -> list[int]:
    """The ids the fit's rollouts stopped on beside the EOS ids: its tools' (``ToolBox.stop_token_ids``, the
    template's end of turn) where the data module's rollout builder runs tools, else none."""
    tools = getattr(getattr(datamodule, "builder", None), "tools", None)
    return tools.stop_token_ids(policy) if tools is not None else []


def export_lines(result: ExportResult) -> str:
    """The summary's lines for an export."""
    shown = shown_path(result.out)
    how = ("PeftModel.from_pretrained(base_model, " if result.adapter_only
           else "AutoModelForCausalLM.from_pretrained(") + f"{shown!r})"
    return f"  {'model':<14} {result.describe().replace(str(result.out), shown, 1)}\n  {'':<14} -> {how}"
