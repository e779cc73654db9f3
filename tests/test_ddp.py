"""Multi-process training: ``--trainer.strategy ddp`` on 2 CPU processes of the tiny config with gloo, and the FSDP
recipe's configuration.

One 2-process run (scale_rewards=batch, dapo) checks: each rank draws different prompts, groups never split
across ranks (every rank holds B whole groups of G), parameters stay identical across ranks, the batch reward
scale spans both ranks (advantages use the std of all ranks' rewards), and dapo's normalizer spans both ranks
(the logged gradient norm equals that of one process holding both ranks' rows).
"""

from pathlib import Path

import pytest
import torch
import yaml
from two_process_helpers import ROOT, fit_two_processes

from lit_grpo.runtime.validation import available_cores

FSDP = str(ROOT / "configs" / "fsdp_gpu.yaml")


@pytest.mark.xdist_group("ddp_run")
def test_ddp_ranks_draw_whole_disjoint_groups_and_stay_in_sync(ddp_run):
    from tools.step_recorder import read_records

    ranks = [read_records(ddp_run, rank) for rank in (0, 1)]
    assert [r["global_step"] for r in ranks[0]] == [r["global_step"] for r in ranks[1]] == [1, 2]
    for a, b in zip(*ranks):
        assert a["world_size"] == b["world_size"] == 2
        assert (a["num_prompts"], a["group_size"]) == (b["num_prompts"], b["group_size"]) == (2, 4)
        assert all(len(group) == 4 for group in a["completion_ids"] + b["completion_ids"])  # whole groups
        assert not set(a["indices"]) & set(b["indices"]), (a["indices"], b["indices"])  # different prompts
        # identical weights, exactly: both ranks apply the same all-reduced gradient with the same kernels on the
        # same shapes (a determinism claim; the two processes share this machine's CPU)
        assert a["param_sum"] == b["param_sum"] and a["param_abs"] == b["param_abs"]
        assert a["grad_norm"] == b["grad_norm"]
        # each rank its share of the cores (the run's first process hands it to the other in OMP_NUM_THREADS), not
        # all of them each: two ranks spin-waiting for each other's cores run several times slower
        assert a["threads"] == b["threads"] == max(1, available_cores() // 2)
    assert ranks[0][0]["param_abs"] != ranks[0][1]["param_abs"]  # and they did train


@pytest.mark.xdist_group("ddp_run")
def test_ddp_batch_scale_and_dapo_normalizer_span_ranks(ddp_run, eos_model):
    from tools.step_recorder import read_records

    from lit_grpo.rollout.advantages import STD_EPS
    from lit_grpo.update.module import GRPOModule

    batches = [torch.load(f"{ddp_run}.rank{rank}.step1.pt", weights_only=False) for rank in (0, 1)]
    every_reward = torch.cat([b.rewards for b in batches])
    for b in batches:  # scale_rewards=batch: one std over both ranks' rewards
        expected = (b.rewards - b.rewards.mean(dim=1, keepdim=True)) / (every_reward.std() + STD_EPS)
        torch.testing.assert_close(b.advantages, expected)
    assert not torch.isclose(every_reward.std(), batches[0].rewards.std())  # the test can tell the difference

    # dapo: the step's loss is (sum over both ranks' tokens) / (both ranks' active tokens); recompute it in one
    # process from the initial weights and compare the gradient norm the ddp run logged.
    module = GRPOModule(model=eos_model, train_micro_batch_size=4, max_grad_norm=None)
    module.configure_model()
    total = sum(module._total_active_tokens(module._micro_batches(b)) for b in batches)
    grads = []
    from lit_grpo.update.sampler_correction import CorrectionStats

    for b in batches:
        module._update(b, module._micro_batches(b), torch.optim.SGD(module.policy.parameters(), lr=0.0), None, None,
                       total, 0, module.sampler_correction.for_batch(False), CorrectionStats())
        grads.append([p.grad.clone() for p in module.policy.parameters()])
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a + b) for a, b in zip(*grads)]))
    logged = read_records(ddp_run, 0)[0]["grad_norm"]
    assert float(norm) == pytest.approx(logged, rel=1e-4)


def test_ddp_normalize_then_sum_normalizes_over_both_ranks(tmp_path):
    """Under multi_objective_aggregation: normalize_then_sum the summed normalized rewards are normalized by the
    mean and std of both ranks' (each rank's groups normalized on their own rank, where they are whole)."""
    from lit_grpo.rollout.advantages import normalize_then_sum, normalize_then_sum_advantages

    record = fit_two_processes(tmp_path, "--trainer.strategy", "ddp", "--model.multi_objective_aggregation",
                               "normalize_then_sum", steps=1)
    batches = [torch.load(f"{record}.rank{rank}.step1.pt", weights_only=False) for rank in (0, 1)]
    with open(ROOT / "configs" / "tiny.yaml") as handle:
        funcs = yaml.safe_load(handle)["data"]["reward_funcs"]
    weights = torch.tensor([f["weight"] for f in funcs])
    values = [torch.stack([b.reward_components[f["name"]] for f in funcs], dim=-1) for b in batches]
    both = torch.cat([normalize_then_sum(v, weights) for v in values])
    for b, v in zip(batches, values):
        torch.testing.assert_close(b.advantages, normalize_then_sum_advantages(v, weights, batch_sums=both))
    # the test can tell the difference: one rank's own statistics differ
    assert not torch.allclose(batches[0].advantages, normalize_then_sum_advantages(values[0], weights), atol=1e-4)


def test_fsdp_recipe_config_instantiates():
    """configs/fsdp_gpu.yaml (FSDP2 through ModelParallelStrategy, GPU only) parses, its strategy instantiates, and
    the module shards itself in configure_model when given a device mesh (checked on one CPU process)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_grpo.cli import build_cli

    with open(FSDP) as handle:
        raw = yaml.safe_load(handle)
    strategy = raw["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert isinstance(ModelParallelStrategy(**strategy.get("init_args", {})), ModelParallelStrategy)
    # the rest of the recipe (module, data) instantiates; the strategy itself needs CUDA devices
    cli = build_cli(["--config", FSDP, "--model.model", "tiny-llama", "--trainer.accelerator", "cpu",
                     "--trainer.strategy", "auto", "--trainer.devices", "1", "--trainer.precision", "32-true",
                     "--trainer.logger", "false"], run=False)
    assert cli.model.hparams.fsdp is True
    assert cli.datamodule.sampling.group_size >= 2


def test_each_rank_carries_its_own_partial_rollouts_into_the_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    fit_two_processes(tmp_path, "--trainer.strategy", "ddp", "--data.over_provision", "2.0",
                       "--data.sampling.micro_group_size", "6", "--data.sampling.max_new_tokens", "48",
                       "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpt_dir}",
                       "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
                       "--trainer.callbacks.filename={step}")
    state = torch.load(ckpt_dir / "step=1.ckpt", map_location="cpu", weights_only=True)["RolloutDataModule"]
    by_rank = state["engine_by_rank"]  # every rank's engine state: rollout counter, scheduler, carried groups
    assert "engine" not in state and len(by_rank) == 2 and all(engine["carried"] for engine in by_rank)
    assert all(engine["rollout_index"] >= 1 and "scheduler" in engine for engine in by_rank)
    prompts = [{group["prompt"]["index"] for group in engine["carried"]} for engine in by_rank]
    assert not prompts[0] & prompts[1]  # each rank's own groups
    assert len(state["in_flight"]) == len(prompts[0] | prompts[1])  # every rank's, gathered: no fresh draw takes one

    from lit_grpo.datamodules.rollout import RolloutDataModule

    # the fit's group size: the carried groups are checked as the data state is loaded, against this run's
    data = RolloutDataModule(prompts=["1 + 1", "2 + 2"], val_size=0, sampling={"group_size": 4})
    data.trainer = type("Trainer", (), {"world_size": 2, "global_rank": 1})()
    data.load_state_dict(state)  # before setup: kept whole until setup has checked its sampler part
    assert data._local_state()["engine"] == by_rank[1]
    data.trainer = type("Trainer", (), {"world_size": 3, "global_rank": 0})()
    with pytest.raises(ValueError, match=r"carries partial rollouts of 2 rank\(s\); resume it with as many ranks "
                                         r"\(this run has 3\)"):
        data.load_state_dict(state)
    with pytest.raises(ValueError, match=r"partial rollouts of 1 rank\(s\); .*this run has 3"):  # one process's
        data.load_state_dict({"engine": by_rank[0]})
    nothing_carried = {"engine_by_rank": [{**engine, "carried": []} for engine in by_rank]}
    data.load_state_dict(nothing_carried)  # another number of ranks: rank 0's counter and scheduler for each
    assert data._local_state()["engine"] == nothing_carried["engine_by_rank"][0]
    data.trainer.state = type("State", (), {"fn": "validate"})()  # evaluating needs no engine state
    data._state_for_setup = None
    data.load_state_dict(state)
    assert "engine" not in data._local_state()
    # a checkpoint written with rank 0's engine state and every rank's carried groups beside it
    older = {"engine": {**by_rank[0], "carried": None, "carried_by_rank": [e["carried"] for e in by_rank]}}
    older["engine"].pop("carried")
    data.trainer = type("Trainer", (), {"world_size": 2, "global_rank": 1})()
    data.load_state_dict(older)
    assert data._local_state()["engine"] == {**by_rank[0], "carried": by_rank[1]["carried"]}


def test_a_ddp_resume_with_dropout_on_goes_on_with_each_ranks_own_random_states(tmp_path):
    """LoRA's dropout draws each rank's masks from that rank's global random state, which differs between ranks (their
    rows differ): the checkpoint keeps every rank's, and a resume from step 1 has the uninterrupted run's step 2 on
    both ranks (with rank 0's states on rank 1, its masks, so its loss and the weights, went another way there)."""
    from tools.step_recorder import read_records

    lora = ("--model.peft_config", "{r: 4, lora_alpha: 8, lora_dropout: 0.5, target_modules: [q_proj, v_proj]}")
    ckpt_dir = tmp_path / "ckpt"
    (tmp_path / "full").mkdir()
    (tmp_path / "resumed").mkdir()
    full = fit_two_processes(tmp_path / "full", "--trainer.strategy", "ddp", *lora,
                             "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpt_dir}",
                             "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
                             "--trainer.callbacks.filename={step}", steps=2)
    state = torch.load(ckpt_dir / "step=1.ckpt", map_location="cpu", weights_only=True)["RolloutDataModule"]
    first, second = (rng["torch"] for rng in state["rng_by_rank"])
    assert not torch.equal(first, second)  # the ranks' states differ: one for both would not do
    resumed = fit_two_processes(tmp_path / "resumed", "--trainer.strategy", "ddp", *lora,
                                "--ckpt_path", str(ckpt_dir / "step=1.ckpt"), steps=2)
    for rank in (0, 1):
        a, b = read_records(full, rank), read_records(resumed, rank)
        assert [r["global_step"] for r in b] == [2]
        for x, y in zip(a[1:], b):
            for key in ("indices", "completion_ids", "rewards", "loss", "param_sum", "param_abs"):
                assert x[key] == y[key], (rank, x["global_step"], key)


def test_a_rank_takes_its_own_random_states_back_and_another_world_the_saving_ranks():
    from lit_grpo.datamodules.rollout import RolloutDataModule

    states = [{"torch": torch.Generator().manual_seed(seed).get_state()} for seed in (1, 2)]
    data = RolloutDataModule(prompts=["1 + 1", "2 + 2"], val_size=0)
    data.trainer = type("Trainer", (), {"world_size": 2, "global_rank": 1})()
    assert data._own_rng_states({"rng": states[0], "rng_by_rank": states}) is states[1]
    data.trainer = type("Trainer", (), {"world_size": 3, "global_rank": 2})()
    assert data._own_rng_states({"rng": states[0], "rng_by_rank": states}) is states[0]
    assert data._own_rng_states({"rng": states[0]}) is states[0]  # a checkpoint from before every rank's were kept


# ----------------------------------------------------------------------------------------------------------------
# One gradient all-reduce per optimizer step; logged metrics are the whole step's
# ----------------------------------------------------------------------------------------------------------------


def test_ddp_all_reduces_the_gradients_once_per_optimizer_step(tmp_path):
    """4 micro-batches per rank and 2 optimizer steps per training step, the gradients in several 0.1 MB buckets: a
    DDP comm hook (StepRecorder's count_grad_syncs) sees each bucket once per optimizer step, not once per
    micro-batch."""
    from tools.step_recorder import read_records

    syncs, strategy = tmp_path / "syncs", tmp_path / "strategy.yaml"
    strategy.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"bucket_cap_mb": 0.1}}}}))
    fit_two_processes(tmp_path, "--config", str(strategy), "--model.train_micro_batch_size", "2",
                       "--model.num_iterations", "2",
                       "--trainer.callbacks+=tools.step_recorder.StepRecorder", f"--trainer.callbacks.path={syncs}",
                       "--trainer.callbacks.count_grad_syncs=true")
    for rank in (0, 1):
        records = read_records(str(syncs), rank)
        assert [r["global_step"] for r in records] == [2]  # max_steps=2: one training step of 2 optimizer steps
        for record in records:
            assert record["num_prompts"] * record["group_size"] == 8  # 4 micro-batches of 2 rows
            assert len(record["grad_syncs"]) == 2, record["grad_syncs"]  # num_iterations optimizer steps
            for buckets in record["grad_syncs"]:  # one round: every bucket reduced exactly once
                assert buckets and sorted(buckets) == list(range(len(buckets))), record["grad_syncs"]
        # one bucket in the first backward; DDP then rebuilds them, 0.1 MB each, in the order gradients came
        assert max(len(buckets) for record in records for buckets in record["grad_syncs"]) > 1


def _logged_keys(record: dict) -> dict:
    return {k: v for k, v in record["logged"].items() if not k.startswith("val/")}


@pytest.mark.xdist_group("ddp_run")
def test_logged_step_metrics_are_the_whole_steps_on_every_rank(ddp_run):
    from tools.step_recorder import read_records

    ranks = [read_records(ddp_run, rank) for rank in (0, 1)]
    told_apart = False
    for a, b in zip(*ranks):
        assert _logged_keys(a) == _logged_keys(b)  # every rank logs the same figures
        logged = a["logged"]
        rewards = torch.tensor(a["rewards"] + b["rewards"], dtype=torch.float64)
        assert logged["reward/mean"] == pytest.approx(float(rewards.mean()), rel=1e-6)
        told_apart |= logged["reward/mean"] != pytest.approx(float(torch.tensor(a["rewards"]).mean()), rel=1e-6)
        lengths = [len(ids) for r in (a, b) for group in r["completion_ids"] for ids in group]
        assert logged["completions/min_length"] == min(lengths)
        assert logged["completions/max_length"] == max(lengths)
        assert logged["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-6)
        assert logged["train/loss"] == pytest.approx((a["loss"] + b["loss"]) / 2, rel=1e-5, abs=1e-9)
        walls = [a["rollout"]["wall_s"], b["rollout"]["wall_s"]]
        assert logged["rollout/rank_skew"] == pytest.approx(max(walls) / (sum(walls) / 2), rel=1e-6)
        assert logged["rollout/rank_skew"] >= 1.0
    assert told_apart  # rank 0's own reward differs from the step's in at least one step


@pytest.mark.xdist_group("ddp_run")
def test_callback_keys_are_the_whole_steps_in_tensorboard(ddp_run):
    """RolloutProfiler's rollout/* and PeakMemoryMonitor's memory/* in rank 0's TensorBoard file: sums of counts,
    the slowest rank's times."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tools.step_recorder import read_records

    (log_dir,) = {path.parent for path in (Path(ddp_run).parent / "run").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()

    def logged(tag: str) -> list[float]:
        return [event.value for event in accumulator.Scalars(tag)]

    ranks = [read_records(ddp_run, rank) for rank in (0, 1)]
    both = list(zip(*ranks))
    assert logged("rollout/generated_tokens") == [a["rollout"]["generated_tokens"] + b["rollout"]["generated_tokens"]
                                                  for a, b in both]
    assert logged("rollout/prefill_tokens") == [a["rollout"]["prefill_tokens"] + b["rollout"]["prefill_tokens"]
                                                for a, b in both]
    assert logged("rollout/decode_steps") == [max(a["rollout"]["decode_steps"], b["rollout"]["decode_steps"])
                                              for a, b in both]
    assert logged("rollout/wall_s") == pytest.approx([max(a["rollout"]["wall_s"], b["rollout"]["wall_s"])
                                                      for a, b in both], rel=1e-6)
    assert logged("rollout/rank_skew") == pytest.approx([a["logged"]["rollout/rank_skew"] for a, _ in both])
    assert len(logged("memory/step_peak_bytes")) == len(both)


@pytest.mark.xdist_group("ddp_run")
def test_val_metrics_count_every_ranks_held_out_prompts_once(ddp_run):
    """val/reward (a torchmetrics mean, synced when computed) is the mean over both ranks' held-out prompts."""
    from tools.step_recorder import read_validations

    ranks = [read_validations(ddp_run, rank) for rank in (0, 1)]
    assert [v["global_step"] for v in ranks[0]] == [v["global_step"] for v in ranks[1]] == [0, 2]
    for a, b in zip(*ranks):
        assert a["logged"] == b["logged"]
        indices = [i for v in (a, b) for batch in v["batches"] for i in batch["indices"]]
        assert len(indices) == len(set(indices)) == 4  # every held-out prompt (val_size 4), on one rank
        rewards = [r for v in (a, b) for batch in v["batches"] for r in batch["rewards"]]
        assert a["logged"]["val/reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-5)


def test_rank_reductions_cover_every_key_and_reduce_as_documented():
    from lit_grpo.callbacks.peak_memory import MEMORY_KEYS
    from lit_grpo.callbacks.rollout_profiler import ROLLOUT_FIELDS
    from lit_grpo.rollout.metrics import (rank_reduction, reduce_over_ranks, step_metric_keys,
                                          whole_step_metrics)

    for key in [*step_metric_keys(["accuracy"]), *(f"rollout/{f}" for f in ROLLOUT_FIELDS), *MEMORY_KEYS]:
        assert rank_reduction(key) in ("mean", "sum", "min", "max", "skew"), key
    per_rank = [{"reward/mean": 0.25, "completions/min_length": 3.0, "reward/skipped_groups": 1.0,
                 "rollout/carried_samples": 1.0, "rollout/rank_skew": 1.0, "reward/accuracy/mean": 0.5},
                {"reward/mean": 0.75, "completions/min_length": 5.0, "reward/skipped_groups": 2.0,
                 "rollout/carried_samples": 2.0, "rollout/rank_skew": 3.0}]
    keys = step_metric_keys(["accuracy"])
    # counts add up over ranks (skipped groups, carried samples); means average; extremes take the extreme
    assert reduce_over_ranks(per_rank, keys) == {
        "reward/mean": 0.5, "reward/skipped_groups": 3.0, "completions/min_length": 3.0,
        "rollout/carried_samples": 3.0, "rollout/rank_skew": 1.5,
        "reward/accuracy/mean": 0.5}  # absent on rank 1: rank 0's alone
    assert list(reduce_over_ranks(per_rank, keys)) == [k for k in keys if k in reduce_over_ranks(per_rank, keys)]

    # one collective: every rank's [2, K] (values, present) stacked; here rank 1 holds twice rank 0's values
    gathered = whole_step_metrics({"reward/mean": 1.0, "completions/max_length": 4.0, "train/kl": None}, keys,
                                  lambda local: torch.stack([local, 2 * local]))
    assert gathered == {"reward/mean": 1.5, "completions/max_length": 8.0}
    with pytest.raises(ValueError, match="'reward/new_key'"):
        whole_step_metrics({"reward/new_key": 1.0}, keys, lambda local: torch.stack([local, local]))
    with pytest.raises(ValueError, match="'custom/thing' has no rule"):
        rank_reduction("custom/thing")


def test_a_logged_key_that_is_no_string_is_refused_naming_it():
    """A logged key that is no string (an int, one too long to print among them) is refused naming it as refusals
    name a value: rank_reduction and reduce_over_ranks failed on its missing startswith, and gather_over_ranks' refusal
    of an unknown key raised repr's ValueError on an int of more than 4300 digits."""
    from lit_grpo.rollout.metrics import gather_over_ranks, rank_reduction, reduce_over_ranks

    huge = 10**5000
    with pytest.raises(ValueError, match=r"^logged key an int of 5001 digits \(int\) is not a string"):
        rank_reduction(huge)
    with pytest.raises(ValueError, match=r"^logged key 3 \(int\) is not a string"):
        reduce_over_ranks([{"reward/mean": 1.0, 3: 1.0}], ["reward/mean", 3])
    with pytest.raises(ValueError, match=r"^logged keys \[an int of 5001 digits\] are not among the 1 keys gathered"):
        gather_over_ranks({huge: 1.0}, ["reward/mean"], lambda local: local[None])


def test_rank_reductions_of_rounds_parks_an_idle_skew_and_a_ratio_a_rank_left_unweighted():
    from lit_grpo.rollout.metrics import reduce_over_ranks, with_weights

    # the rank that needed most rounds sets the step's; parked samples add up; where no rank spent any time on its
    # rollout none waited for another: a skew of 1
    per_rank = [{"rollout/rollouts_per_step": 1.0, "rollout/parked_samples": 2.0, "rollout/rank_skew": 0.0},
                {"rollout/rollouts_per_step": 3.0, "rollout/parked_samples": 5.0, "rollout/rank_skew": 0.0}]
    assert reduce_over_ranks(per_rank, list(per_rank[0])) == {
        "rollout/rollouts_per_step": 3.0, "rollout/parked_samples": 7.0, "rollout/rank_skew": 1.0}
    # a ratio whose weight one rank did not report: the plain mean of the ranks' ratios
    ratio = [{"reward/frac_zero_std": 0.5, "weight/groups_generated": 2.0}, {"reward/frac_zero_std": 0.0}]
    assert reduce_over_ranks(ratio, with_weights(["reward/frac_zero_std"])) == {"reward/frac_zero_std": 0.25}


def test_reward_std_is_the_mean_over_groups_of_each_groups_std():
    # reward/std is TRL's: the within-group std averaged over groups, not the std of all rewards pooled
    from lit_grpo.rollout.metrics import reward_metrics

    assert reward_metrics(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), {}, 2, 2)["reward/std"] == 0.0
    # group stds (unbiased) sqrt(2) and 0; the pooled std of [0, 2, 1, 1] would be sqrt(2 / 3)
    std = reward_metrics(torch.tensor([[0.0, 2.0], [1.0, 1.0]]), {}, 1, 2)["reward/std"]
    assert std == pytest.approx(2 ** 0.5 / 2)


def _reward_ranks():
    """reward_metrics of two ranks (2 and 3 groups, of which 1 and 0 had equal rewards; the accuracy reward present
    on 3 and 2 samples) and of one process holding both ranks' groups."""
    from lit_grpo.rollout.metrics import reward_metrics

    nan = float("nan")
    rewards = [torch.tensor([[1.0, 1.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [2.0, 0.0], [1.0, 3.0]])]
    accuracy = [torch.tensor([[1.0, nan], [0.0, 1.0]]), torch.tensor([[nan, 1.0], [nan, nan], [0.0, nan]])]
    counts = [(1, 2), (0, 3)]
    ranks = [reward_metrics(r, {"accuracy": a}, *c) for r, a, c in zip(rewards, accuracy, counts)]
    one = reward_metrics(torch.cat(rewards), {"accuracy": torch.cat(accuracy)}, 1, 5)
    return ranks, one


def _step_ranks():
    """StepMetrics of two ranks whose micro-batches hold different numbers of loss and completion tokens, with
    their completion tokens as rollout_metrics reports them, and of one process holding both ranks' micro-batches."""
    from lit_grpo.update.metrics import StepMetrics

    def micro(tokens: int, units: int, low: float, high: float, kl: float, entropy: float, rows: int, phi: float):
        mask = torch.zeros(1, 6)
        mask[0, :tokens] = 1
        return (torch.tensor(0.5), {"active_tokens": torch.tensor(float(tokens)), "clip_units": torch.tensor(units),
                                    "clip_ratio_low": torch.tensor(low), "clip_ratio_high": torch.tensor(high),
                                    "kl": torch.tensor(kl), "phi_seq_mean": torch.tensor(phi),
                                    "completions": torch.tensor(float(rows))}, torch.full((1, 6), entropy), mask)

    # the clip shares count other units than the tokens (completions, under GSPO): their own weight; vespo's weight
    # is a mean over completions
    micros = [[micro(2, 2, 0.5, 0.0, 0.1, 1.0, 2, 0.5)],
              [micro(6, 3, 0.0, 1 / 3, 0.4, 2.0, 3, 1.0), micro(3, 1, 1.0, 0.0, 0.2, 0.5, 1, 0.2)]]
    steps = []
    for batches in (*micros, micros[0] + micros[1]):
        step = StepMetrics()
        for args in batches:
            step.add(*args)
        step.read()
        tokens = float(sum(args[3].sum() for args in batches))
        steps.append({**{k if k.startswith("weight/") else f"train/{k}": v for k, v in step.result(1.0).items()},
                      "weight/completion_tokens": tokens})
    return steps[:2], steps[2]


def _sampling_ranks():
    """CorrectionStats (token-level correction on) of two ranks with 2 and 5 active tokens, and of one process."""
    from lit_grpo.update.sampler_correction import CorrectionStats

    data = [(torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-0.5, -1.0, 0.0]]), torch.tensor([[1, 1, 0]])),
            (torch.tensor([[0.0, -1.0, -2.0], [-1.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, -1.0], [-3.0, 0.0, 0.0]]),
             torch.tensor([[1, 1, 1], [1, 1, 0]]))]
    stats = [CorrectionStats() for _ in range(3)]
    for index, (trainer, sampling, mask) in enumerate(data):
        for target in (stats[index], stats[2]):
            target.update(trainer, sampling, mask, (trainer - sampling).exp())
    return [s.as_metrics() for s in stats[:2]], stats[2].as_metrics()


def _rollout_ranks():
    """rollout_metrics' offpolicy_tokens_frac (a batch of 3 of 4 tokens from older weights and one of 1 of 12) and
    RolloutProfiler's slot_utilization (10 tokens in 4 steps on 4 slots, 30 in 10 steps on 8), by rank and for one
    process holding both."""
    from types import SimpleNamespace

    from lit_grpo.callbacks.rollout_profiler import profile
    from lit_grpo.rollout.metrics import rollout_metrics
    from lit_grpo.sampling.stats import RolloutStats

    def batch(offpolicy: int, tokens: int):
        mask = torch.zeros(2, 6)
        mask.view(-1)[:tokens] = 1
        return SimpleNamespace(rewards=torch.zeros(1, 2), reward_components={}, num_groups_zero_std=1,
                               num_groups_generated=1, completion_lengths=mask.sum(1), truncated=torch.zeros(2),
                               completion_mask=mask, drawn_mask=lambda: mask,
                               metrics={"rollout/offpolicy_tokens_frac": offpolicy / tokens})

    def stats(tokens: int, steps: int, slots: int):
        out = RolloutStats(decode_steps=steps, num_slots=slots, wall_s=1.0)
        out.generated_tokens, out.slot_utilization = tokens, tokens / (steps * slots)
        return out

    ranks = [{**rollout_metrics(batch(3, 4)), **profile(stats(10, 4, 4))},
             {**rollout_metrics(batch(1, 12)), **profile(stats(30, 10, 8))}]
    return ranks, {"rollout/offpolicy_tokens_frac": 4 / 16, "rollout/slot_utilization": 40 / 96}


@pytest.mark.parametrize("key, producer", [
    ("reward/frac_zero_std", _reward_ranks), ("reward/accuracy/mean", _reward_ranks),
    ("train/clip_ratio_low", _step_ranks), ("train/clip_ratio_high", _step_ranks), ("train/kl", _step_ranks),
    ("train/entropy", _step_ranks), ("train/phi_seq_mean", _step_ranks),
    ("sampling/sampling_logp_difference/mean", _sampling_ranks),
    ("sampling/importance_sampling_ratio/mean", _sampling_ranks),
    ("rollout/offpolicy_tokens_frac", _rollout_ranks), ("rollout/slot_utilization", _rollout_ranks)])
def test_a_ratio_over_ranks_is_the_ratio_of_the_sums(key, producer):
    """Each key whose whole-step value is a ratio of sums with denominators that differ between ranks: reduced over
    two ranks' values as their producers report them (with their weights), it equals what one process holding
    both ranks' rows computes, not the mean of the two ranks' ratios."""
    from lit_grpo.rollout.metrics import RATIO_WEIGHTS, loggable, ratio_weight, reduce_over_ranks, with_weights

    ranks, one = producer()
    assert key in RATIO_WEIGHTS or key.startswith("reward/")
    assert all(ratio_weight(key) in rank for rank in ranks)
    reduced = reduce_over_ranks(ranks, with_weights([key]))
    assert reduced == {key: pytest.approx(one[key], rel=1e-6)}  # the producers round to float32
    assert one[key] != pytest.approx((ranks[0][key] + ranks[1][key]) / 2)  # the test tells the two apart
    assert not any(name.startswith("weight/") for name in loggable(ranks[0]))


@pytest.mark.xdist_group("ddp_run")
def test_ddp_the_high_entropy_quantile_spans_both_ranks_in_lockstep(tmp_path):
    """``top_entropy_quantile`` under 2 processes, 3 micro-batches a rank, with the entropy bonus: every micro-batch's
    masks gather both ranks' entropies (the ranks' collectives pair: the run ends) and the weights stay identical."""
    from tools.step_recorder import read_records

    record = fit_two_processes(tmp_path, "--model.train_micro_batch_size", "3", "--model.loss.top_entropy_quantile",
                               "0.3", "--model.loss.entropy_coef", "0.1")
    ranks = [read_records(record, rank) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 2
    for a, b in zip(*ranks):
        assert a["param_sum"] == b["param_sum"]


@pytest.mark.xdist_group("ddp_run")
def test_ddp_the_adaptive_entropy_control_is_one_over_both_ranks(tmp_path):
    """The entropy bonus under 2 processes, 3 micro-batches a rank and 2 optimizer steps a training step: the
    ranks' collectives pair (the run ends), the weights stay identical and every rank logs the same coefficient,
    moved once per optimizer step."""
    from tools.step_recorder import read_records

    record = fit_two_processes(tmp_path, "--model.train_micro_batch_size", "3", "--model.num_iterations", "2",
                               "--model.loss.use_adaptive_entropy", "true", "--model.loss.entropy_coef", "0.1",
                               "--model.loss.entropy_coef_delta", "0.1", "--model.loss.entropy_target", "100",
                               steps=4)
    ranks = [read_records(record, rank) for rank in (0, 1)]
    assert [r["global_step"] for r in ranks[0]] == [2, 4]
    for a, b in zip(*ranks):
        assert a["param_sum"] == b["param_sum"]
        assert a["logged"]["train/entropy_coef"] == b["logged"]["train/entropy_coef"]
    # the mean over each training step's two optimizer steps of the coefficient after it: (0.2 + 0.3) / 2, ...
    assert [r["logged"]["train/entropy_coef"] for r in ranks[0]] == pytest.approx([0.25, 0.45])
