"""One data-steering state on every rank, and 2 nodes x 1 process on localhost.

A 2-process ddp run of the tiny config (gloo, CPU) with the angle curriculum for 8 steps records, at every step and on
every rank, the state that decides what data comes next (``StepRecorder(record_state=True)``: the prompt sampler /
curriculum and the reward forecast): it is equal on every rank at every step, and no prompt is on two ranks in one
step. The same run launched as 2 nodes x 1 process (two ``lit-grpo fit`` processes with ``NODE_RANK`` 0 and 1,
``MASTER_ADDR=127.0.0.1``: Lightning's ``LightningEnvironment``) gets what 2 processes on one node get.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from two_process_helpers import TINY

from tools.harness import ROOT, free_port, lit_grpo_command, repo_env

STEPS = 8
TIMEOUT_S = 400

# The angle curriculum, 8 short steps, no validation: what decides the data changes at every step.
RUN_ARGS = ["--data.curriculum", "angle", "--data.sampling.max_new_tokens", "8", "--trainer.max_steps", str(STEPS),
            "--trainer.limit_val_batches", "0", "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp"]


#: A launcher's variables: a child gets only the ones the test gives it.
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in repo_env().items() if key not in LAUNCH_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _command(tmp: Path, record: Path, *args: str) -> list[str]:
    return lit_grpo_command() + ["fit", "--config", TINY, *RUN_ARGS, *args, "--trainer.default_root_dir", str(tmp / "run"),
                          "--trainer.callbacks+=tools.step_recorder.StepRecorder",
                          f"--trainer.callbacks.path={record}", "--trainer.callbacks.record_state=true"]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process, at most ``timeout`` seconds in all; on a failure or the timeout, kill them all (each
    started in its own session, so its children go too) and fail with their output."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outputs = [(p.wait(), p.stdout.read()) for p in procs]
    failed = [(i, code, out) for i, (code, out) in enumerate(outputs) if code != 0]
    assert not failed, "\n\n".join(f"process {i} exit {code} (timeout {timeout:.0f} s):\n{out[-5000:]}"
                                   for i, code, out in failed)
    return outputs


def _start(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory) -> str:
    """2 processes on one node (``--trainer.devices 2``; Lightning starts the second)."""
    tmp = tmp_path_factory.mktemp("one_node")
    record = tmp / "rec"
    (output,) = _wait_all([_start(_command(tmp, record, "--trainer.devices", "2"), tmp, _env())], TIMEOUT_S)
    assert "distributed_backend=gloo" in output[1]
    return str(record)


def _records(record: str) -> list[list[dict]]:
    from tools.step_recorder import read_records

    ranks = [read_records(record, rank) for rank in (0, 1)]
    assert [r["global_step"] for r in ranks[0]] == [r["global_step"] for r in ranks[1]] == list(range(1, STEPS + 1))
    assert all(r["world_size"] == 2 for rank in ranks for r in rank)
    return ranks


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


def test_checkpoint_holds_the_state_every_rank_had(one_node_run):
    """Saved once (rank 0's checkpoint: the state is the same everywhere) at the end of the run."""
    ckpts = sorted(Path(one_node_run).parent.glob("run/**/last.ckpt"))
    assert ckpts, list(Path(one_node_run).parent.rglob("*.ckpt"))
    saved = torch.load(ckpts[-1], map_location="cpu", weights_only=True)["RolloutDataModule"]["sampler"]
    last = _records(one_node_run)[1][-1]["data_state"]["sampler"]
    assert saved["mu"] == last["mu"] and saved["drawn"] == last["drawn"] == []
    assert saved["scores"].tolist() == last["scores"]


def test_two_nodes_of_one_process_get_what_one_node_of_two_gets(one_node_run, tmp_path):
    """2 nodes x 1 process on localhost (gloo): ``--trainer.num_nodes 2 --trainer.devices 1`` in two processes with
    ``NODE_RANK`` 0 and 1 and one ``MASTER_ADDR`` / ``MASTER_PORT`` (Lightning's ``LightningEnvironment``)."""
    record = tmp_path / "rec"
    port = str(free_port())
    cmd = _command(tmp_path, record, "--trainer.num_nodes", "2", "--trainer.devices", "1")
    procs = [_start(cmd, tmp_path, _env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for node in (0, 1)]
    outputs = _wait_all(procs, TIMEOUT_S)
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


def test_ranks_that_draw_unequally_end_the_step_with_equal_samplers():
    """Dynamic sampling's extra rounds or partial rollouts' fresh groups: ranks ask for different numbers of prompts
    in a step. Each global draw gives every rank a disjoint slice, and catching up to the most draws any rank made
    leaves every rank's sampler in the same state (no collective in the rollout itself)."""
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
        for step in steps:
            step.catch_up(3)
        assert [step.draws for step in steps] == [3, 3]
        a, b = (sampler.state_dict() for sampler in samplers)
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a), curriculum
        assert samplers[0].draw(6) == samplers[1].draw(6)


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
    assert cli.datamodule.prompts_per_step == 4 and cli.datamodule.sampling.group_size == 32


def test_a_checkpoint_folder_that_cannot_be_written_stops_every_rank(tmp_path):
    """RunCheckpoint checks its folder on rank 0; under a launcher that starts each process itself (here 2 nodes x 1
    process) the other rank must stop with the same error, not wait at the next collective until it times out."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    port = str(free_port())
    cmd = _command(tmp_path, tmp_path / "rec", "--trainer.num_nodes", "2", "--trainer.devices", "1",
                   "--trainer.callbacks+=lit_grpo.callbacks.RunCheckpoint",
                   f"--trainer.callbacks.dirpath={blocker / 'checkpoints'}")
    procs = [_start(cmd, tmp_path, _env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for node in (0, 1)]
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    hung = [p.pid for p in procs if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    outputs = [p.stdout.read() for p in procs]
    assert not hung, f"a rank still waited after 120 s:\n{outputs[1][-3000:]}"
    for code, output in zip((p.returncode for p in procs), outputs):
        assert code != 0 and f"checkpoint folder {blocker / 'checkpoints'} cannot be written" in output, output[-3000:]
