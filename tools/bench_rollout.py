"""Rollout benchmark: lit_grpo's strategies against transformers' generate paths, in one process, interleaved.

    python -m tools.bench_rollout --model smollm2 --prompts 4 --group-size 16 --micro-group-size 4 \
        --max-new-tokens 128 --strategies full,micro,continuous,hf_generate,hf_generate_chunked,hf_generate_batch \
        --repeats 3 --json runs/rollout.json

    python -m tools.bench_rollout --model random:qwen3-1.7b --dtype bfloat16 --preset paper \
        --lengths tools/data/smollm2_gsm_symbolic_lengths.json --strategies full,continuous,infinite,micro \
        --predictors oracle --json runs/paper_gpu.json          # any GPU, offline: random weights, replayed lengths

    python -m tools.bench_rollout --model smollm2 --tokens tools/data/tokens/smollm2_demo_task_base.json.gz \
        --strategies continuous,infinite --predictors none,oracle       # the recorded tokens, prompts and cap

Replays (``config.replay``): ``--lengths FILE`` forces the recorded lengths (any ``tools/recordings.py`` recording);
``--tokens FILE`` makes every sample emit its recorded tokens after the recording's prompts (so hidden states and
probes see what they saw live); the recording's ``meta.max_new_tokens`` is ``--max-new-tokens``' default and ceiling.

Every repeat runs every strategy once, in turn (odd repeats in reverse order), so a slow patch of a noisy machine
and the place of a run in its repeat hit all of them alike; the JSON holds the median over repeats of each figure
(``repeats`` keeps every run). An infinite engine's scheduler, which learns from every rollout, starts each repeat
from the state its ``--warmup-rollouts`` left (none: cold), so that repeats are replicas. Figures:
decode_steps, prefill_tokens, generated_tokens, lower_bound_steps, slot_utilization, peak_kv_bytes (KV tensors,
padding included), peak_memory_bytes (the CUDA allocator's peak during the run, or the resident high-water mark
on CPU), peak_rss_bytes (the process's resident high-water mark), wall_s, tokens_per_s, ms_per_step
(``(wall_s - capture_s) / decode_steps``: the steady decode step, the one-off graph capture left out; it stays in
wall_s and tokens_per_s), capture_s, identical_fraction (share of completions equal to the "full" run's in the same
repeat), compile (the run's ``data.sampling.compile``: ``--compile false,true`` measures both, interleaved),
cpu_linear (its ``data.sampling.cpu_linear``: ``--cpu-linear onednn,packed`` measures both, interleaved),
decode_attention (its ``data.sampling.decode_attention``: ``--decode-attention matmul,sdpa_gqa`` measures both),
control (true on the run of ``--control``'s second, identical engine), and for lit_grpo's engine forward_fraction
(time in prefill and decode steps / wall time). "config" carries weights_bytes and the device's name.

The roofline (tools/roofline.py): once per process, after the runs (so its buffers touch no run's peak memory),
the machine's matmul rate and memory read bandwidth are measured with torch's kernels and recorded as
``config["roofline"]`` (with the device's name: ``lscpu``'s model name or the GPU's). Every record then carries
mean_context (positions a decode step's row attends, averaged over every sample's steps, padding not counted),
floor_ms_per_step (the fewest ms a decode step of the run's rows, all its slots, at that mean context could take:
the longer of its FLOPs at the matmul rate and its bytes at the bandwidth), floor_bound ("compute" or "memory",
which one sets the floor), roofline_ratio = ms_per_step / floor_ms_per_step, decode_ms_per_step
(``1000 * decode_s / decode_steps``: the decode steps' own time) and decode_roofline_ratio = decode_ms_per_step /
floor_ms_per_step; and for prefill prefill_ms_per_token (``1000 * prefill_s / prefill_tokens``, the engine's
synchronised prefill time), prefill_floor_ms_per_token (every prompt's first P - 1 tokens in one forward, the
weights read once, per token), prefill_floor_bound and prefill_roofline_ratio. ms_per_step holds the rollout's
prefill and the engine's bookkeeping too, so roofline_ratio is the whole rollout's distance from the decode floor
and decode_roofline_ratio the decode step's own. The hf_generate* strategies time neither prefill nor decode steps
of their own (both are inside ``generate``): their prefill fields and decode_* fields are null; generate_batch
counts no decode steps: its other decode fields are null too. The ratios of the median record are ratios of the
medians.

Each engine frees its slot cache (and CUDA graph) after every run, so a run's peak memory holds the weights and
that run's own allocations only, as in training, where the cache is freed before the update.

Baselines: hf_generate = one ``model.generate`` over all B x G rows, left-padded (TRL without vLLM);
hf_generate_chunked = the same over chunks of g rows; hf_generate_batch = transformers' continuous batching
(``generate_batch``), whose paged cache hides decode steps and KV bytes (reported as null).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path
from typing import get_args

import torch
from transformers import GenerationConfig

from lit_grpo.sampling import RolloutEngine, lower_bound_steps
from lit_grpo.sampling.cpu_linear import CpuLinear
from lit_grpo.sampling.decode_attention import DECODE_KERNELS
from lit_grpo.sampling.memory_budget import kv_row_bytes
from lit_grpo.scheduling.length_aware.predictors import make_predictor, parse_predictor_name
from lit_grpo.scheduling.length_aware.refill import RefillName
from tools import harness, roofline
from tools.recordings import read_replay

OUR_STRATEGIES = ("full", "micro", "continuous", "infinite")
HF_STRATEGIES = ("hf_generate", "hf_generate_chunked", "hf_generate_batch")
#: The strategies ``--control`` can run twice: no learned state, so two engines of one are identical.
CONTROLLED = ("full", "micro", "continuous")
PRESETS = {"paper": dict(prompts=1, group_size=32, micro_group_size=8, max_new_tokens=1024, task="gsm_symbolic")}
FIELDS = ("decode_steps", "prefill_tokens", "generated_tokens", "lower_bound_steps", "slot_utilization",
          "peak_kv_bytes", "peak_memory_bytes", "peak_rss_bytes", "wall_s", "tokens_per_s", "ms_per_step",
          "capture_s", "prefill_s", "forward_fraction", "identical_fraction", "mean_context", "floor_ms_per_step",
          "roofline_ratio", "decode_ms_per_step", "decode_roofline_ratio", "prefill_ms_per_token",
          "prefill_floor_ms_per_token", "prefill_roofline_ratio")


# ----------------------------------------------------------------------------------------------- runners
def run_engine(engine: RolloutEngine, prompts, replay: dict,
               scheduler_state: dict | None = None) -> tuple[dict, list[list[int]]]:
    """One rollout; ``replay``: ``generate``'s ``lengths=`` or ``tokens=`` (empty: sampled freely);
    ``scheduler_state``: what the scheduler starts from (a copy is loaded), else what the last rollout left."""
    if scheduler_state is not None:
        engine.scheduler.load_state_dict(copy.deepcopy(scheduler_state))
    result = engine.generate(prompts, **replay)
    engine.release()  # the next run's peak memory must not hold this engine's cache
    stats = result.stats
    record = stats.scalars()
    record["forward_fraction"] = stats.forward_s / stats.wall_s
    record.update(ms_per_step=stats.ms_per_step, decode_ms_per_step=stats.decode_ms_per_step,
                  prefill_ms_per_token=stats.prefill_ms_per_token)
    return record, [c for group in result.completion_ids for c in group]


def _strip_after_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row


def run_hf_generate(model, tokenizer, prompts, G, chunk_rows, args, eos) -> tuple[dict, list[list[int]]]:
    """``model.generate`` over left-padded chunks of ``chunk_rows`` rows (all B x G rows when chunk_rows is None)."""
    rows = [p for p in prompts for _ in range(G)]
    chunk_rows = chunk_rows or len(rows)
    completions, steps, prefill, peak_kv = [], 0, 0, 0
    start = time.perf_counter()
    for i in range(0, len(rows), chunk_rows):
        chunk = rows[i:i + chunk_rows]
        batch = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=_generation_config(args, eos, tokenizer))
        new = out[:, batch["input_ids"].shape[1]:]
        completions += [_strip_after_eos(row, eos) for row in new.tolist()]
        steps += new.shape[1]
        prefill += batch["input_ids"].numel()
        # generate's DynamicCache holds every row, padding included, for prompt + all but the last new token (a
        # sliding layer its last window of them, as the engine's rows: kv_row_bytes).
        positions = batch["input_ids"].shape[1] + new.shape[1] - 1
        peak_kv = max(peak_kv, len(chunk) * kv_row_bytes(model.config, model.dtype, positions))
    wall = time.perf_counter() - start
    generated = sum(map(len, completions))
    record = dict(decode_steps=steps, prefill_tokens=prefill, generated_tokens=generated,
                  num_slots=min(chunk_rows, len(rows)),
                  lower_bound_steps=lower_bound_steps(list(map(len, completions)), min(chunk_rows, len(rows))),
                  slot_utilization=generated / (steps * min(chunk_rows, len(rows))), peak_kv_bytes=peak_kv,
                  wall_s=wall, tokens_per_s=generated / wall, ms_per_step=1000 * wall / max(steps, 1))
    return record, completions


def run_hf_generate_batch(model, tokenizer, prompts, G, args, eos) -> tuple[dict, list[list[int]]]:
    rows = [p for p in prompts for _ in range(G)]
    start = time.perf_counter()
    with torch.no_grad():  # generate_batch updates its static tensors in place: inference_mode forbids that
        outputs = model.generate_batch(inputs=rows, generation_config=_generation_config(args, eos, tokenizer),
                                       progress_bar=False)
    wall = time.perf_counter() - start
    by_index = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    failed = [o.request_id for o in by_index if o.error]
    if failed or len(by_index) != len(rows):
        raise RuntimeError(f"generate_batch failed requests {failed[:5]} ({len(by_index)} of {len(rows)} returned)")
    completions = [_strip_after_eos(list(o.generated_tokens), eos) for o in by_index]
    generated = sum(map(len, completions))
    record = dict(decode_steps=None, prefill_tokens=sum(map(len, rows)), generated_tokens=generated,
                  lower_bound_steps=None, slot_utilization=None, peak_kv_bytes=None, wall_s=wall,
                  tokens_per_s=generated / wall)
    return record, completions


def _generation_config(args, eos: set[int], tokenizer) -> GenerationConfig:
    sampling = args.temperature > 0
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sampling,
                            temperature=args.temperature if sampling else None,
                            top_p=args.top_p if sampling else None, top_k=args.top_k if sampling else None,
                            repetition_penalty=args.repetition_penalty, eos_token_id=sorted(eos),
                            pad_token_id=tokenizer.pad_token_id)


def _check_predictor(name: str) -> str:
    """"none" (the default scheduler) or a length predictor's name."""
    if name != "none":
        try:
            parse_predictor_name(name)
        except ValueError as error:
            raise ValueError(f"{error} (or none: the default scheduler)") from None
    return name


def _predictor(name: str, seed: int):
    """A predictor name, or for "noisy:S" the predictor itself, its noise seeded by the benchmark's seed."""
    return make_predictor(name, seed=seed) if parse_predictor_name(name)[0] == "noisy" else name


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_argument(parser, default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: cuda when available)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="paper: B 1, G 32, g 8, 1024 tokens, gsm_symbolic")
    parser.add_argument("--prompts", type=int, help="B, prompts per rollout (default 4, or the replayed file's)")
    parser.add_argument("--group-size", type=int, help="G (default 16, or the replayed file's)")
    parser.add_argument("--micro-group-size", type=int, default=4, help="g, concurrent slots")
    parser.add_argument("--max-new-tokens", type=int,
                        help="the length cap (default 128, or the --tokens recording's; never above the latter)")
    parser.add_argument("--strategies", default="full,micro,continuous,infinite",
                        type=harness.comma_names(OUR_STRATEGIES + HF_STRATEGIES),
                        help=f"comma list of {','.join(OUR_STRATEGIES + HF_STRATEGIES)}")
    parser.add_argument("--predictors", default="none", type=harness.comma_checked(_check_predictor),
                        help="infinite's schedulers: none (the default: least attained service, no predictor), or "
                             "the paper's length-aware method with predictor online, oracle or noisy:S (the oracle "
                             "with log-normal error of spread S in log-length, seeded by --seed; replay only)")
    parser.add_argument("--refills", type=harness.comma_names(get_args(RefillName)),
                        help="the length-aware method's refill policies: sjf,lpt,fifo (default: its own)")
    parser.add_argument("--warmup-rollouts", type=int, default=0,
                        help="rollouts each infinite engine runs before the measured repeats (predictor warm-up), "
                             "on other samples: a replay's next B (a --lengths replay keeps the task's prompt "
                             "texts, with the next recorded lengths; a set of only B repeats them), else fresh "
                             "prompts of the task (seed + 1)")
    parser.add_argument("--lengths", type=Path,
                        help='a recording (tools/recordings.py) or JSON {"lengths": [[L, ...] per prompt]}: replay '
                             'its lengths; sets B and G, or a given (or preset) B and G take the first B prompts '
                             'and their first G samples')
    parser.add_argument("--tokens", type=Path,
                        help="a token recording (.json or .json.gz, tools.record_lengths --tokens): replay its "
                             "prompts and completions; B and G as for --lengths")
    parser.add_argument("--task", help="reasoning-gym task for the prompts, or 'synthetic' (default: "
                                       "basic_arithmetic; synthetic for random:NAME models)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="data.sampling.repetition_penalty, and generate's for the baselines (1.0: off)")
    parser.add_argument("--stop-strings", type=lambda text: [s for s in text.split(",") if s], default=[],
                        help="data.sampling.stop_strings of lit_grpo's runs, a comma list (not with the hf_* "
                             "baselines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--compile", default="false",
                        type=harness.comma_names({"false": False, "true": True, "auto": "auto"}),
                        help="data.sampling.compile of lit_grpo's runs, a comma list of false,true,auto: each value "
                             "runs every strategy (interleaved, so compiled and eager ratios come from one process)")
    parser.add_argument("--cpu-linear", default="auto",
                        type=harness.comma_names(get_args(CpuLinear)),
                        help="data.sampling.cpu_linear of lit_grpo's runs, a comma list of "
                             "auto,packed,onednn,torch: each value runs every strategy, interleaved")
    parser.add_argument("--decode-attention", default="matmul", type=harness.comma_names(DECODE_KERNELS),
                        help="data.sampling.decode_attention of lit_grpo's runs, a comma list of matmul,sdpa_gqa: "
                             "each value runs every strategy, interleaved")
    parser.add_argument("--control", action="store_true",
                        help="also run, in every repeat, a second engine identical to the first of full, micro, "
                             "continuous in --strategies (labelled S[control]): its ratio to the first is what the "
                             "measurement alone spreads by on this machine")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.stop_strings and (baselines := [s for s in args.strategies if s in HF_STRATEGIES]):
        parser.error(f"--stop-strings is lit_grpo's setting; the baselines {baselines} run without it: leave them out")
    if args.tokens and args.lengths:
        parser.error("--tokens and --lengths are two replays: give one (a token replay forces its lengths too)")
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            if key != "task" or args.task is None:
                setattr(args, key, value)
    if args.max_new_tokens is None and not args.tokens:
        args.max_new_tokens = 128  # with --tokens, the recording's cap (read_replay)
    args.task = harness.default_task(args.model, args.task)
    if args.control and _control_strategy(args) is None:
        parser.error(f"--control repeats the first of {list(CONTROLLED)} in --strategies; it has none of them: "
                     f"{args.strategies}")
    return args


def _control_strategy(args) -> str | None:
    """The strategy ``--control`` runs twice: the first of CONTROLLED in ``--strategies`` (None without --control)."""
    return next((s for s in args.strategies if s in CONTROLLED), None) if args.control else None


def build_runners(args, model, tokenizer, rollout):
    """(label, extra record fields, callable) for every measured run of a repeat. ``rollout(i)``: the prompts and
    replay keywords (see run_engine) of rollout i, 0 the measured one, i > 0 an infinite engine's warm-up."""
    prompts, replay = rollout(0)
    G, g, eos = args.group_size, args.micro_group_size, None
    common = dict(group_size=G, micro_group_size=g, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  repetition_penalty=args.repetition_penalty, stop_strings=args.stop_strings, seed=args.seed)
    runners = []
    for compile_, cpu_linear, attention in itertools.product(args.compile, args.cpu_linear, args.decode_attention):
        tag = ",".join(filter(None, ("" if compile_ is False else f"compile={str(compile_).lower()}",
                                     "" if len(args.cpu_linear) == 1 else f"cpu_linear={cpu_linear}",
                                     "" if attention == "matmul" else f"decode_attention={attention}")))
        options = dict(common, compile=compile_, cpu_linear=cpu_linear, decode_attention=attention)
        for strategy in args.strategies:
            if strategy == "infinite":
                for predictor in args.predictors:
                    for refill in [None] if predictor == "none" else args.refills or [None]:
                        scheduler = {} if predictor == "none" else (
                            {"predictor": _predictor(predictor, args.seed)} | ({"refill": refill} if refill else {}))
                        engine = RolloutEngine(model, tokenizer, strategy="infinite", **options, **scheduler)
                        for i in range(1, args.warmup_rollouts + 1):
                            warmup_prompts, warmup_replay = rollout(i)
                            engine.generate(warmup_prompts, **warmup_replay)
                        engine.release()
                        # the predictor keeps what it learned, but the measured rollouts draw the same random streams
                        # as the other strategies' (keyed by rollout index), so identical_fraction compares like
                        # with like
                        engine.rollout_index = 0
                        refill = getattr(engine.scheduler, "refill", None)
                        fields = {"predictor": predictor, "refill": refill and refill.name, "compile": compile_,
                                  "cpu_linear": cpu_linear, "decode_attention": attention}
                        label = ",".join(filter(None, (predictor, fields["refill"], tag)))
                        # the scheduler learns from every rollout (the gate's groups, a predictor and its trust):
                        # each repeat starts from the state the warm-ups left, so that repeats are replicas
                        warmed = copy.deepcopy(engine.scheduler.state_dict())
                        runners.append((f"infinite[{label}]", fields,
                                        lambda e=engine, s=warmed: run_engine(e, prompts, replay, s)))
            elif strategy in OUR_STRATEGIES:
                for control in (False, True) if strategy == _control_strategy(args) else (False,):
                    engine = RolloutEngine(model, tokenizer, strategy=strategy, **options)
                    eos = set(engine.eos_token_ids)
                    label = ",".join(filter(None, (tag, "control" if control else "")))
                    fields = {"compile": compile_, "cpu_linear": cpu_linear, "decode_attention": attention} | (
                        {"control": True} if control else {})
                    runners.append((f"{strategy}[{label}]" if label else strategy, fields,
                                    lambda e=engine: run_engine(e, prompts, replay)))
    eos = eos or set(RolloutEngine(model, tokenizer, group_size=G).eos_token_ids)
    if replay and any(s in HF_STRATEGIES for s in args.strategies):
        raise SystemExit(f"--{next(iter(replay))} replays inside lit_grpo's engine; drop the hf_* strategies "
                         f"{[s for s in args.strategies if s in HF_STRATEGIES]}")
    for strategy in args.strategies:
        if strategy in HF_STRATEGIES:
            runners.append((strategy, {}, lambda s=strategy: run_hf(s, model, tokenizer, prompts, args, eos)))
    return runners


def run_hf(strategy: str, model, tokenizer, prompts, args, eos) -> tuple[dict, list[list[int]]]:
    """One run of a transformers generator (``HF_STRATEGIES``) on ``prompts``, ``args.group_size`` rows each."""
    if strategy == "hf_generate_batch":
        return run_hf_generate_batch(model, tokenizer, prompts, args.group_size, args, eos)
    chunk_rows = args.micro_group_size if strategy == "hf_generate_chunked" else None
    return run_hf_generate(model, tokenizer, prompts, args.group_size, chunk_rows, args, eos)


def _warm_up_hf_generators(args, model, tokenizer, prompts) -> None:
    """Run each ``hf_*`` strategy of ``args`` once, untimed, on the measured rows with 4 new tokens."""
    short = argparse.Namespace(**{**vars(args), "max_new_tokens": 4})
    eos = set(RolloutEngine(model, tokenizer, group_size=2).eos_token_ids)
    for strategy in args.strategies:
        if strategy in HF_STRATEGIES:
            run_hf(strategy, model, tokenizer, prompts, short, eos)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    torch.manual_seed(args.seed)
    recording = read_replay(args)
    model, tokenizer = harness.load_policy(args.model, args.dtype, args.device)
    args.prompts, args.group_size = args.prompts or 4, args.group_size or 16
    B = args.prompts
    task_prompts = harness.task_prompts(tokenizer, args.task, B, args.seed)
    # Warm-up rollouts run other samples than the measured one (a replay's next ones, on the task's prompt texts for
    # a --lengths replay; fresh prompts of the task, drawn with the next seed), so no predictor is measured on
    # samples it learned from.
    warmup_prompts = (harness.task_prompts(tokenizer, args.task, B * args.warmup_rollouts, args.seed + 1)
                      if args.warmup_rollouts and recording is None else [])

    def rollout(i: int) -> tuple[list[list[int]], dict]:
        if recording is not None:
            try:
                prompts, replay = recording.rollout(i)
            except ValueError as error:
                raise SystemExit(f"--{recording.kind}: {error}") from None
            return prompts or task_prompts, replay
        return (task_prompts if i == 0 else warmup_prompts[(i - 1) * B: i * B]), {}

    prompts, replay = rollout(0)
    runners = build_runners(args, model, tokenizer, rollout)
    # One short untimed rollout first, so one-time kernel and allocator set-up is charged to no strategy; and one of
    # each transformers generator at the measured rows, whose first call sets up more (generate_batch's manager).
    RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=4, seed=args.seed).generate(prompts[:1])
    _warm_up_hf_generators(args, model, tokenizer, prompts)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()

    repeats: dict[str, list[dict]] = {label: [] for label, _, _ in runners}
    # The device's peak (CUDA allocator, or resident memory on CPU) and the host's resident peak.
    trackers = {name: harness.peak_tracker(device, name)
                for name, device in (("peak_memory_bytes", model.device), ("peak_rss_bytes", torch.device("cpu")))}
    for repeat in range(args.repeats):
        # Odd repeats run the strategies in reverse order, so the place of a run in its repeat (what the run
        # before it left in caches and the allocator) favours no strategy over the repeats.
        completed = {}
        for label, fields, run in runners if repeat % 2 == 0 else runners[::-1]:
            for tracker in trackers.values():
                tracker.reset()
            record, completions = run()
            record.update({name: tracker.read()["peak_bytes"] for name, tracker in trackers.items()})
            completed[label] = completions
            record["mean_context"] = roofline.mean_decode_context(
                [len(p) for p in prompts for _ in range(args.group_size)], list(map(len, completions)))
            repeats[label].append({"strategy": label.split("[")[0], **fields, **record})
            print(f"repeat {repeat} {label:28s} steps={record['decode_steps']} tok/s={record['tokens_per_s']:.1f} "
                  f"kv={record['peak_kv_bytes']} util={record['slot_utilization']}", file=sys.stderr, flush=True)
        reference = completed.get("full")
        for label, completions in completed.items():
            repeats[label][-1]["identical_fraction"] = (
                None if reference is None else sum(a == b for a, b in zip(completions, reference)) / len(reference))

    machine = roofline.measure_machine(model.device, model.dtype)
    prefill_floor = roofline.prefill_floor(model.config, model.dtype, prompts, machine)
    for records in repeats.values():
        for record in records:
            roofline.add_to_record(record, model.config, model.dtype, machine, prefill_floor)
    runs = []
    for records in repeats.values():
        run = harness.median_record(records, FIELDS)
        # the floor of the median context
        roofline.add_to_record(run, model.config, model.dtype, machine, prefill_floor)
        runs.append(run)
    device = (torch.cuda.get_device_name(model.device) if model.device.type == "cuda"
              else f"cpu ({torch.get_num_threads()} threads)")
    config = harness.config_record(args, model=harness.resolve_model(args.model), replay=next(iter(replay), None),
                                   weights_bytes=harness.weights_bytes(model), device=device,
                                   dtype=str(model.dtype).removeprefix("torch."), roofline=machine)
    report = {"config": config, "runs": runs}
    _print_table(runs)
    harness.write_json(args.json, report)
    return report


def _print_table(runs: list[dict]) -> None:
    columns = ("decode_steps", "lower_bound_steps", "slot_utilization", "peak_kv_bytes", "peak_memory_bytes",
               "tokens_per_s", "ms_per_step", "floor_ms_per_step", "roofline_ratio", "decode_ms_per_step",
               "decode_roofline_ratio", "prefill_ms_per_token",
               "prefill_floor_ms_per_token", "prefill_roofline_ratio", "forward_fraction", "identical_fraction")
    label = lambda r: (r["strategy"] + (f"[{r['predictor']},{r['refill']}]" if "predictor" in r else "")
                       + (f" compile={str(r['compile']).lower()}" if r.get("compile") not in (None, False) else "")
                       + (f" cpu_linear={r['cpu_linear']}" if r.get("cpu_linear") not in (None, "auto") else "")
                       + (f" {r['decode_attention']}" if r.get("decode_attention") not in (None, "matmul") else "")
                       + (" control" if r.get("control") else ""))
    widths = [max(20, len(c) + 2) for c in columns]
    # as wide as the longest label: one grows with every option measured (compile, cpu_linear, decode_attention)
    first = max([30, *(len(label(run)) + 2 for run in runs)])
    print(f"{'strategy':{first}s}" + "".join(f"{c:>{w}s}" for c, w in zip(columns, widths)))
    for run in runs:
        cells = ["-" if run.get(c) is None else f"{run[c]:.3f}" if isinstance(run[c], float) else str(run[c])
                 for c in columns]
        print(f"{label(run):{first}s}" + "".join(f"{c:>{w}s}" for c, w in zip(cells, widths)))


if __name__ == "__main__":
    main()
