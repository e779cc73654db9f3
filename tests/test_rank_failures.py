"""One rank's error ends every rank, within 60 s, each rank's output naming the rank that failed and its error.

Each case plants a ``PlantedError`` (tests/fault_helpers.py) on rank 0 or rank 1 of a 2-process ``lit-grpo fit`` of
the tiny config, launched as 2 nodes x 1 process (no launcher ties the processes together: only lit_grpo's own
handling ends the other rank), in one place: a training rollout (ddp, and under FSDP2 on the gathered copy and on
the shards in lockstep), a reward function (ddp, and inside FSDP2's lockstep scope), the loss (a non-finite one,
checked on every rank), the update's backward, a validation rollout, a checkpoint save, the setup once the ranks
can talk and the end of training; and, each on the rank it happens on, the restore of a resumed checkpoint and the
export of the trained model. More cases: a rank away from any collective while another fails (ended by its
failure watch), Lightning's own launcher (``--trainer.devices 2``) as real ``lit-grpo`` processes, and a Lightning
script of its own with ``RankFailureWatch`` (no ``lit-grpo``), which records and ends a failing rank itself, once
with both ranks of one node failing at once (each finishes its handling before the other's end can end it). Before
the ranks connect: a model path that exists on one node only, failing on rank 0 or on rank 1, a config file that
does (under torchrun, whose environment gives the layout the unread settings do not; under Lightning's launcher,
on node 1 or on node 0, which runs rank 0's store itself, each named by its node), and the bounded waits of a rank
failing there (``lit_grpo.runtime.rank_failure.end_unconnected_rank``; node 0's, for the nodes that read its record,
``end_unread_node``), ended at once by Ctrl-C, rank 0 leaving another run's
store on its port alone, a process group's setup that times out ending its rank at once (under Lightning's launcher
with the ranks it started), and where each rank finds its place. A forked rank (``ddp_fork``) starts without its
parent's watch.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fault_helpers
import forked_cli
import lightning.pytorch as pl
import pytest
import yaml
from two_process_helpers import TINY

from tools.harness import free_port, lit_grpo_command, repo_env

#: What the issue asks: every process ends within this many seconds of the start of the run.
DEADLINE_S = 60
#: The tiny config's run, 1 step, with none of its callbacks and no logger: only what a failure needs.
RUN_ARGS = ["fit", "--config", TINY, "--trainer.accelerator", "cpu", "--trainer.max_steps", "1",
            "--data.sampling.max_new_tokens", "8", "--trainer.enable_checkpointing", "false",
            "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.limit_val_batches", "0"]
FSDP = {"trainer": {"strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                 "init_args": {"data_parallel_size": "auto", "tensor_parallel_size": 1}}}}

#: (place, strategy, the arguments that make the place happen in a 1-step run)
CASES = [
    ("rollout", "ddp", []),
    ("rollout", "gathered", []),
    ("rollout", "lockstep", []),
    ("reward", "ddp", []),
    ("reward", "lockstep", []),
    ("loss", "ddp", []),
    ("update", "ddp", []),
    ("validation", "ddp", ["--trainer.limit_val_batches", "1"]),
    ("checkpoint", "ddp", ["--trainer.enable_checkpointing", "true"]),
    ("setup", "ddp", []),
    ("train_end", "ddp", []),
]


def _strategy_args(strategy: str, folder: Path) -> list[str]:
    if strategy == "ddp":
        return ["--trainer.strategy", "ddp"]
    config = folder / "fsdp.yaml"
    config.write_text(yaml.safe_dump(FSDP))
    return ["--config", str(config), "--model.fsdp", "true", "--model.fsdp_rollout", strategy]


def _check_ended_naming_the_failure(outputs, failed_rank: int, place: str) -> None:
    """Every rank ended non-zero in time; the failed rank's output names it and the planted error, and the other
    rank's names its own rank and the first failure, the planted error (rank 0, whose process runs the store, keeps
    it as it ends until the other rank has read its record)."""
    planted = f"planted {place} failure on rank {failed_rank}"
    for rank, (code, output, seconds) in enumerate(outputs):
        tail = output[-4000:]
        assert code is not None, f"rank {rank} still ran after {DEADLINE_S} s:\n{tail}"
        assert code != 0, f"rank {rank} exited 0:\n{tail}"
        if place == "loss":  # found on every rank at once, each naming the rank whose loss was not finite
            assert f"lit_grpo: rank {rank} of 2 failed: NonFiniteStepError: non-finite GRPO loss on rank " \
                   f"{failed_rank} " in output, tail
        elif rank == failed_rank:
            assert re.search(rf"lit_grpo: rank {rank} of 2 failed: .*{planted}", output), tail
        else:  # rank 0, failing, keeps its store until the other rank read its record
            assert f"lit_grpo: rank {rank} of 2 stopped because rank {failed_rank} failed: " in output, tail
            assert planted in output, tail


@pytest.mark.parametrize("failed_rank", [0, 1])
@pytest.mark.parametrize("place, strategy, args", CASES, ids=[f"{p}-{s}" for p, s, _ in CASES])
def test_an_error_on_one_rank_ends_every_rank_naming_it(tmp_path, place, strategy, args, failed_rank):
    argv = [*RUN_ARGS, *_strategy_args(strategy, tmp_path), "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"), *args,
            "--trainer.callbacks+=fault_helpers.PlantedFault", f"--trainer.callbacks.place={place}",
            f"--trainer.callbacks.rank={failed_rank}"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S)
    _check_ended_naming_the_failure(outputs, failed_rank, place)
    if place == "loss":  # the weights never moved: no optimizer step ran on either rank
        for _, output, _ in outputs:
            assert "this optimizer step was not taken" in output


def test_an_error_restoring_a_checkpoint_or_exporting_ends_every_rank_naming_it(tmp_path):
    """The restore of ``--ckpt_path last`` failing on rank 1 (each rank loads the checkpoint itself), and
    ``ExportModel``'s write failing on rank 0 (the one that writes) while rank 1 goes on to the end of fit."""
    from lit_grpo.cli import build_cli

    two = ["--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
           "--trainer.default_root_dir", str(tmp_path / "run")]
    build_cli(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps",
               "1", "--trainer.limit_val_batches", "0", "--torch_num_threads", "1"])
    for place, rank, args in (("load", 1, ["--ckpt_path", "last", "--trainer.enable_checkpointing", "true"]),
                              ("export", 0, ["--trainer.callbacks+=lit_grpo.callbacks.ExportModel"])):
        argv = [*RUN_ARGS, *two, *args, "--trainer.max_steps", "2", "--trainer.callbacks+=fault_helpers.PlantedFault",
                f"--trainer.callbacks.place={place}", f"--trainer.callbacks.rank={rank}"]
        outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S)
        _check_ended_naming_the_failure(outputs, rank, place)


def test_a_rank_away_from_any_collective_ends_within_seconds_of_anothers_failure(tmp_path):
    """Rank 0 stays away from every collective for 300 s in its reward function (as one computing alone, or waiting
    in an NCCL collective that does not notice its peer's end) while rank 1's reward function fails: no collective
    tells rank 0, its failure watch does (lit_grpo.callbacks.RankFailureWatch), naming rank 1's error."""
    argv = [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.callbacks+=fault_helpers.PlantedFault", "--trainer.callbacks.place=reward",
            "--trainer.callbacks.rank=1", "--trainer.callbacks+=fault_helpers.Stall", "--trainer.callbacks.rank=0",
            "--trainer.callbacks.seconds=300"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S)
    _check_ended_naming_the_failure(outputs, 1, "reward")


def test_a_setting_found_bad_on_one_rank_ends_every_rank_naming_it(tmp_path):
    """A bad setting found by one rank only while the run goes (``micro_group_size: auto`` sized from that rank's
    own GPU memory) is said as a setting (exit status 2) and recorded for the others: rank 0, away from any
    collective for 300 s, ends within seconds naming it (it went on unaware, and over gloo would have named its own
    broken connection as the run's failure)."""
    argv = [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.callbacks+=fault_helpers.PlantedFault", "--trainer.callbacks.place=rollout",
            "--trainer.callbacks.rank=1", "--trainer.callbacks.setting=true",
            "--trainer.callbacks+=fault_helpers.Stall", "--trainer.callbacks.rank=0", "--trainer.callbacks.seconds=300"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S)
    _check_ended_naming_the_failure(outputs, 1, "rollout")
    code, output, _ = outputs[1]
    assert code == 2 and "error: planted rollout failure on rank 1\ntip: lit-grpo fit --help" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]  # a setting is said, not traced


def _run_session(cmd: list[str], cwd: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """Runs ``cmd`` in a session of its own to its end (its output, stderr in stdout), or fails the test where it
    still goes after ``DEADLINE_S`` (and the interpreters' start), killing the whole session."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DEADLINE_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the run still went after {time.monotonic() - started:.0f} s:\n{output[-4000:]}")
    return proc, output


def _left_in_session(pid: int, tries: int = 20) -> list[str]:
    """The processes of session ``pid`` still alive (not zombies, which are only not reaped yet), once those killed
    as it ended have had a moment to go (``tries`` looks half a second apart; 1 where the run's output pipe, open in
    every process of the session, was read to its end already)."""
    alive = []
    for _ in range(tries):
        session = subprocess.run(["ps", "-s", str(pid), "-o", "pid=,stat="], capture_output=True, text=True)
        alive = [line for line in session.stdout.splitlines() if not line.split()[1].startswith("Z")]
        if not alive:
            break
        time.sleep(0.5)
    return alive


def _launch_two(tmp_path: Path, place: str, forked: bool = False) -> str:
    """``--trainer.devices 2`` with an error planted on rank 1 at ``place``: Lightning starts rank 1 as a child of
    rank 0, re-running the command. Both end (no process of the run is left) non-zero; returns their output. With
    ``forked``, rank 0 is forked warm (tests/forked_cli.py) and only rank 1 starts an interpreter, a real
    ``lit-grpo`` process still."""
    cmd = lit_grpo_command() + [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                                "--trainer.default_root_dir", str(tmp_path / "run"),
                                "--trainer.callbacks+=fault_helpers.PlantedFault",
                                f"--trainer.callbacks.place={place}", "--trainer.callbacks.rank=1"]
    env = {**repo_env(), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    if not forked:
        proc, output = _run_session(cmd, tmp_path, env)
        code, alive = proc.returncode, _left_in_session(proc.pid, tries=1)
    else:
        log = tmp_path / "log"
        proc = forked_cli.Popen(cmd, tmp_path, env, log)
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(DEADLINE_S + 30)
            output = log.read_text()
            assert proc.poll() is not None, f"the run still went after {DEADLINE_S + 30} s:\n{output[-4000:]}"
            code, alive = proc.poll(), _left_in_session(proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0, output[-4000:]
    assert not alive, f"processes of the run still alive: {alive}"
    return output


def test_under_lightnings_own_launcher_a_childs_error_ends_the_run(tmp_path):
    """A reward error on rank 1, Lightning's child of rank 0, ends both, and rank 0 names it."""
    output = _launch_two(tmp_path, "reward")
    assert "lit_grpo: rank 1 of 2 failed: " in output and "planted reward failure on rank 1" in output, output[-4000:]


def test_under_lightnings_own_launcher_a_childs_error_before_the_ranks_connect_ends_the_run_naming_it(tmp_path):
    """An error building rank 1's callbacks (said as a setting) in Lightning's child of rank 0, before the ranks
    connect: rank 0, waiting in the process group's setup, ends within a second of its record naming it
    (Lightning's process observer would kill it a few seconds later without a word on why)."""
    output = _launch_two(tmp_path, "build", forked=True)
    planted = "ValueError: trainer.callbacks: fault_helpers.PlantedFault: planted build failure on rank 1"
    assert f"lit_grpo: rank 1 of 2 failed: {planted}; every rank stops" in output, output[-4000:]
    assert f"lit_grpo: rank 0 of 2 stopped because rank 1 failed: {planted}" in output, output[-4000:]


def test_under_lightnings_own_launcher_rank_0_failing_before_the_ranks_connect_ends_the_ranks_it_started(tmp_path):
    """``--trainer.devices 2`` whose ``MASTER_PORT`` another process holds: rank 0 fails in the process group's
    setup once it has started rank 1, and ends it as it ends, which would otherwise wait for rank 0's store until
    its own timeout (30 minutes), the run's launcher gone."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = lit_grpo_command() + [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                                    "--trainer.default_root_dir", str(tmp_path / "run")]
        env = {**repo_env(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(taken.getsockname()[1])}
        for name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE"):
            env.pop(name, None)
        log = tmp_path / "log"  # not a pipe: a rank left running would keep it open
        proc = forked_cli.Popen(cmd, tmp_path, env, log)  # rank 0 forked warm; rank 1 a real lit-grpo process
        try:
            code = proc.wait(timeout=DEADLINE_S)
            output, left = log.read_text(), _left_in_session(proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 1 and "EADDRINUSE" in output, output[-4000:]
    assert not left, f"rank 1 still ran after rank 0 ended: {left}\n{output[-4000:]}"


@pytest.mark.parametrize("failed_rank", [0, 1])
def test_a_model_missing_on_one_node_ends_every_rank_naming_it(tmp_path, failed_rank):
    """``--model.model ./m`` where ``./m`` exists on the other node only: the failing rank ends before the ranks
    connect (the setting said, exit status 2), and the other, which waited in the process group's setup until its
    timeout (30 minutes), ends within seconds naming that error: the failing rank records it in the run's store,
    which rank 0 starts itself when it is the one failing, and keeps until the other has read it."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(folders[1 - failed_rank] / "m")
    tokenizer.save_pretrained(folders[1 - failed_rank] / "m")
    argv = [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", "run", "--model.model", "./m"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S, rank_folders=folders)
    missing = "ValueError: model path './m' does not exist"
    for rank, (code, output, _) in enumerate(outputs):
        assert code is not None, f"rank {rank} still ran after {DEADLINE_S} s:\n{output[-4000:]}"
    for rank, (code, output, _) in enumerate(outputs):
        tail = output[-4000:]
        if rank == failed_rank:
            assert code == 2 and f"lit_grpo: rank {rank} of 2 failed: {missing}" in output, tail
            assert "error: model path './m' does not exist" in output and "Traceback" not in output, tail
        else:
            assert code == 1 and f"lit_grpo: rank {rank} of 2 stopped because rank {failed_rank} failed: {missing}" \
                in output, tail


@pytest.mark.parametrize("failed_rank", [0, 1])
def test_a_config_file_missing_on_one_node_ends_every_rank_naming_it(tmp_path, failed_rank):
    """``--config c.yaml`` where ``c.yaml`` exists on the other node only, under torchrun: the failing rank's
    settings cannot be read, so its place comes from torchrun's environment; it says so, records its error in the
    run's store as any rank failing before the ranks connect does, and the other rank, which would wait in the
    process group's setup until its timeout (30 minutes), ends within seconds naming it."""
    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    (folders[1 - failed_rank] / "c.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 1}}))
    argv = [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", "run", "--config", "c.yaml"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S, rank_folders=folders, torchrun_nodes=2)
    for rank, (code, output, _) in enumerate(outputs):
        assert code is not None, f"rank {rank} still ran after {DEADLINE_S} s:\n{output[-4000:]}"
    failed = f"lit_grpo: rank {failed_rank} of 2 failed: ConfigError: --config c.yaml: no such file"
    for rank, (code, output, _) in enumerate(outputs):
        tail = output[-4000:]
        if rank == failed_rank:
            assert code == 2 and failed in output and "c.yaml" in output and "Traceback" not in output, tail
            assert f"this process's place comes from its launcher's environment: rank {rank} of 2" in output, tail
        else:
            assert code == 1 and f"lit_grpo: rank {rank} of 2 stopped because rank {failed_rank} failed: " \
                "ConfigError: --config c.yaml: no such file" in output, tail


MISSING_CONFIG = "ConfigError: --config c.yaml: no such file"


def _two_nodes_with_the_config_on(node: int, tmp_path: Path) -> list[tuple[int, str]]:
    """Two nodes on localhost under Lightning's own launcher (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), each
    in a folder of its own, ``--config c.yaml`` there on ``node`` only: each node's exit status and output."""
    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    (folders[node] / "c.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 1}}))
    argv = [*RUN_ARGS, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", "run", "--config", "c.yaml"]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), DEADLINE_S, rank_folders=folders)
    for rank, (code, output, _) in enumerate(outputs):
        assert code is not None, f"node {rank} still ran after {DEADLINE_S} s:\n{output[-4000:]}"
    return [(code, output) for code, output, _ in outputs]


def test_a_config_file_missing_on_one_node_under_lightnings_launcher_ends_every_node_naming_it(tmp_path):
    """``--config c.yaml`` where ``c.yaml`` exists on node 0 only, under Lightning's own launcher of 2 nodes
    (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): node 1 knows neither the world size nor its ranks (settings
    it could not read), yet records its error in rank 0's store as node 1's, and rank 0, which would wait in the
    process group's setup until its timeout (30 minutes), ends within seconds naming node 1 and the error."""
    (code0, output0), (code1, output1) = _two_nodes_with_the_config_on(0, tmp_path)
    assert code1 == 2 and f"lit_grpo: node 1 failed: {MISSING_CONFIG}" in output1, output1[-4000:]
    assert "Traceback" not in output1, output1[-4000:]
    assert "as node 1's (for a run of one node, unset NODE_RANK)" in output1, output1[-4000:]
    assert code0 == 1 and f"lit_grpo: rank 0 of 2 stopped because node 1 failed: {MISSING_CONFIG}" in output0, \
        output0[-4000:]


def test_a_config_file_missing_on_node_0_under_lightnings_launcher_ends_every_node_naming_it(tmp_path):
    """``--config c.yaml`` where ``c.yaml`` exists on node 1 only, under Lightning's own launcher of 2 nodes: node 0,
    whose process would run rank 0's store, knows neither the world size nor its ranks, yet runs that store itself,
    records its error there as node 0's and keeps it until node 1, which would wait in the process group's setup
    until its timeout (30 minutes), has read it: node 1 ends within seconds naming node 0 and the error."""
    (code0, output0), (code1, output1) = _two_nodes_with_the_config_on(1, tmp_path)
    assert code0 == 2 and re.search(f"lit_grpo: node 0 failed: {MISSING_CONFIG} .*; every rank stops$", output0,
                                    re.M), \
        output0[-4000:]
    assert "Traceback" not in output0 and "not every node" not in output0, output0[-4000:]
    assert "its error is told to the other ranks, if any, as node 0's" in output0, output0[-4000:]
    assert code1 == 1 and f"lit_grpo: rank 1 of 2 stopped because node 0 failed: {MISSING_CONFIG}" in output1, \
        output1[-4000:]


def test_a_parse_error_with_node_rank_and_no_master_port_says_the_others_are_not_told(tmp_path):
    """``NODE_RANK`` without ``MASTER_PORT`` says no store where rank 0 would run it: the process whose settings
    cannot be read ends at once, saying that the other ranks, if any, are not told."""
    env = {**repo_env(), "NODE_RANK": "0"}
    env.pop("MASTER_PORT", None)
    ended = forked_cli.run(["fit", "--config", str(tmp_path / "c.yaml")], tmp_path, env, timeout=DEADLINE_S)
    assert ended.returncode == 2, ended.stderr[-4000:]
    assert ("this process's place in the run is unknown (NODE_RANK=0 but no world size" in ended.stderr and
            "are not told (no MASTER_PORT says where rank 0 runs the store)" in ended.stderr), ended.stderr[-4000:]


def _start_unread_node(node: int, port: int, log: Path, wait_s: float = 20.0) -> tuple[Any, float]:
    """``fault_helpers.end_unread_node`` in a process of its own (``UNKNOWN_NODES_WAIT_S`` 2 s): it and its start."""
    process = forked_cli.forkserver().Process(target=fault_helpers.end_unread_node,
                                              args=(node, port, wait_s, 2.0, str(log)))
    process.start()
    return process, time.monotonic()


def _ended(process: Any, started: float) -> tuple[int | None, float]:
    """The exit code of ``process`` (killed after 30 s: None) and the seconds it ran from ``started``."""
    process.join(max(0.0, started + 30 - time.monotonic()))
    seconds = time.monotonic() - started
    if process.is_alive():
        process.kill()
        return None, seconds
    return process.exitcode, seconds


@pytest.mark.parametrize("node_1_fails", [False, True], ids=["one-node", "every-node-fails"])
def test_node_0_failing_before_its_settings_are_read_keeps_its_store_while_nodes_read(tmp_path, node_1_fails):
    """Node 0's process under Lightning's launcher, its settings unread (the count of nodes unknown), runs rank 0's
    store with its record, and ends ``UNKNOWN_NODES_WAIT_S`` (2 s here) after its start, or after the last read: a
    run of one node, where none reads it, or one whose node 1 failed to read its settings too, which ends naming
    node 0."""
    port, logs = free_port(), (tmp_path / "node0.log", tmp_path / "node1.log")
    node_0 = _start_unread_node(0, port, logs[0])
    if node_1_fails:
        exitcode, seconds = _ended(*_start_unread_node(1, port, logs[1]))
        assert exitcode == 1 and seconds < 15, (exitcode, seconds, logs[1].read_text())
        assert ("lit_grpo: node 1 stopped because node 0 failed: PlantedError: planted failure on node 0"
                in logs[1].read_text()), logs[1].read_text()
    exitcode, seconds = _ended(*node_0)
    assert exitcode == 1 and 2 <= seconds < 25, (exitcode, seconds, logs[0].read_text())
    read = "1 read it, none knowing the run's count of nodes, then no other" if node_1_fails else "no node read it"
    assert (f"lit_grpo: node 0 failed: PlantedError: planted failure on node 0; every rank stops ({read} within 2 s: "
            "a run of one node has none") in logs[0].read_text(), logs[0].read_text()


def test_node_0_failing_before_its_settings_are_read_keeps_its_store_until_every_node_read(tmp_path):
    """A node that reads node 0's record says the run's count of nodes (3 here): node 0's process keeps its store
    until node 2 has read it too, past ``UNKNOWN_NODES_WAIT_S`` (2 s), and ends at once then."""
    import datetime

    import torch

    from lit_grpo.runtime.rank_failure import RankPlace, _prefix, _say_read

    port, log = free_port(), tmp_path / "node0.log"
    node_0, started = _start_unread_node(0, port, log)
    while True:
        with contextlib.suppress(RuntimeError):
            store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False,
                                               timeout=datetime.timedelta(seconds=5))
            if store.check([_prefix() + "1"]):
                break
        assert time.monotonic() < started + 20, log.read_text()
        time.sleep(0.2)
    _say_read(store, RankPlace(1, 3, 1, 0, 3, "127.0.0.1", port, starts_node=True))
    time.sleep(4)
    assert node_0.is_alive(), log.read_text()
    store.set(_prefix() + "read/node/2", "1")
    exitcode, seconds = _ended(node_0, time.monotonic())
    assert exitcode == 1 and seconds < 5, (exitcode, seconds, log.read_text())
    assert log.read_text().endswith("planted failure on node 0; every rank stops\n"), log.read_text()


@pytest.mark.parametrize("node", [1, 0])
def test_ctrl_c_ends_a_failed_nodes_wait_at_once_naming_its_error(tmp_path, node):
    """The process started on node 1 with ``NODE_RANK`` and ``MASTER_PORT`` (a user's leftover variables, say) whose
    settings cannot be read waits ``SETUP_WAIT_S`` for rank 0's store, which nobody may run, and node 0's keeps its
    store for the other nodes: each says Ctrl-C ends the wait, and Ctrl-C does, at once, naming the error (no
    traceback of the wait), with the error's exit status."""
    log = tmp_path / "log"
    process, started = _start_unread_node(node, free_port(), log, wait_s=60.0)
    while "(Ctrl-C ends the wait)" not in (log.read_text() if log.exists() else ""):
        assert process.is_alive() and time.monotonic() < started + 20, log.read_text()
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGINT)
    exitcode, seconds = _ended(process, time.monotonic())
    assert exitcode == 1 and seconds < 5, (exitcode, seconds, log.read_text())
    assert (f"lit_grpo: node {node} failed before the ranks connected: PlantedError: planted failure on node {node}; "
            "Ctrl-C ended its wait") in log.read_text(), log.read_text()
    assert "Traceback" not in log.read_text() and "KeyboardInterrupt" not in log.read_text(), log.read_text()


def _end_unconnected(rank: int, port: int, wait_s: float, log: Path, agent_store: bool = False
                     ) -> tuple[int | None, float]:
    """``fault_helpers.end_unconnected`` in a process of its own, killed after 30 s: its exit code and seconds."""
    process = forked_cli.forkserver().Process(target=fault_helpers.end_unconnected,
                                              args=(rank, port, wait_s, str(log), agent_store))
    started = time.monotonic()
    process.start()
    process.join(30)
    seconds = time.monotonic() - started
    if process.is_alive():
        process.kill()
    return process.exitcode, seconds


def test_a_rank_failing_before_the_ranks_connect_waits_a_bounded_time(tmp_path):
    """Rank 0, failing before the ranks connect, keeps the store it starts for a rank that never comes, and rank 1
    waits for a store that never comes: each says what it waits for, waits ``SETUP_WAIT_S`` (2 s here), then ends
    saying so."""
    log = tmp_path / "log"
    ends = {0: "lit_grpo: rank 0 of 2 failed: PlantedError: planted failure on rank 0; every rank stops (not every "
               "rank read it within 2 s: those end at their process group's timeout)",
            1: "lit_grpo: rank 1 of 2 failed before the ranks connected: PlantedError: planted failure on rank 1; "
               "no store came at 127.0.0.1:"}
    for rank, end in ends.items():
        exitcode, seconds = _end_unconnected(rank, free_port(), 2.0, log)
        assert exitcode == 1 and 2 <= seconds < 30, (exitcode, seconds, log.read_text())
        assert end in log.read_text(), log.read_text()
        waits = "the other ranks to read its record" if rank == 0 else "rank 0's store at 127.0.0.1:"
        assert (f"lit_grpo: rank {rank} of 2 failed before the ranks connected: PlantedError: planted failure on rank "
                f"{rank}; it waits up to 2 s for {waits}") in log.read_text(), log.read_text()  # said before it waits


@pytest.mark.parametrize("agent_store", [False, True], ids=["another-run", "torchrun"])
def test_rank_0_failing_before_the_ranks_connect_records_only_in_its_own_runs_store(tmp_path, agent_store):
    """Rank 0 whose port another process holds, as another run's rank 0 does where two runs were given one
    ``MASTER_PORT`` on one node, fails before the ranks connect: it ends at once saying so and records nothing
    there (that run's ranks would end on the record as on their own failure). Under torchrun, whose agent runs the
    store that every rank joins, it records its error there."""
    import datetime

    import torch

    from lit_grpo.runtime.rank_failure import _prefix

    port, log = free_port(), tmp_path / "log"
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=5))
    exitcode, seconds = _end_unconnected(0, port, 20.0, log, agent_store)
    assert exitcode == 1 and seconds < 15, (exitcode, seconds, log.read_text())
    assert store.check([_prefix() + "count"]) == agent_store, log.read_text()
    planted = "PlantedError: planted failure on rank 0"
    end = (f"lit_grpo: rank 0 of 2 failed: {planted}; every rank stops" if agent_store else
           f"lit_grpo: rank 0 of 2 failed before the ranks connected: {planted}; its port 127.0.0.1:{port} is "
           "another process's (another run's store?), left alone")
    assert end in log.read_text(), log.read_text()


def test_a_rank_whose_process_group_setup_times_out_ends_at_once(tmp_path):
    """Rank 0 of 2 nodes whose rank 1 never comes: the process group's setup times out (5 s here, 30 minutes by
    default) and rank 0 ends then, naming the timeout. That error is the connecting's own, not this rank's alone:
    recorded in a store it would keep ``SETUP_WAIT_S`` for the rank that never came."""
    config = tmp_path / "ddp.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"timeout": "0:00:05"}}}}))
    argv = [*RUN_ARGS, "--config", str(config), "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.default_root_dir", str(tmp_path / "run")]
    env = {**repo_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0",
           "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    ended = forked_cli.run(argv, tmp_path, env, timeout=DEADLINE_S)
    assert ended.returncode == 1, ended.stderr[-4000:]
    assert "DistStoreError: Timed out after" in ended.stderr and "1/2 clients joined" in ended.stderr, \
        ended.stderr[-4000:]
    assert "lit_grpo: rank 0 of 2" not in ended.stderr, ended.stderr[-4000:]


_LAUNCH_ENV = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK", "SLURM_NTASKS",
               "SLURM_PROCID", "SLURM_JOB_NAME", "MASTER_PORT")


@pytest.mark.parametrize("env, trainer, place", [
    ({"NODE_RANK": "1"}, {"num_nodes": 2, "devices": 1}, (1, 2, True, True)),  # a node's launcher, another node
    ({}, {"devices": 2, "strategy": "ddp"}, (0, 2, True, False)),  # one node's launcher: its ranks not started yet
    ({"NODE_RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, {"num_nodes": 2, "devices": 2}, (3, 4, False, True)),
    ({"RANK": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
     {"num_nodes": 2, "devices": 2}, (2, 4, False, True)),  # torchrun
    ({}, {"devices": 1}, None),
    ({"NODE_RANK": "1"}, {"num_nodes": 2, "devices": 0}, None),  # a Trainer refuses it: every rank fails alike
], ids=["other-node", "one-node", "launched", "torchrun", "one-process", "refused"])
def test_a_rank_finds_its_place_before_the_ranks_connect(monkeypatch, env, trainer, place):
    """``planned_place``: the rank, world size, whether this process starts its node's other ranks and whether
    other ranks exist or will, as the Trainer would set them from these settings and the launcher's environment."""
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.utilities import rank_zero

    from lit_grpo.cli.run_errors import planned_place

    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**env, "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)
    for module in (rank_zero, fabric_rank_zero):  # the strategy sets the process's rank for rank-zero logging
        monkeypatch.setattr(module.rank_zero_only, "rank", getattr(module.rank_zero_only, "rank", 0))
    found = planned_place({"accelerator": "cpu", **trainer})
    assert (found if found is None else (found.rank, found.world, found.starts_node, found.others_wait)) == place
    if found is not None:
        assert found.port == 29511


@pytest.mark.parametrize("env, place", [
    ({"RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
      "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}, (3, 4, 1, 2, "10.0.0.1", 29511)),
    ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NODELIST": "node[7-8]", "SLURM_JOB_NAME": "train",
      "MASTER_PORT": "29511"}, (2, 4, 1, 2, "node7", 29511)),
    ({"NODE_RANK": "1", "MASTER_PORT": "29511"}, None),  # Lightning's launcher: the world size is a setting
    ({"NODE_RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29511"}, None),  # a rank it started
    ({"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1",
      "TORCHELASTIC_RUN_ID": "x"}, None),  # one process
], ids=["torchrun", "slurm", "lightning", "lightning-child", "one-process"])
def test_a_rank_whose_settings_cannot_be_read_finds_its_place_in_its_launchers_environment(monkeypatch, env, place):
    """``launched_place``: rank, world size, node, nodes and the run's store, from torchrun's or SLURM's variables;
    ``launched_node``: under Lightning's own launcher only the node, for the process started on it (not for a rank
    the launcher started, nor under torchrun or SLURM)."""
    from lit_grpo.runtime.rank_failure import launched_node, launched_place

    for name in (*_LAUNCH_ENV, "TORCHELASTIC_RUN_ID", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID", "SLURM_NODEID",
                 "SLURM_NNODES", "SLURM_NODELIST", "MASTER_ADDR"):
        monkeypatch.setenv(name, "")  # so that it is put back: SLURM's MASTER_ADDR is set as it is read
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = launched_place()
    assert (found if found is None else (found.rank, found.world, found.node, found.nodes, found.address,
                                         found.port)) == place
    assert found is None or found.others_wait
    assert launched_node() == (1 if "NODE_RANK" in env and "LOCAL_RANK" not in env else None)


@pytest.mark.parametrize("rank0", ["stalls", "reduces"])
def test_in_a_lightning_script_of_its_own_an_error_on_one_rank_ends_every_rank_naming_it(tmp_path, rank0):
    """A plain Lightning script with ``RankFailureWatch`` (no ``lit-grpo``: tests/plain_ddp_failure.py), whose rank
    1 raises in ``training_step`` while rank 0 stays away from any collective for 300 s (only the record in the
    store can tell it), or reduces the step's gradients: both end, rank 0 naming rank 1's error, rank 1 once the
    callback after the watch has seen its error."""
    script = str(Path(__file__).parent / "plain_ddp_failure.py")
    outputs = forked_cli.run_ranks([str(tmp_path / "run"), rank0], tmp_path, free_port(), DEADLINE_S,
                                   env=repo_env(), script=script)
    for rank, (code, output, _) in enumerate(outputs):
        assert code is not None, f"rank {rank} still ran after {DEADLINE_S} s:\n{output[-4000:]}"
        assert code == 1, f"rank {rank} exited {code}:\n{output[-4000:]}"
    planted = "PlantedError: planted failure on rank 1"
    assert f"lit_grpo: rank 1 of 2 failed: {planted}; every rank stops" in outputs[1][1], outputs[1][1][-4000:]
    # the callback after the watch saw the error before the rank ended
    seen = outputs[1][1].find("on_exception after the watch: PlantedError")
    assert 0 <= seen < outputs[1][1].find("lit_grpo: rank 1 of 2 failed"), outputs[1][1][-4000:]
    assert f"lit_grpo: rank 0 of 2 stopped because rank 1 failed: {planted}" in outputs[0][1], outputs[0][1][-4000:]


@pytest.mark.parametrize("kind", ["failure", "under lit-grpo", "KeyboardInterrupt", "StopRequested", "SystemExit",
                                  "RankFailed", "RaisedOnEveryRank", "RankFailed under lit-grpo"])
def test_rank_failure_watch_records_the_ranks_own_failures_only(monkeypatch, kind):
    """``on_exception`` under several processes records the rank's own error and has the rank end where the error
    leaves the script, as it has a rank told of another's failure (which names it); not on a stop or an error every
    rank raised, nor under ``lit-grpo``, whose error path does it (recording the error once): there it only says
    that the rank handles its own failure."""
    from lit_grpo.callbacks import rank_failure_watch
    from lit_grpo.runtime.distributed import RaisedOnEveryRank, RankFailed
    from lit_grpo.runtime.rank_failure import ended_by_caller
    from lit_grpo.runtime.stop_signal import StopRequested

    errors = {"failure": ValueError("boom"), "under lit-grpo": ValueError("boom"), "KeyboardInterrupt":
              KeyboardInterrupt(), "StopRequested": StopRequested(signal.SIGTERM), "SystemExit": SystemExit(1),
              "RankFailed": RankFailed([0], "in a rollout"),
              "RaisedOnEveryRank": RaisedOnEveryRank("non-finite loss on rank 1"),
              "RankFailed under lit-grpo": RankFailed([0], "in a rollout")}
    recorded, ending, said = [], [], []
    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    monkeypatch.setattr(rank_failure_watch, "record_failure",
                        lambda error, handling=False: recorded.append(error) or "its line")
    monkeypatch.setattr(rank_failure_watch, "end_at_uncaught_error", lambda line, **shown: ending.append(line))
    monkeypatch.setattr(rank_failure_watch, "say_handling", lambda: said.append("handling"))
    with ended_by_caller() if kind.endswith("under lit-grpo") else contextlib.nullcontext():
        rank_failure_watch.RankFailureWatch().on_exception(SimpleNamespace(loggers=[]), None, errors[kind])
    ends = kind in ("failure", "RankFailed")  # RankFailed: no record of its own (record_failure reads the first)
    assert recorded == ([errors[kind]] if ends else [])
    assert ending == (["its line"] if ends else [])
    assert said == (["handling"] if kind == "under lit-grpo" else [])


def test_rank_failure_watch_ends_the_rank_after_lightnings_handling(tmp_path, monkeypatch):
    """A rank's own error in a plain Lightning fit: recorded at once, then every callback after the watch sees it
    and the loggers write their last, and the rank ends only where the error leaves the script, after the hook
    that shows its traceback."""
    from callback_helpers import TinyRegression
    from lightning.pytorch.loggers import CSVLogger

    from lit_grpo.callbacks import RankFailureWatch, rank_failure_watch
    from lit_grpo.runtime import rank_failure

    events = []

    class Planted(TinyRegression):
        def training_step(self, batch, batch_idx):
            raise fault_helpers.PlantedError("planted failure")

    class Closing(pl.Callback):  # a user's callback after the watch: closes a file, logs the error
        def on_exception(self, trainer, pl_module, exception):
            events.append("closed")

    class Finalizing(CSVLogger):
        def finalize(self, status):
            events.append(f"finalized {status}")
            super().finalize(status)

    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    monkeypatch.setattr(rank_failure_watch, "record_failure",
                        lambda error, handling=False: events.append(f"recorded, handling: {handling}") or "its line")
    monkeypatch.setattr(rank_failure_watch, "end_failed_rank", lambda error: events.append("ended"), raising=False)
    monkeypatch.setattr(rank_failure, "_end",
                        lambda line, exit_status=1, after_handling=True: events.append(f"ended: {line}"))
    monkeypatch.setattr(sys, "excepthook", lambda *error: events.append("traceback"))  # restored after the test
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accelerator="cpu", logger=Finalizing(tmp_path),
                         callbacks=[RankFailureWatch(), Closing()], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(fault_helpers.PlantedError) as caught:
        trainer.fit(Planted())
    assert events == ["recorded, handling: True", "closed", "finalized failed"]
    sys.excepthook(caught.type, caught.value, caught.tb)  # the error leaves the script
    assert events[3:] == ["traceback", "ended: its line"]


class _StopsAtItsSecondStep(pl.Callback):
    """Ends the fit at its second step the way ``stop`` says: Lightning's ``should_stop`` (as EarlyStopping),
    a ``KeyboardInterrupt`` or a ``StopRequested`` (a signal's stop outside the CLI)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.watched = False  # whether a failure watch ran during the fit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lit_grpo.runtime.rank_failure import watching

        self.watched = self.watched or watching()
        if batch_idx == 1:
            if self.stop == "should_stop":
                trainer.should_stop = True
            elif self.stop == "KeyboardInterrupt":
                raise KeyboardInterrupt
            else:
                from lit_grpo.runtime.stop_signal import StopRequested

                raise StopRequested(signal.SIGTERM)


@pytest.mark.parametrize("stop", ["should_stop", "KeyboardInterrupt", "StopRequested"])
def test_rank_failure_watch_leaves_no_thread_after_a_stopped_fit(tmp_path, monkeypatch, stop):
    """A fit of several processes (stood in for: a place, and a store nobody runs) stopped outside the CLI ends
    its failure watch: no thread asks the store once the fit is over."""
    import threading

    from callback_helpers import TinyRegression

    from lit_grpo.callbacks import RankFailureWatch, rank_failure_watch
    from lit_grpo.runtime.rank_failure import RankPlace

    place = RankPlace(rank=0, world=2, node=0, local=0, nodes=2, address="127.0.0.1", port=free_port(),
                      starts_node=False)
    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    monkeypatch.setattr(rank_failure_watch, "rank_place", lambda strategy: place)
    stops = _StopsAtItsSecondStep(stop)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=4, accelerator="cpu", logger=False,
                         callbacks=[RankFailureWatch(), stops], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C once it handles a KeyboardInterrupt
    try:
        with contextlib.nullcontext() if stop == "should_stop" else pytest.raises(SystemExit):
            trainer.fit(TinyRegression())
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert trainer.global_step == 2 and stops.watched
    watches = [thread for thread in threading.enumerate() if thread.name == "lit-grpo-failure-watch"]
    for thread in watches:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in watches)


def _fork_state(connection) -> None:
    """In a forked child: whether a watch runs, the CLI's error path ends failing ranks and this process is ending."""
    from lit_grpo.runtime import rank_failure

    connection.send((rank_failure.watching(), rank_failure.caller_ends_failed_ranks(), rank_failure._ending.is_set()))


def test_a_forked_rank_starts_with_no_watch_and_none_of_its_parents_flags():
    """Under ``ddp_fork`` the ranks are forks of the process that started its watch inside the CLI's error path
    (``ended_by_caller``): a child taking the parent's watch for its own would start none (its thread does not
    survive the fork), and a child taking the parent's error path would leave a failure unrecorded."""
    import multiprocessing

    from lit_grpo.runtime import rank_failure
    from tools.harness import free_port

    context = multiprocessing.get_context("fork")
    place = rank_failure.RankPlace(0, 2, 0, 0, 1, "127.0.0.1", free_port(), True)
    stop = rank_failure.watch_failures(place, interval_s=60)
    ending = rank_failure._ending
    try:
        with rank_failure.ended_by_caller():
            ending.set()
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=_fork_state, args=(sender,))
            child.start()
            state = receiver.recv() if receiver.poll(30) else None
            child.join(30)
    finally:
        ending.clear()
        stop.set()
    assert state == (False, False, False)


_CATCHING_SCRIPT = """
import subprocess, sys
import lightning.pytorch as pl
from callback_helpers import TinyRegression
from lit_grpo.callbacks import RankFailureWatch, rank_failure_watch
from lit_grpo.runtime.distributed import RankFailed

kind, processes = sys.argv[3:5] or ["failure", "several"]
if processes == "several":
    rank_failure_watch.is_multi_process = lambda: True  # a rank of several (its store stood in for)
    rank_failure_watch.record_failure = lambda error, handling=False: (
        "rank 1 of 2 failed: its error; every rank stops" if kind == "failure" else
        "rank 1 of 2 stopped because rank 0 failed: its error")

class Planted(TinyRegression):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("planted failure") if kind == "failure" else RankFailed([0], "in a rollout")

node_rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],  # a rank it started
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"started {node_rank.pid}", flush=True)
trainer = pl.Trainer(default_root_dir=sys.argv[1], max_steps=2, accelerator="cpu", logger=False,
                     callbacks=[RankFailureWatch()], enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
try:
    trainer.fit(Planted())
except RuntimeError as error:
    print(f"caught {type(error).__name__}: {error}", flush=True)
    if sys.argv[2] == "exits":
        sys.exit(0)
print("the script ends", flush=True)
"""


@pytest.mark.parametrize("then", ["ends", "exits"])
def test_a_failed_rank_whose_script_catches_the_error_ends_where_the_script_exits(tmp_path, then):
    """A script of its own that catches the fit's error (and ends, or calls ``sys.exit(0)`` in its ``except``)
    never hands it to ``sys.excepthook``: the rank still ends once the script is done, with exit status 1 and its
    line, and ends the ranks it started, which may have missed the record (its store goes with this process)."""
    env = repo_env(PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), repo_env()["PYTHONPATH"]]))
    done = subprocess.run([sys.executable, "-c", _CATCHING_SCRIPT, str(tmp_path), then], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert "caught RuntimeError: planted failure" in done.stdout, done.stderr[-4000:]
    assert ("the script ends" in done.stdout) == (then == "ends")
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-4000:])
    assert "lit_grpo: rank 1 of 2 failed: its error; every rank stops" in done.stderr, done.stderr[-4000:]
    started = int(re.search(r"started (\d+)", done.stdout).group(1))
    deadline = time.monotonic() + 10
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(started)
    if alive:
        os.kill(started, signal.SIGKILL)
    assert not alive, "the rank it started outlived it"


@pytest.mark.parametrize("kind, processes, code", [("RankFailed", "several", 1), ("failure", "one", 0)])
def test_a_script_that_catches_the_fits_error_and_exits_0(tmp_path, kind, processes, code):
    """Under several processes a rank told that another failed (``RankFailed``) must not report success, whatever
    its script does with the error: it ends with exit status 1 and its line where the script exits, not through the
    interpreter's exit (whose handlers could wait on the other ranks). One process keeps the script's exit status."""
    env = repo_env(PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), repo_env()["PYTHONPATH"]]))
    done = subprocess.run([sys.executable, "-c", _CATCHING_SCRIPT, str(tmp_path), "exits", kind, processes], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert f"caught {'RankFailed' if kind == 'RankFailed' else 'RuntimeError'}" in done.stdout, done.stderr[-4000:]
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr[-4000:])
    assert ("lit_grpo: rank 1 of 2 stopped because rank 0 failed" in done.stderr) == (code == 1), done.stderr[-4000:]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_failed_rank_shows_its_traceback_before_the_others_can_end_it(tmp_path, monkeypatch, capsys):
    """The others may end a failed rank as soon as they read its record (on one node under Lightning's launcher,
    rank 0 ends the ranks it started, and its observer ends rank 0 once one of them has), before the error leaves
    the script: its traceback is shown before the record, and not again by the interpreter's hook."""
    from callback_helpers import TinyRegression

    from lit_grpo.callbacks import RankFailureWatch, rank_failure_watch
    from lit_grpo.runtime import rank_failure

    shown_at_record, ended = [], []

    class Planted(TinyRegression):
        def training_step(self, batch, batch_idx):
            raise fault_helpers.PlantedError("planted failure")

    def record(error, handling=False):
        shown_at_record.append("PlantedError: planted failure" in capsys.readouterr().err)
        return "its line"

    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    monkeypatch.setattr(rank_failure_watch, "record_failure", record)
    monkeypatch.setattr(rank_failure, "_end", lambda line, exit_status=1, after_handling=True: ended.append(line))
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # the interpreter's own; restored after the test
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, accelerator="cpu", logger=False,
                         callbacks=[RankFailureWatch()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(fault_helpers.PlantedError) as caught:
        trainer.fit(Planted())
    assert shown_at_record == [True]
    sys.excepthook(caught.type, caught.value, caught.tb)  # the error leaves the script
    assert ended == ["its line"] and "PlantedError" not in capsys.readouterr().err


def _store_of_a_run(monkeypatch):
    """A run's store (this process runs it, as rank 0's does) at ``MASTER_ADDR``, ``MASTER_PORT``, and this process
    as a rank that has not failed, ended or waited yet; returns the store and its keys' prefix."""
    import datetime

    import torch

    from lit_grpo.runtime import rank_failure

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(rank_failure, "_handling", None)
    monkeypatch.setattr(rank_failure, "_grace_end", None)
    monkeypatch.setattr(rank_failure, "_ending", rank_failure.threading.Event())
    return store, rank_failure._prefix()


def _handling_counts(store, prefix: str) -> tuple[int, int]:
    """How many ranks said they handle their failure, and how many of those said they are done."""
    return store.add(f"{prefix}handling", 0), store.add(f"{prefix}handled", 0)


def test_a_store_gone_between_the_probe_and_the_clients_connect_is_given_up_within_seconds(monkeypatch):
    """The run's store may end (with rank 0, ending on its error) between ``_connect_store``'s plain probe of its port
    and its store client's connect, where torch's client retries the refused port until its timeout and then once
    more after a delay: a rank ending after rank 0 (its ``say_handling``) would wait there. It gives up within
    ``STORE_CONNECT_TIMEOUT_S`` and that one retry; a client of a store that is there keeps ``STORE_TIMEOUT_S`` for
    its waits."""
    import datetime

    import torch

    from lit_grpo.runtime import rank_failure

    store = torch.distributed.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    client = rank_failure._connect_store(("127.0.0.1", store.port))
    assert client.timeout == datetime.timedelta(seconds=rank_failure.STORE_TIMEOUT_S)
    monkeypatch.setattr(rank_failure.socket, "create_connection", lambda *_, **__: SimpleNamespace(close=lambda: None))
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # torch's DistNetworkError: nothing listens on the port
        rank_failure._connect_store(("127.0.0.1", free_port()))
    assert time.monotonic() - started < 4.0


def test_a_rank_that_read_a_failure_waits_while_every_failed_rank_handles_it(monkeypatch):
    """Ranks whose failures are recorded while they go on handling them (``RankFailureWatch``: the later callbacks'
    ``on_exception``, the loggers' last write) say so; another rank's watch that reads the first record waits,
    before it ends, until every such handling is done (bounded by ``HANDLING_GRACE_S`` in all): on one node under
    Lightning's launcher its end would end the failed ranks too. Rank 1's and then rank 2's handling end from inside
    the watch's waits, so a watch that waited for the first failed rank only ends during rank 2's handling."""
    from lit_grpo.runtime import rank_failure

    store, prefix = _store_of_a_run(monkeypatch)
    events = []

    def wait(seconds):  # the watch waits: one failed rank's handling is over now (rank_failure._end)
        events.append("waited")
        store.add(f"{prefix}handled", 1)

    monkeypatch.setattr(rank_failure, "HANDLING_GRACE_S", 120.0)
    monkeypatch.setattr(rank_failure, "time", SimpleNamespace(monotonic=time.monotonic, sleep=wait))
    monkeypatch.setattr(rank_failure, "_end_child_processes", lambda: events.append(
        ("ended", "after every handling" if _handling_counts(store, prefix) == (2, 2) else "during a handling")))
    monkeypatch.setattr(rank_failure.os, "_exit", lambda status: events.append(f"exit {status}"))
    store.add(f"{prefix}handling", 2)  # ranks 1 and 2 failed and handle their errors: record_failure(..., True)
    rank_failure._record_in(store, 1, fault_helpers.PlantedError("planted failure"))
    rank_failure._record_in(store, 2, fault_helpers.PlantedError("planted failure"))
    place = rank_failure.RankPlace(0, 3, 0, 0, 1, "127.0.0.1", int(os.environ["MASTER_PORT"]), True)
    stop = rank_failure.watch_failures(place, interval_s=0.05)
    try:
        deadline = time.monotonic() + 30
        while not any(str(event).startswith("exit") for event in events) and time.monotonic() < deadline:  # its end
            time.sleep(0.05)
    finally:
        stop.set()
    assert events == ["waited", "waited", ("ended", "after every handling"), "exit 1"]


@pytest.mark.parametrize("own_end", [True, False], ids=["own-path-ends-it", "own-path-stalls"])
def test_a_rank_handling_its_own_error_is_ended_by_its_own_path_not_by_its_watch(monkeypatch, own_end):
    """Two ranks fail at once (one bad setting seen by both): this rank says it handles its own error
    (``say_handling``) while its watch reads the other's record. The watch leaves the end to this rank's own error
    path, which ends it with that error's exit status (a bad setting's 2), rather than ending it with 1 first; it
    ends the rank itself only where that path has not begun its end within ``HANDLING_GRACE_S``."""
    from lit_grpo.runtime import rank_failure

    store, prefix = _store_of_a_run(monkeypatch)
    events = []
    monkeypatch.setattr(rank_failure, "HANDLING_GRACE_S", 0.5)
    monkeypatch.setattr(rank_failure, "_end_child_processes", lambda: None)
    def exit(status):  # os._exit: the watch's thread ends here
        events.append(f"exit {status}")
        raise SystemExit(status)

    monkeypatch.setattr(rank_failure.os, "_exit", exit)
    rank_failure.say_handling()  # this rank (0) handles its own error
    rank_failure._record_in(store, 1, fault_helpers.PlantedError("planted failure"))
    store.add(f"{prefix}handled", 1)  # rank 1's handling is over: it ended
    place = rank_failure.RankPlace(0, 2, 0, 0, 1, "127.0.0.1", int(os.environ["MASTER_PORT"]), True)
    stop = rank_failure.watch_failures(place, interval_s=0.05)
    try:
        if own_end:
            time.sleep(0.2)  # the watch has read rank 1's record and waits on this rank's own path
            rank_failure._ending.set()  # end_failed_rank begins this rank's end (exit status 2 for a bad setting)
        time.sleep(1.5)
    finally:
        stop.set()
    assert events == ([] if own_end else ["exit 1"])


def test_a_failed_rank_says_its_handling_is_done_as_it_ends(monkeypatch, capsys):
    """``record_failure(..., handling=True)`` says in the store that the rank handles its error, and its end says that
    it is done (once its last line is out: the others may end it from then on), so the others wait no longer."""
    import torch

    from lit_grpo.runtime import rank_failure

    store, prefix = _store_of_a_run(monkeypatch)
    said = []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(rank_failure, "_end_child_processes", lambda: None)
    monkeypatch.setattr(rank_failure.os, "_exit", lambda status: None)
    line = rank_failure.record_failure(fault_helpers.PlantedError("planted failure"), handling=True)
    assert line == "rank 1 of 2 failed: PlantedError: planted failure; every rank stops"
    rank_failure.say_handling()  # said once, however often asked
    assert _handling_counts(store, prefix) == (1, 0)
    say_handled = rank_failure._say_handled
    monkeypatch.setattr(rank_failure, "_say_handled", lambda: (said.append(capsys.readouterr().err), say_handled()))
    rank_failure._end(line)
    assert _handling_counts(store, prefix) == (1, 1)
    assert said == [f"lit_grpo: {line}\n"]


@pytest.mark.parametrize("recorded_after_s", [7.0, None], ids=["record-within-the-grace", "no-record"])
def test_under_lit_grpo_a_rank_told_of_a_failure_ends_once_the_failed_rank_has_handled_it(monkeypatch, capsys,
                                                                                          recorded_after_s):
    """Under ``lit-grpo`` the failed rank's ``on_exception`` only says that it handles its error (the CLI records
    it as the rank ends); a rank told of the failure (``RankFailed``) ends from the CLI's error path
    (``end_failed_rank``) only once that handling is over, naming the error: its end may end the failed rank too
    (one node under Lightning's launcher). A handling longer than the store's timeout (``STORE_TIMEOUT_S``) still
    has its record quoted where it comes within ``HANDLING_GRACE_S``; where none comes, the line says that the
    failed rank's output names the error, and the end waits no longer (one bound for both waits). The clock is the
    waits' own: the failed rank's handling ends from inside the told rank's waits, whatever the timing."""
    import torch

    from lit_grpo.callbacks import rank_failure_watch
    from lit_grpo.runtime import rank_failure
    from lit_grpo.runtime.distributed import RankFailed

    store, prefix = _store_of_a_run(monkeypatch)
    clock, events = [0.0], []
    error = fault_helpers.PlantedError("planted failure")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    # rank 1 fails: its on_exception under the CLI says it handles its error and records nothing yet
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    with rank_failure.ended_by_caller():
        rank_failure_watch.RankFailureWatch().on_exception(SimpleNamespace(loggers=[]), None, error)
    assert _handling_counts(store, prefix) == (1, 0) and not store.check([f"{prefix}count"])

    def wait(seconds):  # rank 0 waits; rank 1's handling ends after recorded_after_s of it (rank_failure._end)
        clock[0] += seconds
        if recorded_after_s is not None and clock[0] >= recorded_after_s and not events:
            rank_failure._record_in(store, 1, error)  # the CLI's record as rank 1 ends
            store.add(f"{prefix}handled", 1)
            events.append(f"rank 1 handled its error after {recorded_after_s:.0f} s")

    # rank 0, told of it by a collective, ends from the CLI's error path
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(rank_failure, "_handling", None)
    monkeypatch.setattr(rank_failure, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=wait))
    monkeypatch.setattr(rank_failure, "_end_child_processes", lambda: events.append("ended the ranks it started"))
    monkeypatch.setattr(rank_failure.os, "_exit", lambda status: events.append(f"exit {status}"))
    rank_failure.end_failed_rank(RankFailed([1], "inside the lockstep rollout"), show_traceback=False)
    stopped = "lit_grpo: rank 0 of 2 stopped because rank 1 failed: "
    if recorded_after_s is None:
        assert events == ["ended the ranks it started", "exit 1"]
        assert clock[0] == pytest.approx(rank_failure.HANDLING_GRACE_S, abs=0.2)
        assert f"{stopped}its output names the error" in capsys.readouterr().err
    else:
        assert events == ["rank 1 handled its error after 7 s", "ended the ranks it started", "exit 1"]
        assert f"{stopped}PlantedError: planted failure" in capsys.readouterr().err


def test_a_rank_told_of_a_failure_ends_once_the_failed_rank_has_handled_it(monkeypatch):
    """A rank that raised ``RankFailed`` (told by a collective, before its watch read the store) ends where the
    error leaves the script; that end, which may end the failed rank too (one node under Lightning's launcher),
    first waits while the failed rank still handles its error, as every end does. That handling ends from inside
    the end's first wait, so an end that did not wait comes before it, whatever the timing."""
    from lit_grpo.callbacks import rank_failure_watch
    from lit_grpo.runtime import rank_failure
    from lit_grpo.runtime.distributed import RankFailed

    store, prefix = _store_of_a_run(monkeypatch)
    events = []

    def wait(seconds):  # the end waits: rank 1's handling is over now (rank_failure._end)
        events.append("waited")
        store.add(f"{prefix}handled", 1)

    monkeypatch.setattr(rank_failure_watch, "is_multi_process", lambda: True)
    monkeypatch.setattr(rank_failure_watch, "record_failure",
                        lambda error, handling=False: "rank 0 of 2 stopped because rank 1 failed: its error")
    monkeypatch.setattr(rank_failure, "time", SimpleNamespace(monotonic=time.monotonic, sleep=wait))
    monkeypatch.setattr(rank_failure, "_end_child_processes", lambda: events.append("ended the ranks it started"))
    monkeypatch.setattr(rank_failure.os, "_exit", lambda status: events.append(f"exit {status}"))
    monkeypatch.setattr(sys, "excepthook", lambda *error: None)  # restored after the test
    monkeypatch.setattr(rank_failure, "atexit", SimpleNamespace(register=lambda *end: None))  # not pytest's exit
    store.add(f"{prefix}handling", 1)  # rank 1 handles its error: record_failure(..., handling=True)
    error = RankFailed([1], "inside the lockstep rollout")
    rank_failure_watch.RankFailureWatch().on_exception(SimpleNamespace(loggers=[]), None, error)
    sys.excepthook(RankFailed, error, None)  # the error leaves the script
    assert events == ["waited", "ended the ranks it started", "exit 1"]


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_under_lightnings_own_launcher_two_ranks_failing_at_once_each_finish_handling_their_error(tmp_path,
                                                                                                   slow_rank):
    """A plain Lightning script with ``RankFailureWatch`` on one node x 2 processes under Lightning's own launcher
    (tests/plain_ddp_failures_at_once.py), whose ranks both fail in one step, one of them taking 7 s in a later
    callback's ``on_exception``: the other, done first, waits for that handling before it ends, since its end
    would end the slow one (rank 0 ends the ranks it started as it ends; its process observer, polling every 5 s,
    ends rank 0 once rank 1 has ended). Both handle their error and print their line; no process is left."""
    script = str(Path(__file__).parent / "plain_ddp_failures_at_once.py")
    env = {**repo_env(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    for name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    # rank 0 forked warm (its interpreter's start is the real launches' above to show); rank 1, which Lightning's
    # launcher starts from it, a real interpreter of the script
    log = tmp_path / "log"
    proc = forked_cli.start_script(script, [str(tmp_path / "run"), str(slow_rank), "7"], tmp_path, env, log)
    try:
        proc.join(DEADLINE_S + 30)
        output = log.read_text()
        assert not proc.is_alive(), f"the run still went after {DEADLINE_S + 30} s:\n{output[-4000:]}"
        alive = _left_in_session(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
    tail = output[-4000:]
    assert proc.exitcode != 0, tail
    for rank in (0, 1):
        assert f"rank {rank} handled its PlantedError" in output, tail
        line = rf"lit_grpo: rank {rank} of 2 (failed: |stopped because rank \d failed: )PlantedError"
        assert re.search(line, output), tail
    assert not alive, f"processes of the run still alive: {alive}"
