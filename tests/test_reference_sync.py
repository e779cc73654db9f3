"""Reference-model sync (``lit_grpo.update.reference_sync``): the parameter mix, on plain tensors and on FSDP2
shards (tiny random model, CPU, seconds)."""

import datetime
import os

import forked_cli
import pytest
import torch

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.update.reference_sync import ReferenceSync, mix_parameters

from tools.harness import free_port


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
])
def test_bad_sync_settings_are_named_with_what_is_allowed(settings, message):
    with pytest.raises(ValueError, match=message):
        ReferenceSync(**settings)
