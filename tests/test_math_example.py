"""The worked example: the shipped parquet is what its seeded generator writes, and configs/math_example.yaml runs
end to end (dataset source, math reward, sampled validation, export) with a tiny model in place of SmolLM2."""

import os
from pathlib import Path

import forked_cli
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoModelForCausalLM

from tools import make_math_set

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "math_example.yaml"


def test_shipped_set_is_the_generators_output(tmp_path):
    shipped = pq.read_table(ROOT / "tools" / "data" / "math_example.parquet").to_pylist()
    assert shipped == make_math_set.make_rows(300, seed=0)
    assert len({row["problem"] for row in shipped}) == len(shipped)  # held-out prompts never repeat training ones
    assert make_math_set.make_rows(50, seed=1) == make_math_set.make_rows(50, seed=1)
    assert make_math_set.make_rows(50, seed=1) != make_math_set.make_rows(50, seed=2)
    assert set(row["kind"] for row in shipped) == set(make_math_set.KINDS)
    with pytest.raises(ValueError, match="rows=0 must be in"):
        make_math_set.make_rows(0, seed=0)


@pytest.mark.parametrize(("value", "expected"), [(make_math_set.Fraction(7, 2), r"\frac{7}{2}"),
                                                 (make_math_set.Fraction(-3, 4), r"-\frac{3}{4}"),
                                                 (make_math_set.Fraction(8, 4), "2")])
def test_latex_answers(value, expected):
    assert make_math_set.latex(value) == expected


def test_example_config_runs_end_to_end_on_a_tiny_model(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    assert config["data"]["dataset"] == "tools/data/math_example.parquet"
    assert config["data"]["reward_funcs"][0]["name"] == "math" and config["data"]["val_num_samples"] > 1
    argv = ["fit", "--config", str(CONFIG), "--torch_num_threads", "1",
           "--model.model", "tiny-llama", "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false", "--data.val_size", "4", "--data.prompts_per_step", "2",
           "--data.sampling.group_size", "2", "--data.sampling.micro_group_size", "4",
           "--data.sampling.max_new_tokens", "4", "--data.val_num_samples", "2"]
    proc = forked_cli.run(argv, ROOT, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "lightning_logs" / "version_0"
    accumulator = EventAccumulator(str(next(run.glob("events.out.tfevents.*"))))
    accumulator.Reload()
    assert {"val/accuracy", "val/mean_at_k", "val/pass_at_k", "reward/math/mean"} <= set(accumulator.Tags()["scalars"])
    assert "model " in proc.stdout and (run / "model" / "model.safetensors").is_file()
    assert AutoModelForCausalLM.from_pretrained(run / "model").config.model_type == "llama"
