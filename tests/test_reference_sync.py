"""Reference-model sync (``model.reference_sync``, TRL's ``sync_ref_model``): the mix, when it happens, its refusals,
and the synced reference through a checkpoint and a resume (tiny random model, CPU, seconds)."""

import datetime
import os
from pathlib import Path

import forked_cli
import pytest
import torch

import lit_grpo.update.module as module_code
from lit_grpo.callbacks.run_checkpoint import checkpoint_bytes
from lit_grpo.cli import build_cli
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.update.module import GRPOModule
from lit_grpo.update.reference_sync import ReferenceSync, mix_parameters

from datamodule_helpers import datamodule_arguments
from tools.harness import free_port

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
BETA = {"loss_type": "grpo", "beta": 0.1}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_the_mix_is_the_weighted_sum_of_the_two_models_parameter_by_parameter(dtype, alpha):
    target, _ = load_model_and_tokenizer("tiny-llama")
    source, _ = load_model_and_tokenizer("tiny-llama")
    target, source = target.to(dtype).requires_grad_(False), source.to(dtype)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    before, policy = _weights(target), _weights(source)
    mix_parameters(target, source, alpha)
    for name, p in target.named_parameters():
        assert torch.equal(p, (1 - alpha) * before[name] + alpha * policy[name]), name
    assert not _differs(_weights(source), policy)  # the source is only read
    if alpha == 1.0:
        assert not _differs(_weights(target), policy)


def test_the_mix_refuses_models_that_do_not_match_and_changes_nothing():
    target, _ = load_model_and_tokenizer("tiny-llama")
    other, _ = load_model_and_tokenizer("tiny-qwen2")
    before = _weights(target)
    with pytest.raises(ValueError, match="parameters differ"):
        mix_parameters(target, other, 0.5)
    source, _ = load_model_and_tokenizer("tiny-llama")
    with pytest.raises(ValueError, match=r"\(shape, dtype, placements\)"):
        mix_parameters(target, source.double(), 0.5)
    assert not _differs(_weights(target), before)


def _mix_sharded(rank: int, port: int, results) -> None:
    """One of 2 ranks: shard a policy and its reference with FSDP2, run the reference without a backward (its
    root stays gathered) and the policy with one, mix; reports whether the root was gathered, the parameters whose
    full weights are not the mix, and whether the reference's next forward computes with the mixed weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lit_grpo.runtime.distributed import shard_decoder_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2,))
        policy, reference = load_model_and_tokenizer("tiny-llama")[0], load_model_and_tokenizer("tiny-llama")[0]
        with torch.no_grad():  # the same on both ranks
            for p in policy.parameters():
                p.add_(torch.arange(p.numel(), dtype=p.dtype).view_as(p).sin())
        reference.requires_grad_(False)
        shard_decoder_layers(policy, mesh)
        shard_decoder_layers(reference, mesh)

        def full(model):
            return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}

        ids = torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad():
            reference(ids)
        gathered = not all(isinstance(p, DTensor) for p in reference.parameters())
        policy(ids).logits.sum().backward()
        before, source = full(reference), full(policy)
        mix_parameters(reference, policy, 0.25)
        after = full(reference)
        expected = {name: 0.75 * before[name] + 0.25 * source[name] for name in before}
        wrong = sorted(name for name in expected if not torch.equal(after.get(name), expected[name]))
        plain = load_model_and_tokenizer("tiny-llama")[0]
        plain.load_state_dict(expected, strict=False)
        with torch.no_grad():
            same_forward = torch.allclose(reference(ids).logits, plain(ids).logits, atol=1e-5)
        results.put((rank, gathered, wrong, same_forward))
    except Exception as error:  # reported, so that the test fails at once and says why
        results.put((rank, repr(error)))
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_are_mixed_in_place_on_each_rank_even_where_a_forward_left_them_gathered():
    context = forked_cli.forkserver()
    results, port = context.Queue(), free_port()
    workers = [context.Process(target=_mix_sharded, args=(rank, port, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    outcomes = sorted(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert outcomes == [(0, True, [], True), (1, True, [], True)]


@pytest.mark.parametrize("settings, message", [
    ({"every_n_steps": 0}, "reference_sync.every_n_steps=0 must be an integer >= 1"),
    ({"every_n_steps": 2.0}, "reference_sync.every_n_steps=2.0 must be an integer >= 1"),
    ({"mixup_alpha": 0.0}, "reference_sync.mixup_alpha=0.0 is not allowed; .* > 0 and <= 1"),
    ({"mixup_alpha": 1.5}, "reference_sync.mixup_alpha=1.5 is not allowed; .* > 0 and <= 1"),
    ({"mixup_alpha": float("nan")}, "reference_sync.mixup_alpha=nan is not allowed"),
    ({"steps": 4}, r"unknown reference_sync options \['steps'\]; allowed: \['every_n_steps', 'mixup_alpha'\]"),
])
def test_bad_sync_settings_are_named_with_what_is_allowed(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(model="tiny-llama", loss=BETA, reference_sync=settings)
    if set(settings) <= {"every_n_steps", "mixup_alpha"}:
        with pytest.raises(ValueError, match=message):
            ReferenceSync(**settings)


def test_a_sync_is_refused_without_a_reference_of_its_own():
    with pytest.raises(ValueError, match=r"reference_sync needs loss.beta > 0: .* set loss.beta .* or "
                                         "reference_sync: null"):
        GRPOModule(model="tiny-llama", reference_sync=ReferenceSync())
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(ValueError, match=r"reference_sync does not apply with peft_config \(LoRA\): the reference is "
                                         "the policy with its adapter disabled"):
        GRPOModule(model="tiny-llama", loss=BETA, peft_config=lora, reference_sync={})


def test_without_a_trainer_the_mix_follows_the_optimizer_steps_grpo_step_took():
    module = GRPOModule(model="tiny-llama", loss=BETA, num_iterations=2, lr=1e-2,
                        reference_sync={"every_n_steps": 3, "mixup_alpha": 1.0})
    module.configure_model()
    datamodule = RolloutDataModule(**datamodule_arguments({}))
    datamodule.attach(module.policy, module.tokenizer)
    datamodule.setup("fit")
    batch = datamodule.build_train_batch()
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=1e-2)
    initial = _weights(module.ref_model)
    module.grpo_step(batch, optimizer)  # optimizer steps 1 and 2
    assert not _differs(_weights(module.ref_model), initial)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(_weights(module.policy)))
    module.grpo_step(batch, optimizer)  # steps 3 (mixed: alpha 1 copies the policy) and 4
    assert _differs(steps[0], initial) and not _differs(_weights(module.ref_model), steps[0])
    assert _differs(steps[1], steps[0])


def _fit(max_steps: int, monkeypatch, **module_options) -> tuple[GRPOModule, list[int]]:
    """A tiny fit (Python API); returns its module and the global step at each mix."""
    import lightning.pytorch as pl

    mixed_at = []

    def recorded_mix(target, source, alpha):
        mixed_at.append(module.trainer.global_step)
        mix_parameters(target, source, alpha)

    monkeypatch.setattr(module_code, "mix_parameters", recorded_mix)
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = GRPOModule(model="tiny-llama", loss=BETA, lr=1e-2, **module_options)
    arguments = datamodule_arguments({"val_size": 0, "group_size": 2, "micro_group_size": 2, "max_new_tokens": 4})
    trainer.fit(module, RolloutDataModule(**arguments))
    return module, mixed_at


@pytest.mark.parametrize("num_iterations, every_n_steps, max_steps, mixed_at", [
    (1, 2, 5, [2, 4]),
    (2, 3, 6, [3, 6]),  # the first iteration of the second training step, the second of the third
    (2, 1, 4, [1, 2, 3, 4]),
])
def test_under_a_trainer_the_reference_is_mixed_after_each_multiple_of_every_n_optimizer_steps(
        monkeypatch, num_iterations, every_n_steps, max_steps, mixed_at):
    initial = _weights(load_model_and_tokenizer("tiny-llama")[0])
    module, mixes = _fit(max_steps, monkeypatch, num_iterations=num_iterations,
                         reference_sync={"every_n_steps": every_n_steps, "mixup_alpha": 0.5})
    assert mixes == mixed_at
    assert _differs(_weights(module.ref_model), initial)


def _cli_fit(root: Path, steps: int, *extra: str):
    return build_cli(["fit", "--config", TINY, "--trainer.default_root_dir", str(root), "--trainer.max_steps",
                      str(steps), "--torch_num_threads", "1", "--model.loss.beta", "0.1", "--ckpt_path", "last",
                      *extra])


def _saved_reference(root: Path) -> tuple[int, dict[str, torch.Tensor]]:
    path = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    prefix = "ref_model."
    return checkpoint["global_step"], {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items()
                                       if k.startswith(prefix)}


def test_last_ckpt_holds_the_synced_reference_and_a_resume_goes_on_with_it(tmp_path):
    cli = _cli_fit(tmp_path, 2, "--model.reference_sync.every_n_steps", "1", "--model.reference_sync.mixup_alpha",
                   "0.5")
    step, saved = _saved_reference(tmp_path)
    assert step == 2 and saved
    synced = cli.model.ref_model.state_dict()
    assert saved.keys() == synced.keys() and not _differs(saved, synced)
    initial = load_model_and_tokenizer("tiny-llama")[0].state_dict()
    assert _differs({k: saved[k] for k in initial}, initial)  # two mixes moved it off the initial weights
    # resumed with a sync that is not due before step 100: the reference after step 3 is the one saved
    cli = _cli_fit(tmp_path, 3, "--model.reference_sync.every_n_steps", "100")
    assert cli.trainer.global_step == 3 and not _differs(cli.model.ref_model.state_dict(), saved)
    # resumed without a sync: it stays the synced one, and the next checkpoint keeps it
    cli = _cli_fit(tmp_path, 4)
    step, kept = _saved_reference(tmp_path)
    assert step == 4 and kept.keys() == saved.keys() and not _differs(kept, saved)
    assert not _differs(cli.model.ref_model.state_dict(), saved)


def test_checkpoint_bytes_counts_the_reference_once_it_is_synced():
    def size(**options) -> int:
        module = GRPOModule(model="tiny-llama", loss=BETA, **options)
        module.configure_model()
        return checkpoint_bytes(module)

    reference = sum(p.numel() * p.element_size() for p in load_model_and_tokenizer("tiny-llama")[0].parameters())
    buffers = sum(b.numel() * b.element_size() for b in load_model_and_tokenizer("tiny-llama")[0].buffers())
    assert size(reference_sync={"every_n_steps": 4}) - size() == reference + buffers


def test_a_synced_checkpoint_validates_without_a_reference(tmp_path):
    """lit-grpo validate compares only the weights' settings: a run with beta 0 has no reference to load the
    checkpoint's into, and Lightning's strict load refused them ('Unexpected key(s) ... ref_model.')."""
    _cli_fit(tmp_path, 1, "--model.reference_sync.every_n_steps", "1")
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert _saved_reference(tmp_path)[1]
    cli = build_cli(["validate", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "val"),
                     "--torch_num_threads", "1", "--ckpt_path", str(checkpoint), "--trainer.limit_val_batches", "1"])
    assert cli.model.ref_model is None
