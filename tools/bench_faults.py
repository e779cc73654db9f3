"""Fault injection: runs killed at seeded random moments and resumed from ``last.ckpt`` must equal an uninterrupted run.

    python -m tools.bench_faults --kills 20 --json runs/faults.json
    python -m tools.bench_faults --kills 6 --variant partial      # data.over_provision 2.0 (carried samples)
    python -m tools.bench_faults --kills 4 --variant ddp          # 2 processes on the CPU (gloo)
    python -m tools.bench_faults --kills 3 --signal TERM          # SIGTERM (or INT) instead of SIGKILL

First one uninterrupted run of ``--config`` (tiny by default) for ``--steps`` steps. Then ``--kills`` runs, each
started with ``--ckpt_path last`` (as a restart loop would), stopped once at a seeded random moment inside a
rollout, inside an update or during a checkpoint write (in turn), and started again with ``--ckpt_path last``
until it finishes. Every run saves ``last.ckpt`` every ``--save-every`` steps and after each validation
(``RunCheckpoint``), records every step (``tools.step_recorder.StepRecorder``) and traces its phases
(``PhaseTrace`` below). SIGKILL goes to the run's whole process group, as when a machine is lost.

Per kill the record says: "target" (the phase aimed at), "struck" (where it landed: "checkpoint write" when a
partial checkpoint file was on disk at that moment, else the phase the trace was in), "step" (steps completed
when it struck), "resumed_from" (the step of the checkpoint the next start loaded), "steps_redone", "checkpoint
readable" (the newest last.ckpt reads back: ``lit_grpo.runtime.checkpoints.read_checkpoint_header``), "exit_code" of the
stopped process (143 / 130 for signals, -9 for SIGKILL; 0, and "struck" says "missed", when the run was faster than
the reference and ended before the stop came), and "exact": every step's prompts, completions,
rewards, advantages, loss and parameter sums and the final checkpoint's every weight and optimizer tensor equal
the uninterrupted run's bit for bit ("differences" names what differed). The summary counts exact resumes,
unreadable checkpoints and the most steps redone.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback

from lit_grpo.runtime.checkpoints import PARTIAL
from tools import harness
from tools.roofline import device_name

ROOT = harness.ROOT
TARGETS = ("rollout", "update", "checkpoint")
VARIANTS = {
    "default": [],
    "partial": ["--data.over_provision", "2.0", "--data.max_staleness", "1", "--data.sampling.micro_group_size", "6",
                "--data.sampling.max_new_tokens", "48"],
    "ddp": ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"],
}


class PhaseTrace(Callback):
    """Writes one line per phase change of a training run (rank 0): ``start STEP`` (the step it starts or
    resumes from), ``rollout K``, ``update K``, ``end K``, ``validation K``, ``write K`` / ``written K`` (a
    checkpoint file), each followed by the time. Flushed at once, so another process can follow it."""

    def __init__(self, path: str):
        self.path = path
        self._handle = None

    def _mark(self, trainer, phase: str, step: int) -> None:
        if trainer.is_global_zero:
            if self._handle is None:
                self._handle = open(self.path, "a", buffering=1)
            self._handle.write(f"{phase} {step} {time.monotonic():.6f}\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark(trainer, "start", trainer.global_step)
        datamodule, io = trainer.datamodule, trainer.strategy.checkpoint_io
        build, save = datamodule.build_train_batch, io.save_checkpoint

        def traced_build():
            self._mark(trainer, "rollout", trainer.global_step + 1)
            return build()

        def traced_save(*args, **kwargs):
            self._mark(trainer, "write", trainer.global_step)
            save(*args, **kwargs)
            self._mark(trainer, "written", trainer.global_step)

        datamodule.build_train_batch, io.save_checkpoint = traced_build, traced_save

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._mark(trainer, "update", trainer.global_step + 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._mark(trainer, "end", trainer.global_step)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._mark(trainer, "validation", trainer.global_step)


def read_trace(path: Path) -> list[tuple[str, int, float]]:
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(phase, int(step), float(at)) for phase, step, at in (line for line in lines if len(line) == 3)]


def run_config(config: str, save_every: int, folder: Path) -> Path:
    """``config`` with one RunCheckpoint (every ``save_every`` steps and each validation) and the recorders."""
    settings = yaml.safe_load(Path(config).read_text())
    trainer = settings.setdefault("trainer", {})
    callbacks = [cb for cb in trainer.get("callbacks") or [] if not str(cb.get("class_path", "")).endswith(
        ("ModelCheckpoint", "RunCheckpoint"))]
    callbacks.append({"class_path": "lit_grpo.callbacks.RunCheckpoint",
                      "init_args": {"every_n_train_steps": save_every, "train_time_interval": None}})
    trainer["callbacks"], trainer["enable_checkpointing"] = callbacks, True
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def command(config: Path, steps: int, root: Path, attempt: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "lit_grpo.cli", "fit", "--config", str(config), "--trainer.max_steps", str(steps),
            "--trainer.default_root_dir", str(root), "--ckpt_path", "last", *extra,
            "--trainer.callbacks+=tools.step_recorder.StepRecorder", f"--trainer.callbacks.path={root / 'rec'}",
            "--trainer.callbacks+=tools.bench_faults.PhaseTrace", f"--trainer.callbacks.path={root}/trace.{attempt}"]


def start(cmd: list[str], root: Path, attempt: int) -> subprocess.Popen:
    env = harness.repo_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log = open(root / f"log.{attempt}", "w")
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, root: Path, attempt: int, timeout: float) -> int:
    code = proc.wait(timeout=timeout)
    if code != 0:
        log = (root / f"log.{attempt}").read_text()[-4000:]
        raise RuntimeError(f"run {root} attempt {attempt} failed ({code}):\n{log}")
    return code


def partial_files(root: Path) -> list[Path]:
    """The partial checkpoint files of unfinished saves under ``root``
    (``lit_grpo.runtime.checkpoints.partial_path``)."""
    return [p for p in root.rglob("*.partial") if PARTIAL.match(p.name)]


def phase_durations(trace: list[tuple[str, int, float]]) -> dict[str, float]:
    """Median seconds of each target phase in an uninterrupted run's trace."""
    spans: dict[str, list[float]] = {target: [] for target in TARGETS}
    for (phase, _, at), (_, _, after) in zip(trace, trace[1:]):
        key = {"rollout": "rollout", "update": "update", "write": "checkpoint"}.get(phase)
        if key:
            spans[key].append(after - at)
    return {key: statistics.median(values) if values else 0.0 for key, values in spans.items()}


def strike(proc: subprocess.Popen, root: Path, target: str, step: int, delay: float, signum: int,
           timeout: float) -> dict[str, Any]:
    """Wait for ``target`` of ``step`` in the trace, then ``delay`` more or until the trace moves on, whichever is
    first, and send ``signum`` (SIGKILL to the process group)."""
    trace_path, mark = root / "trace.0", {"rollout": "rollout", "update": "update", "checkpoint": "write"}[target]
    deadline = time.monotonic() + timeout
    while not any(p == mark and s >= step for p, s, _ in read_trace(trace_path)):
        if proc.poll() is not None:
            raise RuntimeError(f"{root}: the run ended before {target} {step}:\n{(root / 'log.0').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{root}: no {target} {step} within {timeout} s")
        time.sleep(0.0005)
    # The delay is scaled by the reference's phases; a run going faster than its reference must still be struck
    # in (or right after) the aimed phase, not after it ended: the next line of the trace cuts the wait short.
    size, until = trace_path.stat().st_size, time.monotonic() + delay
    while time.monotonic() < until and trace_path.stat().st_size == size:
        time.sleep(0.0002)
    writing = bool(partial_files(root))
    os.killpg(proc.pid, signum) if signum == signal.SIGKILL else os.kill(proc.pid, signum)
    trace = read_trace(trace_path)
    code = proc.wait(timeout=timeout)
    phase = trace[-1][0] if trace else "start-up"
    struck = "checkpoint write" if writing else {"end": "after a step", "written": "after a checkpoint write",
                                                  "write": "checkpoint (before its file)"}.get(phase, phase)
    done = max((s for p, s, _ in trace if p == "end"), default=0)
    return {"struck": struck, "step": done, "exit_code": code}


def compare(reference: Path, resumed: Path, world: int) -> list[str]:
    """What differs between two runs: per-step records of every rank, then the final checkpoint's tensors."""
    from tools.step_recorder import read_records

    differences = []
    keys = ("indices", "completion_ids", "rewards", "advantages", "loss", "grad_norm", "param_sum", "param_abs")
    for rank in range(world):
        a, b = read_records(str(reference / "rec"), rank), read_records(str(resumed / "rec"), rank)
        if [r["global_step"] for r in a] != [r["global_step"] for r in b]:
            differences.append(f"rank {rank}: steps {[r['global_step'] for r in b]}")
            continue
        differences += [f"rank {rank} step {x['global_step']}: {key}" for x, y in zip(a, b) for key in keys
                        if x[key] != y[key]]
    final = [torch.load(next(run.rglob("last.ckpt")), map_location="cpu", weights_only=False)
             for run in (reference, resumed)]
    for section in ("state_dict", "optimizer_states"):
        differences += [f"final {section}: {name}" for name in _tensor_differences(final[0][section],
                                                                                   final[1][section])]
    return differences


def _tensor_differences(a: Any, b: Any, name: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b) else [name]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{name} keys"]
        return [d for key in a for d in _tensor_differences(a[key], b[key], f"{name}.{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{name} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _tensor_differences(x, y, f"{name}[{i}]")]
    return [] if a == b else [name]


def resumed_from(root: Path, attempt: int) -> int:
    starts = [s for p, s, _ in read_trace(root / f"trace.{attempt}") if p == "start"]
    return starts[0] if starts else 0


def checkpoint_readable(root: Path) -> bool:
    from lit_grpo.runtime.checkpoints import find_last_checkpoint, read_checkpoint_header

    found = find_last_checkpoint(root.rglob("checkpoints"))
    if found is None:
        return True  # killed before the first save: a fresh start is right
    try:
        read_checkpoint_header(found)
        return True
    except (ValueError, OSError):
        return False


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=12, help="training steps of every run (M)")
    parser.add_argument("--kills", type=int, default=20, help="runs stopped once each (K)")
    parser.add_argument("--save-every", type=int, default=3, help="RunCheckpoint.every_n_train_steps")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    parser.add_argument("--signal", choices=("KILL", "TERM", "INT"), default="KILL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/faults", help="folder for the runs (emptied first)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each process")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.kills < 0 or args.save_every < 1:
        parser.error(f"--steps {args.steps} must be >= 3, --kills {args.kills} >= 0, --save-every "
                     f"{args.save_every} >= 1")
    out = Path(args.out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = run_config(args.config, args.save_every, out)
    extra, world = VARIANTS[args.variant], 2 if args.variant == "ddp" else 1
    signum = getattr(signal, f"SIG{args.signal}")

    reference = out / "reference"
    reference.mkdir()
    started = time.monotonic()
    finish(start(command(config, args.steps, reference, 0, extra), reference, 0), reference, 0, args.timeout)
    durations = phase_durations(read_trace(reference / "trace.0"))
    saved_steps = sorted({s for p, s, _ in read_trace(reference / "trace.0") if p == "write" and s > 0})
    print(f"reference: {args.steps} steps in {time.monotonic() - started:.0f} s; median phase seconds "
          + ", ".join(f"{k} {v:.3f}" for k, v in durations.items()), flush=True)

    records = []
    for kill in range(args.kills):
        rng = random.Random(args.seed * 100_003 + kill)
        target = TARGETS[kill % len(TARGETS)]
        # Never the last step: a stop aimed there can come after the run ended (the delay is scaled by the
        # reference run's phases, and a run may go faster than its reference did).
        steps = saved_steps[:-1] if target == "checkpoint" else list(range(2, args.steps))
        step = rng.choice(steps or [1])
        delay = rng.uniform(0.0, 0.9 * durations[target])
        root = out / f"kill{kill:02d}"
        root.mkdir()
        proc = start(command(config, args.steps, root, 0, extra), root, 0)
        record = {"kill": kill, "target": target, "aimed_step": step, "delay_s": round(delay, 6),
                  **strike(proc, root, target, step, delay, signum, args.timeout)}
        record["checkpoint_readable"] = checkpoint_readable(root)
        if record["exit_code"] == 0:  # the run was faster than the reference and ended before the stop came
            record.update(struck="missed (the run had ended)", step=args.steps, resumed_from=args.steps)
        else:
            finish(start(command(config, args.steps, root, 1, extra), root, 1), root, 1, args.timeout)
            record["resumed_from"] = resumed_from(root, 1)
        # A signal during an update lets the step finish, so its checkpoint can be one step past "step".
        record["steps_redone"] = max(0, record["step"] - record["resumed_from"])
        record["differences"] = compare(reference, root, world)
        record["exact"] = not record["differences"]
        records.append(record)
        print(f"kill {kill:2d}: aimed at {target} of step {step}, struck {record['struck']} after step "
              f"{record['step']} (exit {record['exit_code']}); resumed from step {record['resumed_from']}, "
              f"{record['steps_redone']} redone; checkpoint readable {record['checkpoint_readable']}; "
              f"exact {record['exact']}" + (f" ({record['differences'][:4]})" if record["differences"] else ""),
              flush=True)

    summary = {"kills": len(records), "exact": sum(r["exact"] for r in records),
               "unreadable_checkpoints": sum(not r["checkpoint_readable"] for r in records),
               "max_steps_redone": max((r["steps_redone"] for r in records), default=0),
               "struck": {where: sum(r["struck"] == where for r in records) for where in
                          sorted({r["struck"] for r in records})}}
    print(f"summary: {summary['exact']} of {summary['kills']} resumes exact, {summary['unreadable_checkpoints']} "
          f"unreadable checkpoints, at most {summary['max_steps_redone']} steps redone (save interval "
          f"{args.save_every}); struck: {summary['struck']}", flush=True)
    config = harness.config_record(args, world_size=world, phase_seconds=durations, device="cpu",
                                   cpu=device_name(torch.device("cpu")))
    result = {"config": config, "kills": records, "summary": summary}
    harness.write_json(args.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
