"""Which length signal pays on real rollouts? The default scheduler and the length-aware method's predictors, on
token recordings, as the scheduler uses them.

    python -m tools.study_predictors --recording tools/data/tokens/smollm2_gsm_symbolic_base.json.gz \
        --predictors none,online --json runs/study_gsm_base.json

The recording's own model computes the features a predictor would see live (``tools/recording_features.py``),
so the token-conditioned ``online`` predictor is judged on the hidden states that went with the text. Then, for
each setup (B prompts per rollout, G, g slots), the recording is walked as training walks its data, in rollouts of
B prompts, and the simulator drives the scheduler through them (the engine's own loop, ``driver.py``;
decode steps depend only on the lengths and the scheduler, so they equal a ``--tokens`` replay's).

Cross-fitted, so that no predictor is judged on samples it learned from: the prompts are cut in two halves; each
half is measured after a scheduler has warmed up on the other (its predictor and trust learn there as in
training), and the measured rollouts of both halves are summed. Figures per predictor and setup:

- ``decode_steps`` and ``ratio`` = decode steps / continuous's (the oracle's ratio is the room there is);
- ``kept`` = (1 - ratio) / (1 - oracle ratio): the share of the oracle's gain the predictor kept (target >= 1/3);
- ``kendall_tau`` and ``log_rmse``: of the last prediction the scheduler made for each sample before it finished
  (``LengthAwareScheduler.end``'s metrics: the online predictor's probe),
  means over measured rollouts;
- ``guided``: the share of measured rollouts whose first gate decision (at the rollout's start) was to follow the
  predictions;
- ``order_steps``, ``order_ratios`` and ``order_kept``: the same per order of the prompts. ``--orders N`` walks the
  prompts in N orders (the recording's, then seeded shuffles: which prompts warm up and which are measured, and
  which share a rollout), and the totals above sum them, so that a gain can be told from the luck of one split.

"none" is the default scheduler (least attained service, no predictor); every other name runs the length-aware
method with that predictor. ``--gain-z`` runs every predictor but the oracle behind the gate at each threshold
given (``scheduler.length_aware.gain_z``; "none": ungated), to show what the gate keeps and what it refuses.
``--preempt-tokens`` runs each with each preemption quantum given (``scheduler.preempt_tokens``; "none": never
preempt; ``least_attained.py``), and ``preempting`` is the share of measured rollouts that preempted.

Signals, measured on the whole recording (``signals`` in the JSON; ``tools/length_signals.py``): the share of
log-length variance between groups, the ``online`` predictor's token model against k (Kendall tau, log RMSE and
the tail AUC, how well it tells the long samples from the rest, beside the noisy oracles' tail AUC) and the
elapsed tokens against t.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lit_grpo.scheduling import (InfiniteSchedulerConfig, LeastAttainedScheduler, LengthAwareConfig, Scheduler,
                                 simulate_rollout)
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, make_predictor
from lit_grpo.scheduling.length_aware.trust import GAIN_Z
from tools import harness
from tools.length_signals import elapsed_signal, group_share, long_threshold, noisy_tail_auc, token_signal
from tools.recording_features import RecordingFeatures, recording_features
from tools.recordings import has_tokens, read_recording

#: (B, G, g) of the issue's targets.
SETUPS = ((4, 16, 8), (8, 16, 32))


def parse_setups(text: str) -> list[tuple[int, int, int]]:
    setups = []
    for part in filter(None, text.split(";")):
        try:
            B, G, g = (int(x) for x in part.split(","))
        except ValueError:
            B = G = g = 0
        if min(B, G, g) < 1:
            raise argparse.ArgumentTypeError(f"--setups {text!r}: each setup is B,G,g, integers >= 1 (e.g. "
                                             "4,16,8;8,16,32)")
        setups.append((B, G, g))
    return setups


def numbers_or_none(flag: str, kind: type, accept: Callable[[float], bool], what: str) -> Callable[[str], list]:
    """An argparse type for ``flag``: a comma list of ``kind`` numbers that ``accept`` takes (``what`` says which),
    or "none" (None: the setting off)."""
    def parse(text: str) -> list:
        values = []
        for item in (part.strip() for part in text.split(",")):
            if item.lower() == "none":
                values.append(None)
                continue
            try:
                value = kind(item)
            except ValueError:
                value = None
            if value is None or not accept(value):
                raise argparse.ArgumentTypeError(f"{flag}: {item!r} is neither {what} nor 'none'")
            values.append(value)
        return values
    return parse


#: ``--gain-z``: numbers > 0, or "none" for the ungated scheduler.
parse_gain_z = numbers_or_none("--gain-z", float, lambda z: math.isfinite(z) and z > 0, "a number > 0")
#: ``--preempt-tokens``: integers >= 1, or "none" for a scheduler that never preempts.
parse_preempt_tokens = numbers_or_none("--preempt-tokens", int, lambda q: q >= 1, "an integer >= 1")


def load_features(args, record: dict, probe_tokens: list[int]) -> RecordingFeatures:
    """The recording's features, computed once and cached beside ``--features-cache`` (they cost one forward per
    sample's first tokens)."""
    cache, model_name = args.features_cache, args.model or record["meta"]["model"]
    source = {"recording": str(args.recording), "model": model_name, "lengths": record["lengths"]}
    if cache is not None and cache.exists():
        cached = torch.load(cache)
        if cached.get("source") != source:
            held = cached.get("source") or {}
            raise SystemExit(f"--features-cache {cache} holds the features of {held.get('recording')} (model "
                             f"{held.get('model')}), not of this recording and model; give another path")
        if set(probe_tokens) <= set(cached["token"]):
            return RecordingFeatures(cached["prompt"], cached["token"])
    model, tokenizer = harness.load_policy(model_name)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    features = recording_features(model, record["prompt_ids"], record["completion_ids"], probe_tokens, pad)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"source": source, "prompt": features.prompt, "token": features.token}, cache)
    return features


# ------------------------------------------------------------------------------------------------ rollouts
class RecordingWalk:
    """The recording as a series of rollouts of B prompts and their first G samples."""

    def __init__(self, record: dict, features: RecordingFeatures, B: int, G: int, g: int,
                 order: list[int] | None = None):
        held = (len(record["lengths"]), len(record["lengths"][0]))
        if G > held[1] or 2 * B > held[0]:
            raise SystemExit(f"setup B={B}, G={G}: the recording holds {held[0]} prompts x {held[1]} samples "
                             f"(the study needs G <= {held[1]} and two rollouts of B, one per half)")
        self.lengths = [row[:G] for row in record["lengths"]]
        self.prompt_ids, self.features = record["prompt_ids"], features
        self.B, self.G, self.g = B, G, g
        self.cap = int(record["meta"]["max_new_tokens"])
        self.order = list(range(held[0])) if order is None else list(order)  # the prompts, as training meets them

    @property
    def used_prompts(self) -> int:
        """Prompts in whole rollouts of B per half (the rest of the recording is left out)."""
        return len(self.lengths) // (2 * self.B) * 2 * self.B

    def halves(self) -> list[tuple[list[int], list[int]]]:
        """(warm-up prompts, measured prompts) of each fold, in whole rollouts of B."""
        usable = self.used_prompts
        first, second = self.order[: usable // 2], self.order[usable // 2: usable]
        return [(second, first), (first, second)]

    def run(self, scheduler: Scheduler, prompts: list[int], probe: int | None) -> list[dict]:
        """Simulate rollouts of ``prompts`` (B at a time) through ``scheduler``; one record per rollout."""
        records = []
        for start in range(0, len(prompts), self.B):
            chosen = prompts[start:start + self.B]
            token = self.features.token.get(probe) if probe else None
            feature = (lambda key, generated, chosen=chosen: token[chosen[key[0]], key[1]]) if token is not None \
                else None
            result = simulate_rollout(scheduler, [self.lengths[p] for p in chosen], self.g, self.cap,
                                      prompt_features=self.features.prompt[chosen], token_feature=feature)
            info = getattr(scheduler, "last_info", {})
            records.append({"decode_steps": result.decode_steps, "tau": info.get("length_pred_kendall_tau"),
                            "log_rmse": info.get("length_pred_log_rmse"), "guided": info.get("guided"),
                            "preempting": info.get("preempting")})
        return records


def make_scheduler(name: str, probe: int | None, seed: int, gain_z: float | None = GAIN_Z,
                   preempt: int | None = None) -> Scheduler:
    """Plain continuous order for "continuous"; the default scheduler for "none"; else the length-aware method
    with predictor ``name`` probing at ``probe`` tokens behind the gate at ``gain_z`` (None: ungated; noisy oracles
    seeded by ``seed``); all preempting from ``preempt`` tokens (None: never) where predictions are not followed."""
    if name == "continuous":
        return Scheduler()
    if name == "none":
        return LeastAttainedScheduler(preempt_tokens=preempt)
    predictor = make_predictor(name, seed=seed) if "noisy" in name else name
    config = LengthAwareConfig(predictor, gain_z=gain_z, **({} if probe is None else {"probe_tokens": probe}))
    return LengthAwareScheduler(config, preempt_tokens=preempt)


def study_setup(walks: list[RecordingWalk], runs: list[tuple[str, int | None, float | None, int | None]],
                seed: int) -> list[dict]:
    """Continuous, the oracle and every ``(predictor, k, gain_z, preempt_tokens)`` of ``runs`` on one setup,
    cross-fitted (module docstring), in each order of the prompts that ``walks`` hold (the totals sum them)."""
    rows = []
    for name, probe, gain_z, preempt in [("continuous", None, GAIN_Z, None), ("oracle", None, GAIN_Z, None)] + runs:
        by_order = []
        for walk in walks:
            measured = []
            for warm, test in walk.halves():
                scheduler = make_scheduler(name, probe, seed, gain_z, preempt)
                walk.run(scheduler, warm, probe)
                measured += walk.run(scheduler, test, probe)
            by_order.append(measured)
        measured = [record for records in by_order for record in records]
        rows.append({"predictor": name, "probe_tokens": probe, "gain_z": gain_z, "preempt_tokens": preempt,
                     "decode_steps": sum(r["decode_steps"] for r in measured),
                     "order_steps": [sum(r["decode_steps"] for r in records) for records in by_order],
                     "kendall_tau": _mean(r["tau"] for r in measured),
                     "log_rmse": _mean(r["log_rmse"] for r in measured),
                     "guided": _mean(r["guided"] for r in measured),
                     "preempting": _mean(r["preempting"] for r in measured)})
        print(f"B{walks[0].B} G{walks[0].G} g{walks[0].g} {name:>16s} k={probe} z={gain_z} q={preempt} "
              f"steps={rows[-1]['decode_steps']}", file=sys.stderr, flush=True)
    continuous, oracle = rows[0], rows[1]
    for row in rows:
        row["ratio"] = row["decode_steps"] / continuous["decode_steps"]
        row["kept"] = harness.oracle_gain_kept(row["decode_steps"], oracle["decode_steps"], continuous["decode_steps"])
        by_order = list(zip(row["order_steps"], oracle["order_steps"], continuous["order_steps"]))
        row["order_ratios"] = [steps / base for steps, _, base in by_order]
        row["order_kept"] = [harness.oracle_gain_kept(*order) for order in by_order]
    return rows


def prompt_orders(num_prompts: int, orders: int) -> list[list[int]]:
    """The recording's order of the prompts, then ``orders - 1`` shuffles of it (seeded 1, 2, ...)."""
    return [list(range(num_prompts))] + [
        torch.randperm(num_prompts, generator=torch.Generator().manual_seed(i)).tolist() for i in range(1, orders)]


def _mean(values) -> float | None:
    present = [v for v in values if v is not None and v == v]
    return statistics.fmean(present) if present else None


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recording", type=Path, required=True, help="a token recording (tools.record_lengths "
                                                                      "--tokens)")
    parser.add_argument("--model", help="the model that made it (default: the recording's meta.model)")
    parser.add_argument("--predictors", default="none,online",
                        help="comma list of none (the default scheduler) and predictor names (as in "
                             "data.sampling.scheduler.length_aware.predictor)")
    parser.add_argument("--probe-tokens", default="8", type=harness.comma_numbers(1),
                        help="comma list of k for token-conditioned predictors")
    parser.add_argument("--signal-tokens", default="1,2,4,8,16,32",
                        type=harness.comma_numbers(1), help="k of the token-signal curve")
    parser.add_argument("--elapsed-tokens", default="0,8,32,64,128",
                        type=harness.comma_numbers(0), help="t of the elapsed-tokens curve")
    parser.add_argument("--gain-z", default=str(GAIN_Z), type=parse_gain_z,
                        help="comma list of the gate's thresholds (scheduler.length_aware.gain_z, > 0), 'none' for "
                             "ungated")
    parser.add_argument("--preempt-tokens", default=str(InfiniteSchedulerConfig().preempt_tokens),
                        type=parse_preempt_tokens, help="comma list of preemption quanta (scheduler.preempt_tokens, "
                                                        ">= 1), 'none' for never")
    parser.add_argument("--setups", type=parse_setups, default=list(SETUPS), help="B,G,g;B,G,g")
    parser.add_argument("--noisy", default="0.25,0.5,1.0", help="spreads of the noisy-oracle reference curve")
    parser.add_argument("--orders", type=int, default=1, metavar="N",
                        help="walk the prompts in N orders: the recording's, then N - 1 seeded shuffles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features-cache", type=Path, help="keep the computed features here (a .pt file)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="write the tables here (and print them)")
    args = parser.parse_args(argv)
    args.predictors = [name for name in args.predictors.split(",") if name]
    if args.orders < 1:
        parser.error(f"--orders {args.orders}: use an integer >= 1")
    args.noisy = [spread for spread in args.noisy.split(",") if spread]
    args.predictors += [f"noisy:{spread}" for spread in args.noisy]
    for name in args.predictors:
        try:
            name == "none" or make_predictor(name)
        except ValueError as error:
            parser.error(f"--predictors: {error}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    record = read_recording(args.recording)
    if not has_tokens(record):
        raise SystemExit(f"{args.recording} holds lengths only; the study needs a token recording "
                         "(tools.record_lengths --tokens)")
    features = load_features(args, record, sorted(set(args.probe_tokens) | set(args.signal_tokens)))
    lengths = record["lengths"]
    signals = {"group_share": group_share(lengths), "long_threshold": long_threshold(lengths),
               "token": [token_signal(lengths, features, k) for k in args.signal_tokens],
               "noisy_tail_auc": {spread: noisy_tail_auc(lengths, float(spread), args.seed) for spread in args.noisy},
               "elapsed": elapsed_signal(lengths, args.elapsed_tokens)}
    setups = []
    for B, G, g in args.setups:
        walks = [RecordingWalk(record, features, B, G, g, order) for order in prompt_orders(len(lengths), args.orders)]
        runs = [(name, k, z, q) for name in args.predictors
                for k in (args.probe_tokens if name != "none" and make_predictor(name).token_conditioned else [None])
                for z in ([None] if name == "none" else args.gain_z) for q in args.preempt_tokens]
        setups.append({"B": B, "G": G, "g": g, "prompts_used": walks[0].used_prompts,
                       "rows": study_setup(walks, runs, args.seed)})
    report = {"config": harness.config_record(args, meta=record["meta"]), "signals": signals, "setups": setups}
    _print(report)
    harness.write_json(args.json, report)
    if args.markdown:
        harness.write_text(args.markdown, markdown(report))
    return report


def markdown(report: dict) -> str:
    """The report as the docs' tables: per setup, decode steps (x continuous) and the predictions' quality."""
    lines = []
    for setup in report["setups"]:
        lines += [f"B {setup['B']}, G {setup['G']}, g {setup['g']}:", "",
                  "| predictor | k | gain_z | preempt_tokens | decode steps | x continuous | oracle's gain kept | "
                  "x continuous per order | Kendall tau | log RMSE | guided | preempting |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in setup["rows"]:
            cells = [row["predictor"], row["probe_tokens"] or "-", _z(row["gain_z"]), row["preempt_tokens"] or "-",
                     row["decode_steps"], f"{row['ratio']:.3f}", _fmt(row["kept"]), _ratios(row["order_ratios"]),
                     _fmt(row["kendall_tau"]), _fmt(row["log_rmse"]), _fmt(row["guided"]), _fmt(row["preempting"])]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    signals = report["signals"]
    noisy = ", ".join(f"noisy:{spread} {_fmt(auc)}" for spread, auc in signals["noisy_tail_auc"].items())
    lines += [f"Between-group share of the log-length variance: {signals['group_share']:.3f}. Long samples: longer "
              f"than {signals['long_threshold']} tokens; the noisy oracle's tail AUC: {noisy or '-'}.", "",
              "| online's token model at k | samples | Kendall tau | log RMSE | tail AUC |", "|---|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['samples']} | {_fmt(r['kendall_tau'])} | {_fmt(r['log_rmse'])} | "
              f"{_fmt(r['tail_auc'])} |" for r in signals["token"]]
    lines += ["", "| elapsed tokens t | still running | log RMSE of E[L given L > t] | of max(median, t + 1) |",
              "|---|---|---|---|"]
    lines += [f"| {r['t']} | {r['running']:.2f} | {_fmt(r['log_rmse'])} | {_fmt(r['median_log_rmse'])} |"
              for r in signals["elapsed"]]
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratios(ratios: list[float]) -> str:
    return " / ".join(f"{ratio:.3f}" for ratio in ratios)


def _z(gain_z: float | None) -> str:
    return "none" if gain_z is None else f"{gain_z:g}"


def _print(report: dict) -> None:
    print(f"between-group share of log-length variance: {report['signals']['group_share']:.3f}")
    for row in report["signals"]["token"]:
        print(f"online at k={row['k']:>3}: samples {row['samples']}, tau {row['kendall_tau']}, "
              f"log_rmse {row['log_rmse']}, tail_auc {row['tail_auc']} (long: > {report['signals']['long_threshold']})")
    for spread, auc in report["signals"]["noisy_tail_auc"].items():
        print(f"noisy:{spread} tail_auc {auc}")
    for row in report["signals"]["elapsed"]:
        print(f"elapsed t={row['t']:>3}: running {row['running']:.2f}, log_rmse {row['log_rmse']} (max(population "
              f"median, t + 1): {row['median_log_rmse']})")
    for setup in report["setups"]:
        print(f"B {setup['B']}, G {setup['G']}, g {setup['g']}")
        for row in setup["rows"]:
            cells = [f"{row['predictor']:>16s}", f"k={row['probe_tokens']}", f"z={_z(row['gain_z'])}",
                     f"q={row['preempt_tokens']}", f"steps {row['decode_steps']}",
                     f"ratio {row['ratio']:.3f}", f"kept {row['kept']}", f"per order {_ratios(row['order_ratios'])}",
                     f"tau {row['kendall_tau']}",
                     f"log_rmse {row['log_rmse']}", f"guided {row['guided']}", f"preempting {row['preempting']}"]
            print("  " + "  ".join(cells))


if __name__ == "__main__":
    main()
