"""GAIN-RL's angle-concentration score: the layer it reads, the pairwise-cosine formula, padding, edge prompts."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.datamodules.angle_score import angle_concentration, mean_pairwise_cosine

TEXTS = [
    "What is 12 + 30?",
    "The quick brown fox jumps over the lazy dog. Think step by step, then give the final answer.",
    "Compute the sum of 7, 8 and 9.",
    "<answer>17</answer>",
    "0 1 2 3 4 5 6 7 8 9",
]


@pytest.fixture(scope="module")
def tiny():
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert len({len(p) for p in prompts}) > 2  # several lengths, so micro-batches carry padding
    return model, tokenizer, prompts


def explicit_score(model, ids: list[int]) -> float:
    """The definition, literally: a plain unpadded forward, the n x n cosine matrix, mean off the diagonal."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    unit = torch.nn.functional.normalize(hidden, dim=-1)
    cos = unit @ unit.T
    n = len(ids)
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    return float(cos[off_diagonal].mean())


def test_hidden_states_last_is_after_final_norm(tiny):
    """Pins the documented layer: in transformers 5, hidden_states[-1] is the final norm's output."""
    model, _, prompts = tiny
    captured = {}
    handle = model.model.layers[-1].register_forward_hook(lambda mod, inp, out: captured.update(out=out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([prompts[1]]), output_hidden_states=True)
    finally:
        handle.remove()
    last_layer = captured["out"][0] if isinstance(captured["out"], tuple) else captured["out"]
    with torch.no_grad():
        torch.testing.assert_close(out.hidden_states[-1], model.model.norm(last_layer))
    assert not torch.allclose(out.hidden_states[-1], last_layer)


def test_score_equals_explicit_pairwise_cosine_padded_or_not(tiny):
    model, tokenizer, prompts = tiny
    expected = torch.tensor([explicit_score(model, ids) for ids in prompts], dtype=torch.float32)
    for batch_size in (1, 2, len(prompts)):  # 2 and 5 put prompts of different lengths in one padded micro-batch
        scores = angle_concentration(model, tokenizer, prompts, batch_size=batch_size)
        assert scores.shape == (len(prompts),) and scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert len(set(expected.tolist())) == len(prompts)  # distinct scores: the order of the output is checked too


def test_score_restores_mode_and_builds_no_graph(tiny):
    model, tokenizer, prompts = tiny
    model.train()
    try:
        scores = angle_concentration(model, tokenizer, prompts[:2])
        assert model.training and not scores.requires_grad
    finally:
        model.eval()
    angle_concentration(model, tokenizer, prompts[:2])
    assert not model.training


def test_score_edge_prompts(tiny):
    model, tokenizer, prompts = tiny
    assert angle_concentration(model, tokenizer, [prompts[0][:1]]).tolist() == [1.0]  # one token: defined as 1
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        angle_concentration(model, tokenizer, [prompts[0], []])
    with pytest.raises(ValueError, match="batch_size=0.*>= 1"):
        angle_concentration(model, tokenizer, prompts, batch_size=0)


def test_mean_pairwise_cosine_formula_matches_matrix():
    torch.manual_seed(0)
    hidden = torch.randn(3, 6, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    hidden[1, :2] = float("nan")  # padding positions are never read
    got = mean_pairwise_cosine(hidden, mask)
    for row in range(2):
        unit = torch.nn.functional.normalize(hidden[row][mask[row]].double(), dim=-1)
        cos = unit @ unit.T
        n = unit.shape[0]
        assert got[row].item() == pytest.approx(float((cos.sum() - cos.diag().sum()) / (n * (n - 1))), abs=1e-6)
    assert got[2].item() == 1.0


def test_ranks_score_their_share_of_the_prompts_and_gather_them_once(tiny_llama, monkeypatch):
    """Several ranks: each scores a contiguous ceil(N / world) of the training prompts (one prefill each) and one
    all_gather gives every rank all N scores, those one process computes (equal up to batching's rounding)."""
    import lit_grpo.datamodules.rollout as rollout
    from lit_grpo.datamodules.rollout import RolloutDataModule

    model, tokenizer = tiny_llama
    prompts = [{"prompt": f"{a} + {b} * {a}", "answer": str(a + b * a)} for a in range(4) for b in range(3)][:11]
    scored, gathers = [], []
    real = rollout.angle_concentration
    monkeypatch.setattr(rollout, "angle_concentration",
                        lambda m, t, ids, size: scored.append(len(ids)) or real(m, t, ids, size))

    def module(world: int, rank: int, gather=None) -> RolloutDataModule:
        data = RolloutDataModule(prompts=prompts, val_size=0, prompts_per_step=1, curriculum="angle")
        data.trainer = type("Trainer", (), {"world_size": world, "global_rank": rank, "current_epoch": 0})()
        data.setup()
        data.attach(model, tokenizer, world_size=world, all_gather=gather)
        return data

    one = module(1, 0)
    expected = one._angle_scores(one._require_builder())
    assert scored == [11]
    shares = {}

    def gather_of(rank):
        def gather(local):
            gathers.append(rank)
            shares[rank] = local
            return torch.stack([shares.get(0, torch.zeros_like(local)), shares.get(1, torch.zeros_like(local))])
        return gather

    scored.clear()
    second = module(2, 1, gather_of(1))
    second._angle_scores(second._require_builder())  # rank 1 first, so rank 0's gather holds both shares
    first = module(2, 0, gather_of(0))
    got = first._angle_scores(first._require_builder())
    assert scored == [5, 6] and gathers == [1, 0]  # N = 11: each rank its share (6 and 5), one gather each
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
