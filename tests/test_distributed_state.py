"""One data-steering state on every rank, and 2 nodes x 1 process on localhost.

A 2-process ddp run of the tiny config (gloo, CPU) with the angle curriculum for 8 steps records, at every step and on
every rank, the state that decides what data comes next (``StepRecorder(record_state=True)``: the prompt sampler /
curriculum and the reward forecast): it is equal on every rank at every step, and no prompt is on two ranks in one
step. The same run launched as 2 nodes x 1 process (two ``lit-grpo fit`` processes with ``NODE_RANK`` 0 and 1,
``MASTER_ADDR=127.0.0.1``: Lightning's ``LightningEnvironment``) gets what 2 processes on one node get.
"""

import json
from pathlib import Path

import forked_cli
import pytest
import torch
from two_process_helpers import TINY

from tools.harness import ROOT, free_port, repo_env

STEPS = 8
TIMEOUT_S = 400

# The angle curriculum, 8 short steps, no validation: what decides the data changes at every step.
RUN_ARGS = ["--data.curriculum", "angle", "--data.sampling.max_new_tokens", "8", "--trainer.max_steps", str(STEPS),
            "--trainer.limit_val_batches", "0", "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp"]


#: A launcher's variables: a child gets only the ones the test gives it.
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _arguments(tmp: Path, record: Path, *args: str) -> list[str]:
    return ["fit", "--config", TINY, *RUN_ARGS, *args, "--trainer.default_root_dir", str(tmp / "run"),
            "--trainer.callbacks+=tools.step_recorder.StepRecorder", f"--trainer.callbacks.path={record}",
            "--trainer.callbacks.record_state=true"]


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory) -> str:
    """2 processes on one node (``--trainer.devices 2``; Lightning starts the second)."""
    tmp = tmp_path_factory.mktemp("one_node")
    record = tmp / "rec"
    env = {key: value for key, value in repo_env().items() if key not in LAUNCH_VARIABLES}
    proc = forked_cli.run(_arguments(tmp, record, "--trainer.devices", "2"), tmp, {**env, "OMP_NUM_THREADS": "1"},
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr
    return str(record)


def _records(record: str) -> list[list[dict]]:
    from tools.step_recorder import read_records

    ranks = [read_records(record, rank) for rank in (0, 1)]
    assert [r["global_step"] for r in ranks[0]] == [r["global_step"] for r in ranks[1]] == list(range(1, STEPS + 1))
    assert all(r["world_size"] == 2 for rank in ranks for r in rank)
    return ranks


@pytest.mark.xdist_group("one_node_run")
def test_data_steering_state_is_equal_on_every_rank_at_every_step(one_node_run):
    ranks = _records(one_node_run)
    mus = []
    for a, b in zip(*ranks):
        step = a["global_step"]
        state = a["data_state"]
        assert state["sampler"]["kind"] == "AngleCurriculumSampler" and state["forecasts"], state.keys()
        assert state == b["data_state"], (step, a["data_state"]["sampler_metrics"], b["data_state"]["sampler_metrics"])
        assert not set(a["indices"]) & set(b["indices"]), (step, a["indices"], b["indices"])  # one draw, two slices
        mus.append(state["sampler"]["mu"])
    assert len(set(mus)) > 1, mus  # the curriculum did move: the states compared are not all the start state


@pytest.mark.xdist_group("one_node_run")
def test_checkpoint_holds_the_state_every_rank_had(one_node_run):
    """Saved once (rank 0's checkpoint: the state is the same everywhere) at the end of the run."""
    ckpts = sorted(Path(one_node_run).parent.glob("run/**/last.ckpt"))
    assert ckpts, list(Path(one_node_run).parent.rglob("*.ckpt"))
    saved = torch.load(ckpts[-1], map_location="cpu", weights_only=True)["RolloutDataModule"]["sampler"]
    last = _records(one_node_run)[1][-1]["data_state"]["sampler"]
    assert saved["mu"] == last["mu"] and saved["drawn"] == last["drawn"] == []
    assert saved["scores"].tolist() == last["scores"]


@pytest.mark.xdist_group("one_node_run")
def test_two_nodes_of_one_process_get_what_one_node_of_two_gets(one_node_run, tmp_path):
    """2 nodes x 1 process on localhost (gloo): ``--trainer.num_nodes 2 --trainer.devices 1`` in two processes with
    ``NODE_RANK`` 0 and 1 and one ``MASTER_ADDR`` / ``MASTER_PORT`` (Lightning's ``LightningEnvironment``)."""
    record = tmp_path / "rec"
    argv = _arguments(tmp_path, record, "--trainer.num_nodes", "2", "--trainer.devices", "1")
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), TIMEOUT_S, env=repo_env())
    assert [code for code, _, _ in outputs] == [0, 0], "\n\n".join(out[-5000:] for _, out, _ in outputs)
    assert "distributed_backend=gloo" in outputs[0][1]
    two_nodes, one_node = _records(str(record)), _records(one_node_run)
    for rank in (0, 1):
        for a, b in zip(one_node[rank], two_nodes[rank], strict=True):
            # equal tokens (so rewards and advantages): each layout's weights agree to ~1e-9 after a step (the sums
            # of the all-reduce may round in another order), which moves a sampled token only if its uniform lies
            # that close to a CDF boundary
            for key in ("rank", "indices", "completion_ids", "rewards", "advantages", "data_state"):
                assert a[key] == b[key], (rank, a["global_step"], key)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)
            assert b["param_sum"] == pytest.approx(a["param_sum"], rel=1e-9)
    # identical weights on both nodes, exactly: the same all-reduced gradient through the same kernels (both
    # processes run on this machine), a determinism claim
    for a, b in zip(*two_nodes):
        assert (a["param_sum"], a["param_abs"]) == (b["param_sum"], b["param_abs"])


def test_ranks_that_draw_unequally_end_the_step_with_equal_samplers_and_nothing_drawn_lost():
    """Dynamic sampling's extra rounds or partial rollouts' fresh groups: ranks ask for different numbers of prompts
    in a step. Each global draw gives every rank a disjoint slice; the step's end (``_StepDraw.finish``, from every
    rank's draws and prompts taken) leaves every rank's sampler in the same state and gives back to it, on every
    rank alike, the prompts no rank took, which the uniform sampler hands out first next (no collective in the
    rollout itself)."""
    from lit_grpo.datamodules.curriculum import build_prompt_sampler
    from lit_grpo.datamodules.rollout import _StepDraw

    for curriculum in ("none", "angle"):
        samplers = [build_prompt_sampler(curriculum, 20, seed=3) for _ in range(2)]
        if curriculum == "angle":
            for sampler in samplers:
                sampler.set_scores(torch.linspace(0, 1, 20), 0)
        steps = [_StepDraw(sampler, 3, 2, rank) for rank, sampler in enumerate(samplers)]
        first = [step.take(3) for step in steps]  # one global draw of 6
        assert not set(first[0]) & set(first[1])
        more = steps[0].take(2), steps[0].take(2)  # rank 0 needs two more rounds: two more global draws
        assert steps[0].draws == 3 and steps[1].draws == 1
        if curriculum == "none":  # one permutation: no prompt twice (the curriculum's draws are independent)
            assert len(set(first[0] + more[0] + more[1] + first[1])) == 10
        unused = [step.finish([3, 1], [7, 3]) for step in steps]
        assert [step.draws for step in steps] == [3, 3] and unused[0] == unused[1]
        drawn = [prompt for draw in steps[0].drawn for prompt in draw]
        taken = steps[0].taken + steps[1].taken
        # of the 18 drawn: rank 1's slices of the two draws it caught up with, and rank 0's last draw's leftover
        assert len(unused[0]) == 3 + 3 + 2 and sorted(unused[0] + taken) == sorted(drawn)
        a, b = (sampler.state_dict() for sampler in samplers)
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a), curriculum
        assert samplers[0].draw(6) == samplers[1].draw(6)
        if curriculum == "none":  # given back, handed out first: the epoch's 20 prompts, each once
            assert samplers[0].draw(2) == unused[0][6:]
            assert sorted(taken + unused[0] + samplers[0].draw(2)) == list(range(20))


def test_multi_node_recipe_parses_and_instantiates():
    """configs/multi_node.yaml: ddp on 2 nodes x 8 GPUs as written; the rest instantiates on one CPU process."""
    import yaml

    from lit_grpo.cli import build_cli

    path = str(ROOT / "configs" / "multi_node.yaml")
    with open(path) as handle:
        raw = yaml.safe_load(handle)
    assert (raw["trainer"]["strategy"], raw["trainer"]["num_nodes"], raw["trainer"]["devices"]) == ("ddp", 2, 8)
    cli = build_cli(["--config", path, "--model.model", "tiny-llama", "--trainer.accelerator", "cpu",
                     "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.precision", "32-true",
                     "--trainer.logger", "false"], run=False)
    assert cli.trainer.num_nodes == 1 and type(cli.trainer.strategy).__name__ == "DDPStrategy"
    assert cli.datamodule.training.prompts_per_step == 4 and cli.datamodule.sampling.group_size == 32


def test_a_checkpoint_folder_that_cannot_be_written_stops_every_rank(tmp_path):
    """RunCheckpoint checks its folder on rank 0; under a launcher that starts each process itself (here 2 nodes x 1
    process) the other rank must stop with the same error, not wait at the next collective until it times out."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    argv = _arguments(tmp_path, tmp_path / "rec", "--trainer.num_nodes", "2", "--trainer.devices", "1",
                      "--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint",
                      f"--trainer.callbacks.dirpath={blocker / 'checkpoints'}")
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), 120, env=repo_env())
    for code, output, _ in outputs:
        assert code is not None, f"a rank still waited after 120 s:\n{output[-3000:]}"
        assert code != 0 and f"checkpoint folder {blocker / 'checkpoints'} cannot be written" in output, output[-3000:]


def test_dynamic_sampling_on_two_ranks_uses_every_drawn_prompt_once_per_epoch(tmp_path):
    """Dynamic sampling where rank 1 drops every group and draws again (3 rounds a step) while rank 0 keeps its
    groups at once: each of rank 1's rounds is a global draw, so rank 0's slices of them go unused in the step.
    They go back to the sampler and are drawn first next: over 4 steps (about two epochs of the 16 prompts) every
    prompt is scored (trained on or dropped) once per epoch, the ones still waiting in the sampler at the end
    counted too."""
    prompts = [f"Say {i:02d}." for i in range(16)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in prompts))
    scored = tmp_path / "scored"
    reward = json.dumps([{"name": "fault_helpers:rank_split_reward", "kwargs": {"path": str(scored)}}])
    argv = ["fit", "--config", TINY, "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
            "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.max_steps", "4",
            "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint", f"--trainer.callbacks.dirpath={tmp_path}",
            "--data.task", "null", "--data.jsonl_path", str(data), "--data.val_size", "0",
            "--data.reward_funcs", reward, "--data.dynamic_sampling", "true", "--data.max_rollouts_per_step", "3",
            "--data.sampling.max_new_tokens", "4"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), TIMEOUT_S)
    assert [code for code, _, _ in outputs] == [0, 0], "\n\n".join(out[-3000:] for _, out, _ in outputs)
    calls = [[json.loads(line) for line in Path(f"{scored}.rank{rank}").read_text().splitlines()] for rank in (0, 1)]
    assert (len(calls[0]), len(calls[1])) == (4, 12)  # rank 1 drew three times a step, rank 0 once
    sampler = torch.load(tmp_path / "last.ckpt", weights_only=True)["RolloutDataModule"]["sampler"]
    waiting = [prompts[i] for i in sampler["returned"].tolist()]
    assert waiting  # rank 0's last slices went back, and wait for the next step
    used = [text for rank in calls for call in rank for text in call] + waiting
    counts = [used.count(text) for text in prompts]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1, counts
