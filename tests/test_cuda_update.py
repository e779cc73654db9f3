"""The update and the end of fit on a GPU (needs a CUDA device): what a CPU run cannot show.

On a CPU the same code runs in every other update test; here: AdamW runs fused, the update waits on the device a
few times a step however many micro-batches it has (torch's sync debug mode counts the waits), and the policy and
its optimizer state are still on the GPU when ``fit`` returns; ``keep_kv_cache: auto`` keeps a small model's cache
from its second rollout on, decided from the first update's measured peak; under bf16-mixed the rollout decodes with
weights cast once, and the fit path reports its decode step against its floor and the device's memory peaks.
"""

import csv
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning.pytorch.loggers import CSVLogger

import lit_grpo
from lit_grpo.callbacks import FitSummary, PeakMemoryMonitor, RolloutProfiler
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.runtime.distributed import CastWeights
from lit_grpo.sampling.roofline import read_bandwidth
from lit_grpo.update.module import GRPOModule

from datamodule_helpers import datamodule_arguments

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fit(max_steps=1, **module_arguments):
    pl.seed_everything(0)
    module = GRPOModule(**{"model": "tiny-llama", "lr": 1e-3, **module_arguments})
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = RolloutDataModule(**datamodule_arguments({"val_size": 0}))
    trainer.fit(module, data)
    return module, trainer, data


def test_adamw_runs_fused_and_the_policy_stays_on_the_gpu_after_fit():
    module, trainer, _ = _fit()
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["fused"]
    assert {p.device.type for p in module.policy.parameters()} == {"cuda"}
    moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert moments and {t.device.type for t in moments} == {"cuda"}


def test_auto_keeps_the_slot_cache_once_an_update_has_shown_it_fits():
    held = []

    class Held(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            held.append(trainer.datamodule.builder.engine.slot_cache_bytes())

    pl.seed_everything(0)
    module = GRPOModule(model="tiny-llama", lr=1e-3)
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Held()])
    data = RolloutDataModule(**datamodule_arguments({"val_size": 0}))
    trainer.fit(module, data)
    assert module.measured_update_peak() > 0
    assert held[0] == 0  # no update measured before the first: released
    decided = data.builder.slot_memory.cache_keeping
    assert decided is not None and decided.kept_bytes > 0, decided
    # kept through an update once one at least as wide has been measured (a wider batch releases and measures)
    assert any(held[1:]) or "wider" in decided.describe(), (held, decided)
    assert data.builder.engine.slot_cache_bytes() == 0  # freed when fit ended


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_the_update_waits_on_the_gpu_a_few_times_a_step_however_many_micro_batches(shared_prefix):
    """Waits from lit_grpo's own lines (transformers' mask checks wait too, once per forward: theirs), told apart
    by the package's folders (its callbacks and datamodules are installed from folders of their own), not by a name
    a checkout's own path may hold."""
    folders = tuple(os.path.realpath(path) + os.sep for package in (lit_grpo, lit_grpo.callbacks, lit_grpo.datamodules)
                    for path in package.__path__)
    module, trainer, data = _fit(shared_prefix=shared_prefix)
    batch = data.build_train_batch().to("cuda")
    waits = {}
    for size in (1, 4):
        module.hparams.train_micro_batch_size = size
        fresh = batch.to("cuda")
        optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.grpo_step(fresh, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits[size] = [f"{w.filename}:{w.lineno}" for w in caught
                       if "synchroniz" in str(w.message) and os.path.realpath(w.filename).startswith(folders)]
    assert len(waits[1]) == len(waits[4]) <= 6, waits


def test_a_mixed_precision_fit_reports_its_decode_steps_against_their_floor(tmp_path):
    pl.seed_everything(0)
    module = GRPOModule(model="tiny-llama", lr=1e-3)
    summary = FitSummary(validate_before_training=False)
    # Lightning's CSV logger: a CUDA image may lack tensorboard, which a TensorBoardLogger and its reader need
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=3, precision="bf16-mixed", log_every_n_steps=1,
                         logger=CSVLogger(tmp_path, name="csv"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[RolloutProfiler(progress_bar=False), PeakMemoryMonitor(), summary])
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0})))
    assert isinstance(module.rollout_weights(), CastWeights)  # float32 master weights, decoded in bf16
    assert 1e11 < read_bandwidth(trainer.strategy.root_device) < 2e13  # bytes/s of a GPU's memory
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv"), newline="") as file:
        rows = list(csv.DictReader(file))

    def logged(key: str) -> list[float]:
        return [float(row[key]) for row in rows if row.get(key)]

    floors, ratios, ms = (logged(f"rollout/{key}") for key in ("floor_ms_per_step", "roofline_ratio", "ms_per_step"))
    assert len(floors) == 3 and all(f > 0 for f in floors)
    assert ratios == pytest.approx([m / f for m, f in zip(ms, floors)], rel=1e-5) and min(ratios) > 1
    for key in ("rollout_peak_bytes", "update_peak_bytes", "step_peak_bytes"):
        assert len(logged(f"memory/{key}")) == 3, key
    lines = summary.summary_lines(trainer)
    assert any("decode floor" in line and "tokens/s" in line for line in lines), lines
    assert any(line.startswith("  rollout peak") and "; device " in line for line in lines), lines


def test_building_a_tiny_model_on_the_gpu_leaves_its_generator_as_it_was():
    """The tiny models draw seeded weights where they are built (Lightning's configure_model: on the GPU); the
    run's own CUDA stream of random numbers goes on as if nothing had been drawn."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    torch.cuda.manual_seed(7)
    before = torch.cuda.get_rng_state()
    with torch.device("cuda"):
        model, _ = load_model_and_tokenizer("tiny-llama")
    assert next(model.parameters()).device.type == "cuda"
    assert torch.equal(torch.cuda.get_rng_state(), before)


def test_a_resume_sets_the_cuda_generator_back():
    """The CUDA generator (the update's dropout) is part of the saved random states: set back, it draws again what it
    drew after they were saved."""
    from lit_grpo.datamodules.random_state import get_rng_states, set_rng_states

    torch.rand(1, device="cuda")  # CUDA in use
    saved = get_rng_states()
    first = torch.rand(8, device="cuda")
    set_rng_states(saved)
    assert torch.equal(torch.rand(8, device="cuda"), first)


def test_the_bandwidth_probe_leaves_the_devices_reserved_memory_as_it_found_it():
    """The probe's buffer (a few hundred MiB) is handed back to the device, not kept in the allocator's cache, where
    it would count in every ``memory/*_peak_reserved_bytes`` read after it."""
    from lit_grpo.sampling.roofline import measure_read_bandwidth

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    assert measure_read_bandwidth("cuda") > 0
    assert torch.cuda.memory_reserved() == before
