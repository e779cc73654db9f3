"""Which signals carry a sample's length, measured on a token recording (``tools.study_predictors``'s curves).

Each signal is learned on one half of the recording's prompts and judged on the other (cross-fitted):

- :func:`group_share`: the share of log-length variance between groups (what a perfect group predictor could
  explain);
- :func:`token_signal`: the ``online`` predictor's token model at probe k: Kendall tau and log RMSE over the samples
  that reach k, and ``tail_auc``, how well its predictions tell the long samples (:func:`long_threshold`) from the
  rest: where lengths cluster, a schedule's gain lies in placing those few, which a tau over the whole cluster
  can hide;
- :func:`noisy_tail_auc`: the same for the noisy oracle (true length x exp(N(0, S^2))), the reference;
- :func:`elapsed_signal`: the elapsed tokens, i.e. how well the conditional lognormal ``E[L | L > t]`` predicts the
  samples still running at t, beside the population median raised to t + 1.
"""

from __future__ import annotations

import math
import statistics

import torch
from torchmetrics.functional.classification import binary_auroc

from lit_grpo.scheduling import RolloutWork
from lit_grpo.scheduling.length_aware.predictors import OnlineLengthPredictor, expected_length, kendall_tau, log_rmse
from tools.recording_features import RecordingFeatures

#: A sample is long when it runs past this multiple of the recording's median length.
LONG_FACTOR = 1.5


def group_share(lengths: list[list[int]]) -> float:
    """Share of the log-length variance between groups (intra-class correlation of log length)."""
    logs = torch.tensor(lengths, dtype=torch.float64).clamp_min(1).log()
    total = float(logs.var(unbiased=False))
    return float(logs.mean(1).var(unbiased=False)) / total if total > 0 else 0.0


def long_threshold(lengths: list[list[int]]) -> int:
    """The length a sample must exceed to count as long: ``LONG_FACTOR`` x the recording's median length."""
    return int(LONG_FACTOR * statistics.median(n for row in lengths for n in row))


def tail_auc(predicted: list[float], true: list[int], threshold: int) -> float | None:
    """Area under the ROC curve of ``predicted`` telling samples longer than ``threshold`` from the rest (0.5:
    chance; None where either class is empty)."""
    labels = torch.tensor([n > threshold for n in true], dtype=torch.long)
    if labels.numel() == 0 or labels.all() or not labels.any():
        return None
    scores = torch.tensor(predicted, dtype=torch.float64)
    # Scaled into [0, 1], which keeps the order and the ties: torchmetrics reads scores outside it as logits, and
    # the sigmoid of lengths in the tens of tokens rounds them all to 1.
    span = scores.max() - scores.min()
    scores = (scores - scores.min()) / span if span > 0 else torch.zeros_like(scores)
    return float(binary_auroc(scores, labels))


def token_signal(lengths: list[list[int]], features: RecordingFeatures, k: int) -> dict:
    """The ``online`` predictor's token model at probe k, cross-fitted by halves of the prompts: Kendall tau, log
    RMSE and tail AUC of its predictions for the samples that reach k (those it would be asked about), pooled."""
    B, G = len(lengths), len(lengths[0])
    cap = max(max(row) for row in lengths)
    halves = [list(range(B // 2)), list(range(B // 2, B))]
    predicted, true = [], []
    for train, test in (halves, halves[::-1]):
        predictor = OnlineLengthPredictor()
        for prompts, learn in ((train, True), (test, False)):
            keys = [(p, j) for p in range(len(prompts)) for j in range(G) if lengths[prompts[p]][j] > k]
            if not keys:
                continue
            work = RolloutWork(prompt_lengths=[1] * len(prompts), group_size=G, num_slots=1, max_new_tokens=cap,
                               prompt_features=features.prompt[prompts])
            x = torch.stack([features.token[k][prompts[p], j] for p, j in keys])
            y = [lengths[prompts[p]][j] for p, j in keys]
            if learn:
                predictor.observe(work, keys, y, x)
            else:
                predicted += predictor.predict(work, keys, x).tolist()
                true += y
    if len(true) < 4:
        return {"k": k, "samples": len(true), "kendall_tau": None, "log_rmse": None, "tail_auc": None}
    return {"k": k, "samples": len(true), "kendall_tau": kendall_tau(predicted, true),
            "log_rmse": log_rmse(predicted, true), "tail_auc": tail_auc(predicted, true, long_threshold(lengths))}


def noisy_tail_auc(lengths: list[list[int]], spread: float, seed: int = 0) -> float | None:
    """Tail AUC of the noisy oracle ``noisy:spread`` over every sample of the recording."""
    true = [n for row in lengths for n in row]
    noise = torch.randn(len(true), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    predicted = (torch.tensor(true, dtype=torch.float64) * torch.exp(spread * noise)).tolist()
    return tail_auc(predicted, true, long_threshold(lengths))


def elapsed_signal(lengths: list[list[int]], elapsed: list[int]) -> list[dict]:
    """The conditional lognormal: how well ``E[min(L, cap) | L > t]`` predicts the total length of the samples
    still running after t tokens, against the population median raised to t + 1 (what is known without the
    model), cross-fitted by halves of the prompts (the lognormal is fitted on one half, judged on the other)."""
    cap = max(max(row) for row in lengths)
    B = len(lengths)
    if B < 2:
        return []
    halves = [lengths[: B // 2], lengths[B // 2:]]
    out = []
    for t in elapsed:
        conditional, unconditional, running, total = [], [], 0, 0
        for train, test in (halves, halves[::-1]):
            logs = [math.log(n) for row in train for n in row]
            mu, sd = statistics.fmean(logs), statistics.pstdev(logs)
            guess = expected_length(math.exp(mu), sd, t, cap)
            for n in (n for row in test for n in row):
                total += 1
                if n > t:
                    running += 1
                    conditional.append(math.log(guess / n) ** 2)
                    unconditional.append((max(mu, math.log(t + 1)) - math.log(n)) ** 2)
        out.append({"t": t, "running": running / total if total else 0.0,
                    "log_rmse": math.sqrt(statistics.fmean(conditional)) if conditional else None,
                    "median_log_rmse": math.sqrt(statistics.fmean(unconditional)) if unconditional else None})
    return out
