"""FSDP2 on 2 CPU processes (gloo) where the ranks' rollouts differ in length.

A sharded policy all-gathers each layer's shards in every forward, so a rank whose rollout ends early would leave the
others waiting in a collective: the engine refuses one outside the two scopes below. ``GatheredWeights`` gathers the
full weights once per rollout and decodes on an unsharded copy (no collective inside the loop); ``LockstepWeights``
keeps a finished rank answering until every rank is done. Both must finish with the forced lengths and sample what the
unsharded model samples, and a whole ``lit-grpo fit`` under FSDP2, with a model whose samples end at different steps,
must train as ddp does.
"""

import datetime
import os

import forked_cli
import pytest
import torch
import yaml
from two_process_helpers import fit_two_processes

from tools.harness import free_port

#: Forced completion lengths per rank: rank 0 ends after 2 tokens, rank 1 runs 12.
LENGTHS = {0: [[2, 2]], 1: [[12, 12]]}
PROMPTS = {0: [[5, 6, 7]], 1: [[8, 9, 10, 11]]}


def _unequal_rollout(rank: int, mode: str, port: int, results) -> None:
    """One rank: shard tiny-llama over 2 processes, generate with this rank's forced lengths."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_grpo.runtime.distributed import (GatheredWeights, LockstepWeights, RankFailed, meta_replica,
                                              shard_decoder_layers)
    from lit_grpo.runtime.models import load_model_and_tokenizer
    from lit_grpo.sampling import RolloutEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    try:
        settings = dict(group_size=2, micro_group_size=2, strategy="continuous", max_new_tokens=16, seed=0)
        plain, tokenizer = load_model_and_tokenizer("tiny-llama")
        reference = RolloutEngine(plain, tokenizer, **settings)
        expected = [reference.generate(PROMPTS[rank], lengths=LENGTHS[rank]).completion_ids for _ in range(2)]
        model, _ = load_model_and_tokenizer("tiny-llama")
        skeleton = meta_replica(model)
        shard_decoder_layers(model, init_device_mesh("cpu", (2,)))
        weights = GatheredWeights(model, skeleton, torch.float32) if mode == "gathered" else LockstepWeights(model)
        try:  # the bare engine on the shards, outside both scopes: refused before any collective
            RolloutEngine(model, tokenizer, **settings).generate(PROMPTS[rank], lengths=LENGTHS[rank])
            refused = ""
        except ValueError as error:
            refused = str(error)
        engine = RolloutEngine(weights.module, tokenizer, **settings)
        completions = []
        for _ in range(2):  # a second rollout: the gathered copy is freed and gathered again
            with torch.no_grad(), weights.active():
                completions.append(engine.generate(PROMPTS[rank], lengths=LENGTHS[rank]).completion_ids)
        freed = mode != "gathered" or all(p.untyped_storage().size() == 0 for p in weights.module.parameters())
        aborted = ""
        if mode == "lockstep":  # rank 0 fails after its short rollout, between forwards; rank 1 is still decoding
            try:
                with torch.no_grad(), weights.active():
                    engine.generate(PROMPTS[rank], lengths=LENGTHS[rank])
                    if rank == 0:
                        raise KeyError("planted")
            except (KeyError, RankFailed) as error:
                aborted = repr(error)
        results.put((rank, completions, expected, freed, refused, aborted))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["gathered", "lockstep"])
def test_sharded_rollouts_of_unequal_length_finish_with_the_unsharded_models_samples(mode):
    context = forked_cli.forkserver()
    results, port = context.Queue(), free_port()
    workers = [context.Process(target=_unequal_rollout, args=(rank, mode, port, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=90)
    hung = [worker for worker in workers if worker.is_alive()]
    for worker in hung:
        worker.kill()
    assert not hung, f"{mode}: a rank did not finish (the ranks' rollouts waited on each other)"
    assert [worker.exitcode for worker in workers] == [0, 0]
    by_rank = {rank: rest for rank, *rest in (results.get(timeout=5) for _ in workers)}
    if mode == "lockstep":  # the failed rank's error stops the other at its next forward, not in a collective
        assert by_rank[0][-1] == "KeyError('planted')"
        assert by_rank[1][-1].startswith("RankFailed('rank 0 stopped with an error inside the lockstep rollout")
    for rank, (completions, expected, freed, refused, _) in by_rank.items():
        assert [len(ids) for ids in completions[0][0]] == LENGTHS[rank][0]
        assert completions == expected, rank
        assert freed, "the gathered weights stay allocated after the rollout"
        assert "sharded by FSDP2" in refused and "GatheredWeights" in refused and "LockstepWeights" in refused


# ---------------------------------------------------------------------------------------------- whole runs
@pytest.mark.xdist_group("ddp_run")
@pytest.mark.parametrize("mode", ["gathered", "lockstep"])
def test_fsdp2_fit_with_unequal_rollouts_trains_as_ddp(mode, eos_model, ddp_run, tmp_path):
    """On a model whose samples end at different steps (conftest's ``eos_model``), against the shared 2-process ddp
    run: the same prompts, completions, rewards and advantages, losses and gradient norms equal up to float
    rounding (float32, summed in another order), and the two ranks' parameter shards adding up to ddp's parameters
    after every step; the ranks' rollouts did differ in length."""
    from tools.step_recorder import read_records

    # the sizes left to lit-grpo: configs/fsdp_gpu.yaml's, or Lightning's defaults (tensor parallel inside a node)
    sizes = {"data_parallel_size": "auto", "tensor_parallel_size": 1} if mode == "gathered" else {}
    strategy = tmp_path / "strategy.yaml"
    strategy.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy", "init_args": sizes}}}))
    fsdp_run = fit_two_processes(tmp_path, "--model.model", eos_model, "--config", str(strategy),
                                 "--model.fsdp", "true", "--model.fsdp_rollout", mode)
    lengths = {}
    for rank in (0, 1):
        for a, b in zip(read_records(ddp_run, rank), read_records(fsdp_run, rank), strict=True):
            assert b["sharded"] and not a["sharded"]
            assert b["threads"] == a["threads"]  # the ddp run's share of the cores (tests/test_ddp.py)
            # equal tokens although the sharded rollout may run other float32 kernels (and its weights agree to
            # rounding after a step): a sampled token changes only if its uniform lies within that rounding
            # (~1e-7) of a CDF boundary
            for key in ("indices", "completion_ids", "rewards", "advantages"):
                assert a[key] == b[key], (rank, a["global_step"], key)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            lengths.setdefault(rank, []).append([len(ids) for group in b["completion_ids"] for ids in group])
    cap = 16  # configs/tiny.yaml's max_new_tokens
    assert any(length < cap for steps in lengths.values() for row in steps for length in row)
    assert [max(row) for row in lengths[0]] != [max(row) for row in lengths[1]], lengths  # rollouts differ
    for step, ddp in enumerate(read_records(ddp_run, 0)):
        shards = [read_records(fsdp_run, rank)[step] for rank in (0, 1)]
        # AdamW turns a near-zero gradient's float32 rounding into a whole step of its element (its update is
        # m / sqrt(v)), so the signed sum, which cancels, is held to the scale of the magnitudes it sums
        scale = 1e-6 * ddp["param_abs"]
        assert sum(s["param_sum"] for s in shards) == pytest.approx(ddp["param_sum"], rel=1e-6, abs=scale)
        assert sum(s["param_abs"] for s in shards) == pytest.approx(ddp["param_abs"], rel=1e-6)


def test_gathered_weights_are_sized_in_the_dtype_the_policy_has_when_asked():
    """Under a "-true" precision the strategy converts the policy after the module builds its GatheredWeights: the
    size that decides ``fsdp_rollout: auto`` is that of the converted weights; under mixed precision the gather's
    dtype."""
    from lit_grpo.runtime.distributed import GatheredWeights, meta_replica
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny-llama", "float32")
    count = sum(p.numel() for p in model.parameters())
    own, autocast = GatheredWeights(model, meta_replica(model), None), GatheredWeights(
        model, meta_replica(model), torch.bfloat16)
    assert own.weights_bytes() == 4 * count and autocast.weights_bytes() == 2 * count
    model.to(torch.bfloat16)
    assert own.weights_bytes() == 2 * count


def test_an_unknown_fsdp_rollout_is_named():
    from lit_grpo.update.module import GRPOModule

    with pytest.raises(ValueError, match="fsdp_rollout.*'gather'.*gathered"):
        GRPOModule(model="tiny-llama", fsdp_rollout="gather")


def test_a_mesh_that_is_not_all_data_parallel_or_an_unsharded_policy_is_refused():
    """Under ModelParallelStrategy every rank must be data parallel and the policy sharded: a tensor-parallel
    dimension would hold replicas whose gradients no one averages, and so would an unsharded policy."""
    import types

    from lit_grpo.update.module import GRPOModule

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return types.SimpleNamespace(size=lambda: 1)

    module = GRPOModule(model="tiny-llama", fsdp=True)
    module._device_mesh, module._trainer = Mesh(), types.SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match=r"spans 1 of the 2 ranks: set ModelParallelStrategy's data_parallel_size "
                                         r"to 2 .* and tensor_parallel_size to 1"):
        module.configure_model()
    module = GRPOModule(model="tiny-llama")
    module._device_mesh = Mesh()
    with pytest.raises(ValueError, match=r"ModelParallelStrategy but model.fsdp is false"):
        module.configure_model()


#: FSDP2 with a frozen reference (loss.beta > 0, no LoRA) and two optimizer param groups (weight_decay > 0): what
#: each resume test below needs of its checkpoint, in one run.
RESUMED_ARGS = ("--model.fsdp", "true", "--model.loss.beta", "0.04", "--model.weight_decay", "0.1")


@pytest.fixture(scope="module")
def fsdp_step_1(tmp_path_factory):
    """A 1-step FSDP2 fit of ``RESUMED_ARGS`` (its folder, its ``run`` holding the sharded last.ckpt) and the
    arguments that resume it: each test resumes its own copy."""
    tmp = tmp_path_factory.mktemp("fsdp_step_1")
    strategy = tmp / "strategy.yaml"
    strategy.write_text(yaml.safe_dump({"trainer": {"strategy": {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}}}))
    args = ("--config", str(strategy), *RESUMED_ARGS)
    fit_two_processes(tmp, *args, steps=1)
    return tmp, args


def _resumable_copy(fsdp_step_1, tmp_path):
    """The step-1 run and its records copied to ``tmp_path``: what a resume there reads and rewrites; returns the
    arguments that resume it."""
    import shutil

    shutil.copytree(fsdp_step_1[0] / "run", tmp_path / "run")
    for records in fsdp_step_1[0].glob("rec.*"):  # the StepRecorder's files, each rank's, which the resume extends
        (shutil.copytree if records.is_dir() else shutil.copy)(records, tmp_path / records.name)
    return fsdp_step_1[1]


@pytest.mark.xdist_group("fsdp_step_1")
def test_an_fsdp2_run_with_a_reference_model_resumes(tmp_path, fsdp_step_1):
    """loss.beta > 0 without LoRA loads a frozen reference, sharded as the policy is: its keys stay in the sharded
    checkpoint, which ModelParallelStrategy loads whole into the module, so ``--ckpt_path last`` resumes (from the
    folder RunCheckpoint staged and swapped in)."""
    from tools.step_recorder import read_records

    args = _resumable_copy(fsdp_step_1, tmp_path)
    first = read_records(str(tmp_path / "rec"), 0)
    (last,) = (tmp_path / "run").rglob("last.ckpt")
    # a folder of both ranks' shards, written beside its place and swapped in: nothing else is left there
    assert last.is_dir() and [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
    resumed = read_records(fit_two_processes(tmp_path, *args, "--ckpt_path", "last", steps=2), 0)
    assert [r["global_step"] for r in first] == [1] and resumed[-1]["global_step"] == 2


def _saved_param_groups(tmp_path) -> set[int]:
    """The optimizer param groups (their indices) in the run's sharded ``last.ckpt``, from its metadata."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    (last,) = (tmp_path / "run").rglob("last.ckpt")
    keys = FileSystemReader(str(last)).read_metadata().state_dict_metadata
    return {int(match.group(1)) for key in keys if (match := re.search(r"param_groups\.(\d+)\.", key))}


@pytest.mark.xdist_group("fsdp_step_1")
def test_an_fsdp2_checkpoint_resumes_with_its_param_groups(tmp_path, fsdp_step_1):
    """A sharded checkpoint of the two groups (weight_decay > 0) resumes with them (a run of one group is refused:
    the test below)."""
    from tools.step_recorder import read_records

    args = _resumable_copy(fsdp_step_1, tmp_path)
    assert _saved_param_groups(tmp_path) == {0, 1}
    resumed = read_records(fit_two_processes(tmp_path, *args, "--ckpt_path", "last", steps=2), 0)
    assert resumed[-1]["global_step"] == 2 and _saved_param_groups(tmp_path) == {0, 1}


@pytest.mark.xdist_group("fsdp_step_1")
@pytest.mark.parametrize("launch", ["script", "lit-grpo"])
def test_a_sharded_checkpoint_of_other_param_groups_is_refused_by_trainer_fit_before_its_load(tmp_path, fsdp_step_1,
                                                                                              launch):
    """The two groups' sharded checkpoint resumed with weight_decay 0 (one group) ends every rank naming both counts,
    before FSDP2 loads the optimizer into the groups as built (it then failed in the schedule's load, an IndexError):
    by a user's script (tests/fit_without_cli.py: ``trainer.fit(ckpt_path=...)``, no ``lit-grpo`` and its checks of
    ``--ckpt_path``), and by ``lit-grpo fit``, as a bad setting (one ``error:`` line, exit 2)."""
    from two_process_helpers import TINY

    from tools.harness import repo_env

    args = _resumable_copy(fsdp_step_1, tmp_path)
    (last,) = (tmp_path / "run").rglob("last.ckpt")
    argv = ["--config", TINY, *args, "--model.weight_decay", "0.0", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.num_nodes", "2",
            "--trainer.devices", "1", "--model.scale_rewards", "batch", "--model.lr", "1e-2"]
    script = os.path.join(os.path.dirname(__file__), "fit_without_cli.py") if launch == "script" else None
    argv = [str(last), *argv] if script else ["fit", *argv, "--ckpt_path", str(last)]
    outputs = forked_cli.run_ranks(argv, tmp_path, free_port(), timeout=240, env=repo_env(), script=script)
    for rank, (code, output, _) in enumerate(outputs):
        assert code == (1 if script else 2), f"rank {rank} ended with {code}:\n{output[-4000:]}"
        assert f"--ckpt_path: checkpoint {last}: its optimizer has 2 param group(s), this run's 1" in output, (
            output[-4000:])
        assert "IndexError" not in output and (script or "Traceback" not in output), output[-4000:]


def _fsdp2_strategy(folder, whole: bool) -> str:
    """A config of FSDP2's strategy, saving a folder of shards or (``whole``) one whole file; returns its path."""
    path = folder / ("whole.yaml" if whole else "sharded.yaml")
    strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}
    if whole:
        strategy["init_args"] = {"save_distributed_checkpoint": False}
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    return str(path)


def _one_process_arguments(tmp, whole: bool) -> list[str]:
    """The tiny config under FSDP2 on one CPU process (its loss dapo), whose first step moves every weight."""
    from two_process_helpers import TINY

    return ["--config", TINY, "--config", _fsdp2_strategy(tmp, whole), "--model.fsdp", "true",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--model.scale_rewards", "batch",
            "--model.lr", "1e-2"]


def _one_process_env() -> dict[str, str]:
    from tools.harness import repo_env

    return repo_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


@pytest.fixture(scope="module")
def fsdp2_one_process(tmp_path_factory):
    """The last.ckpt of a 1-step FSDP2 fit on one CPU process, by how it was saved: "sharded" (a folder of shards)
    and "whole" (one file), each with its weights as a torch state dict (the shards gathered into one)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = {}
    for kind in ("sharded", "whole"):
        tmp = tmp_path_factory.mktemp(f"fsdp2_{kind}")
        argv = ["fit", *_one_process_arguments(tmp, kind == "whole"), "--trainer.default_root_dir", str(tmp / "run"),
                "--trainer.max_steps", "1"]
        proc = forked_cli.run(argv, tmp, _one_process_env(), timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        (last,) = (tmp / "run").rglob("last.ckpt")
        assert last.is_dir() == (kind == "sharded")
        whole = tmp / "whole.pt"
        if last.is_dir():
            dcp_to_torch_save(last, whole)
        state = torch.load(whole if last.is_dir() else last, map_location="cpu", weights_only=False)["state_dict"]
        saved[kind] = (last, {key.removeprefix("policy."): value for key, value in state.items()})
    return saved


@pytest.mark.parametrize("kind", ["sharded", "whole"])
def test_an_fsdp2_checkpoint_of_another_objective_is_refused_by_a_scripts_fit_before_its_weights_load(
        tmp_path, fsdp2_one_process, kind):
    """A script's ``trainer.fit(ckpt_path=...)`` under FSDP2 (tests/fit_keeping_weights.py, no ``lit-grpo``) of a
    checkpoint trained with another loss is refused naming it, as ``lit-grpo fit`` refuses it, and the module keeps
    the weights it was built with: the strategy loads the weights (and the optimizer) inside its ``load_checkpoint``,
    before ``on_load_checkpoint`` could compare the settings, so they are compared before that load."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    last, saved = fsdp2_one_process[kind]
    initial = load_model_and_tokenizer("tiny-llama")[0].state_dict()
    assert set(saved) == set(initial) and all(not torch.equal(saved[name], initial[name]) for name in initial)
    weights = tmp_path / "weights.pt"
    script = os.path.join(os.path.dirname(__file__), "fit_keeping_weights.py")
    argv = [str(last), str(weights), *_one_process_arguments(tmp_path, kind == "whole"),
            "--model.loss.loss_type", "grpo", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.max_steps", "2"]
    proc = forked_cli.run(argv, tmp_path, _one_process_env(), timeout=240, script=script)
    output = (proc.stdout + proc.stderr).replace("[rank0]: ", "")  # torch's prefix of a process group's errors
    assert proc.returncode == 1, output[-4000:]
    assert (f"--ckpt_path: checkpoint {last} was trained with other settings than this run's; a resume would not "
            "continue the same run:\n  model.loss.loss_type: 'dapo' in the checkpoint, 'grpo' now\n") in output, (
        output[-4000:])
    after = torch.load(weights, map_location="cpu", weights_only=True)
    assert set(after) == set(initial), output[-4000:]
    assert [name for name in initial if not torch.equal(after[name], initial[name])] == []


@pytest.mark.parametrize("kind", ["sharded", "whole"])
def test_an_fsdp2_checkpoint_resumed_by_a_scripts_fit_with_other_reward_functions_warns_once_and_goes_on(
        tmp_path, fsdp2_one_process, kind):
    """Its settings are compared before the strategy loads it, and on_load_checkpoint, told so, does not compare
    them again: the other reward functions are warned of once, and the fit goes on from the checkpoint's step."""
    last, _ = fsdp2_one_process[kind]
    rewards = tmp_path / "rewards.yaml"  # the tiny config's rewards without format and overlong
    rewards.write_text(yaml.safe_dump({"data": {"reward_funcs": [{"name": "accuracy", "weight": 1.0},
                                                                 {"name": "char_fraction", "weight": 1.0}]}}))
    weights = tmp_path / "weights.pt"
    script = os.path.join(os.path.dirname(__file__), "fit_keeping_weights.py")
    argv = [str(last), str(weights), *_one_process_arguments(tmp_path, kind == "whole"), "--config", str(rewards),
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "2"]
    proc = forked_cli.run(argv, tmp_path, _one_process_env(), timeout=240, script=script)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count(f"checkpoint {last} was trained with other reward functions than this run's:") == 1, (
        output[-4000:])
    assert "reward 'format': removed (weight 0.1 in the checkpoint)" in output
    assert f"Restored all states from the checkpoint at {last}" in output, output[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in output, output[-4000:]
