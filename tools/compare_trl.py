"""The same GRPO run in lit_grpo and in TRL's ``GRPOTrainer``, back to back: time per step, rollout, update, peak
memory and reward.

    python -m tools.compare_trl --make-trl-env ~/trl-venv             # once: a venv with TRL 1.16.0 (see below)
    python -m tools.compare_trl --trl-python ~/trl-venv/bin/python --shape demo --steps 8 \
        --json runs/compare_trl_demo.json --markdown runs/compare_trl_demo.md
    python -m tools.compare_trl --trl-python ~/trl-venv/bin/python --shape 4x32x64
    python -m tools.compare_trl --trl-python ~/trl-venv/bin/python --shape gsweep --timeout-s 3600
    python -m tools.compare_trl --trl-python ~/trl-venv/bin/python --shape demo --steps 30 --seeds 0,1,2 \
        --order lit,trl                                                # learning: reward within the seeds' spread
    python -m tools.compare_trl --trl-python ~/trl-venv/bin/python --model tiny-llama --steps 1   # a smoke run

**TRL's environment.** TRL runs under its own interpreter, ``--trl-python``. ``--make-trl-env DIR`` makes one: a
venv whose ``.pth`` line (``DIR/lib/python*/site-packages/lit_grpo_environment.pth``) adds this environment's site
directories with ``site.addsitedir``, so that their ``.pth`` files run too and torch, transformers and the editable
lit_grpo are this environment's very own, whether it is a venv or the base interpreter (``--system-site-packages``
would give the base interpreter's packages instead); then ``pip install --no-deps trl==1.16.0`` into the venv and,
of TRL's requirements, only those missing here, with every package of this environment pinned to its version
(``DIR/lit_grpo_constraints.txt``: nothing that transformers runs with is replaced in the venv). It refuses a TRL
requirement that needs another torch or transformers, installs nothing into this environment, and fails when the
venv's torch or transformers differ from this interpreter's.
pip's own settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ...). It makes the environment and exits (again on
the same DIR: updated in place); runs then take ``--trl-python DIR/bin/python``.

**The runs.** ``--shape`` picks the cells: ``demo`` (configs/demo.yaml: 4 prompts x G 8, 24 new tokens), ``4x32x64``
(4 x 32 at 64 tokens) or ``gsweep`` (1 prompt at 32 tokens, G = 8, 32, 64, 128; one timed step by default: memory
first; 8-row micro-batches and 8 slots at every G, what G 8 gets, so only G changes), or ``gpu_gsweep`` (the same at
G = 8, 32, 64 and 512 tokens, for a GPU: tools/gpu_compare_trl.sh). ``--lit-slots all`` gives lit_grpo one slot per
sample instead (every sample decodes at once, as in TRL's ``generate``), ``--lit-slots auto`` as many as the GPU's
free memory holds (``--shape gpu_long``: G 256, 32, 64, 128 at 4,096 tokens), ``--lit-slots 32`` 32 slots at every G
(memory flat in G). ``--group-sizes 32,64`` runs only the shape's cells of those G, in the shape's order (where a
device's time is short). Everything else is the demo's and set explicitly on both sides
(``tools.compare_trl_spec``): SmolLM2-135M-Instruct float32 (``--model`` for another), the reasoning-gym task, its
prompts, system prompt and chat template, the accuracy reward (lit_grpo's function, called by TRL as its reward
function), DAPO with epsilons 0.2 / 0.28 and beta 0, group reward scaling, lr 1e-5 with AdamW (0.9, 0.99; fused on a
GPU, as lit_grpo's) and 2 warm-up steps, gradient clipping 1.0, micro-batches of 16 rows (the sweep: 8) and one
optimizer step per GRPO step, temperature 1, ``--precision``, ``--threads`` and the seed. lit_grpo decodes with its
engine (the demo's strategy and g), TRL with ``model.generate`` (``--trl-generation continuous_batching``:
transformers' paged continuous batching). Each run is a fresh process (lit_grpo: the real ``lit-grpo fit`` with a
generated config; TRL: ``tools.compare_trl_runs``), ``--steps`` timed GRPO steps after ``--untimed-steps`` warm-up
steps (1; ``gpu_long``: none, its one step takes minutes), in the ``--order`` given for each seed (default
``lit,trl,trl,lit``: ABBA, so a drift of the machine falls on both). A run past ``--timeout-s`` is killed and
recorded as "timeout", one killed by the kernel or failing to allocate as "oom"; the steps it finished are kept. A
run that fails otherwise is recorded as "failed" with its output's end, and the comparison, having written
everything below, exits with status 1 (a timeout or "oom" is an outcome of its cell, not a failure). SIGTERM to this
process (a command's own time limit) kills the run in flight, records it as "stopped" with the steps it finished,
writes everything below once more and exits with status 143.

**What is measured, per step** (definitions in ``tools.compare_trl_runs``): ``step_s`` (the end of one optimizer
step to the end of the next), ``rollout_s`` (lit_grpo: the batch fetch, i.e. prompt draw, generation, scoring,
advantages; TRL: ``_generate_and_score_completions``, the same work), ``generate_s`` (the generation alone),
``update_s`` (the rest), the mean reward, and peak memory; and lit_grpo's engine: its slots, its decode step's
milliseconds against their floor (the bytes it read at the device's read bandwidth) and its tokens/s. Memory is
measured the same way for both: this process samples the child's RSS (``/proc/<pid>/status``) every ``--interval-s``
and takes the largest sample in each step's window; ``maxrss`` is the kernel's peak over the child's whole life
(``wait4``: loading included), the figure ``/usr/bin/time -v`` prints: the largest of the child's own peak and those
of the processes it reaped (a compile worker's). On CUDA each side also reports
``torch.cuda.max_memory_allocated`` per step. The table gives medians over the timed steps of all runs of a system,
the largest step-window RSS (median over runs), and the ratios lit_grpo / TRL. With several seeds, the mean reward
per seed, its spread, and whether the two systems' means lie within the larger of their spreads.

Output: the table on stdout (``--markdown OUT`` too) and ``--json OUT``: ``{"config", "trl_settings"
(GRPOConfig's fields per cell and what else TRL is given), "runs" (every step record), "summary"}``, written again
after every run, so a comparison stopped midway (a command's time limit) keeps the runs it finished. ``--out-dir
DIR`` names both after what picks the runs (``out_name``): DIR/gpu_long_slots-auto.json for ``--shape gpu_long
--lit-slots auto``, DIR/gpu_gsweep_g32-64_lit.json for ``--shape gpu_gsweep --group-sizes 32,64 --order lit``, so
comparisons of other cells write into one folder side by side. Each run's folder under ``--work-dir`` keeps its spec,
config, step records and output; ``--archive FILE`` (with ``--out-dir``: DIR/NAME.runs.tgz) is that folder as a
gzipped tar, written anew after every run and on SIGTERM (a stopped run's output included), for a machine whose
results come back as a few files only. ``--live-log FILE`` (with ``--out-dir``: DIR/live.log, one for every
comparison into DIR) is where the run in flight writes its output as it goes, copied into its folder once it ends
(so into the archive: the next comparison may reuse the file): a kill that gives no SIGTERM first (SIGKILL), which
nothing can trap, leaves that file with what the run had written.
Every other file is replaced whole (written beside, then renamed), so a kill while writing leaves the previous one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import yaml

from tools import harness, process_memory
from tools.compare_trl_spec import (LIT_SLOTS, PRECISIONS, SHAPES, TRL_GENERATION, build_spec, cells, demo_settings,
                                    is_lit_slots, lit_config, trl_config, trl_other_settings)

TRL_VERSION = "1.16.0"
SYSTEMS = ("lit", "trl")
SYSTEM_NAMES = {"lit": "lit_grpo", "trl": "TRL"}
#: The per-step figures summarized (medians over the timed steps).
TIMES = ("step_s", "rollout_s", "generate_s", "update_s")
#: lit_grpo's engine per step (``tools.compare_trl_runs``; TRL has none): its slots, its decode step against the
#: floor, its tokens/s.
ENGINE = ("slots", "ms_per_step", "floor_ms_per_step", "roofline_ratio", "tokens_per_s")
OOM_SIGNS = ("out of memory", "outofmemoryerror", "can't allocate memory", "memoryerror", "cannot allocate memory")
GIB = 1 << 30


# ------------------------------------------------------------------------------------------------ TRL's venv
_MISSING_REQUIREMENTS = """
import importlib.metadata as md, json
from packaging.requirements import Requirement
missing = []
for text in md.requires("trl") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(text)
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(text)
print(json.dumps(missing))
"""
# distribution versions, as this side reads its own (torch's module says 2.11.0+cu130 where its wheel says 2.11.0)
_VERSIONS = "import json, importlib.metadata as m, torch, transformers, trl; " \
            "print(json.dumps([m.version(n) for n in ('torch', 'transformers', 'trl')]))"
# the running environment, as its own interpreter sees it: the site directories ``site`` processes for it that exist
# (a venv's own, with the base's where it has system site packages, the user site where enabled); torch's and
# transformers' versions; every installed distribution's version; whether pip is importable
_ENVIRONMENT = """
import importlib.metadata as md, importlib.util, json, os, site, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
installed = {d.metadata["Name"]: d.version for d in md.distributions() if d.metadata["Name"]}
print(json.dumps({"prefix": sys.prefix, "site_dirs": [d for d in dict.fromkeys(dirs) if os.path.isdir(d)],
                  "versions": {name: version(name) for name in ("torch", "transformers")},
                  "installed": installed, "pip": importlib.util.find_spec("pip") is not None}))
"""
#: What TRL's venv must share with this environment (the comparison compares trainers, not stacks).
STACK = ("torch", "transformers")
#: In TRL's venv's site-packages: the line that adds the running environment's site directories.
ENVIRONMENT_PTH = "lit_grpo_environment.pth"
#: In TRL's venv: pip's constraints, every package of this environment at its version.
CONSTRAINTS = "lit_grpo_constraints.txt"


def make_trl_env(path: Path, python: Path | str = sys.executable) -> Path:
    """A venv at ``path`` seeing the packages of ``python``'s environment (this one by default), with TRL pinned
    and nothing else changed (module docstring); its python."""
    path = path.expanduser().absolute()
    _check_venv_dir(path)
    env = running_environment(python)
    venv_python = make_venv(path, python, env)
    constraints = path / CONSTRAINTS
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(env["installed"].items())))
    if not pip_install(venv_python, constraints, ["--no-deps", f"trl=={TRL_VERSION}"]):
        raise SystemExit(f"pip could not install trl=={TRL_VERSION} into {path} (its output above says why)")
    install_requirements(venv_python, constraints, missing_requirements(venv_python), env["versions"])
    versions = check_trl_python(venv_python, [env["versions"][name] for name in STACK])
    if versions[2] != TRL_VERSION:
        raise SystemExit(f"{venv_python} imports trl {versions[2]}, not {TRL_VERSION}")
    return venv_python


def _check_venv_dir(path: Path) -> None:
    """``path`` is new, empty, or a TRL environment made before (updated in place); anything else is refused."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not path.is_dir() or not any(path.glob(f"lib/python*/site-packages/{ENVIRONMENT_PTH}")):
        raise SystemExit(f"--make-trl-env {path}: it exists and is not a TRL environment made by --make-trl-env "
                         f"(no {ENVIRONMENT_PTH}): give a new or empty folder, or remove it")


def running_environment(python: Path | str) -> dict[str, Any]:
    """``python``'s environment (``_ENVIRONMENT``); SystemExit where it lacks torch or transformers."""
    out = subprocess.run([str(python), "-c", _ENVIRONMENT], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot describe its environment:\n{out.stderr[-2000:]}")
    env = json.loads(out.stdout)
    lacking = [name for name in STACK if env["versions"][name] is None]
    if lacking:
        raise SystemExit(f"{python} ({env['prefix']}) has no {' and no '.join(lacking)}: TRL's environment reuses "
                         "this environment's torch and transformers; install lit_grpo first (bash tools/setup.sh)")
    if not env["site_dirs"]:
        raise SystemExit(f"{python} ({env['prefix']}) has no site-packages directory")
    return env


def make_venv(path: Path, python: Path | str, env: dict[str, Any]) -> Path:
    """A venv at ``path`` made by ``python``, without system site packages (they are the base interpreter's, not
    ``env``'s), whose ``.pth`` line adds ``env``'s site directories with ``site.addsitedir``, so that their own
    ``.pth`` files run (the editable finder of lit_grpo among them); its python. pip comes from ``env`` where
    it has one."""
    venv_python = path / "bin" / "python"
    if not venv_python.exists():
        subprocess.run([str(python), "-m", "venv", *(["--without-pip"] if env["pip"] else []), str(path)], check=True)
    site_packages = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    adds = "; ".join(f"site.addsitedir({d!r})" for d in env["site_dirs"])
    (Path(site_packages) / ENVIRONMENT_PTH).write_text(
        f"# made by tools/compare_trl.py --make-trl-env: the packages of {env['prefix']}\nimport site; {adds}\n")
    return venv_python


def pip_install(venv_python: Path, constraints: Path, args: list[str]) -> bool:
    """``pip install`` into the venv, under ``constraints``; whether it succeeded (pip prints why not). pip's own
    settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, its configuration files)."""
    command = [str(venv_python), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints), *args]
    return subprocess.run(command).returncode == 0


def missing_requirements(venv_python: Path) -> list[str]:
    """TRL's requirements that the venv does not meet, as the venv sees them (this environment's packages)."""
    out = subprocess.run([str(venv_python), "-c", _MISSING_REQUIREMENTS], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def install_requirements(venv_python: Path, constraints: Path, missing: list[str], versions: dict[str, str]) -> None:
    """Install ``missing`` into the venv under ``constraints`` (every package of this environment at its version;
    torch's and transformers' are ``versions``); SystemExit, naming them, where one of them needs another torch or
    transformers, or pip finds no way."""
    refuse_stack_changes(missing, versions)
    if missing and not pip_install(venv_python, constraints, missing):
        raise SystemExit(f"pip could not install TRL's missing requirements {missing} with this environment's "
                         f"packages pinned (torch {versions['torch']}, transformers {versions['transformers']}, the "
                         f"others in {constraints}): pip's output above says why (one that needs another version of "
                         "an installed package, or no network); the comparison needs this environment's stack on "
                         "both sides")


def refuse_stack_changes(missing: list[str], versions: dict[str, str]) -> None:
    """SystemExit where a missing requirement of TRL is torch or transformers: it would need another version."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    for text in missing:
        name = canonicalize_name(Requirement(text).name)
        if name in STACK:
            raise SystemExit(f"trl {TRL_VERSION} requires {text!r}; this environment has {name} {versions[name]}: "
                             f"TRL's environment must use this environment's {name} (the comparison would compare "
                             f"two stacks, not two trainers); install a {name} that fits, then --make-trl-env again")


def check_trl_python(python: Path | str, ours: list[str] | None = None) -> list[str]:
    """``[torch, transformers, trl]`` versions under ``python``; SystemExit where torch or transformers are not
    ``ours`` (default: this environment's; the comparison would then compare two stacks, not two trainers)."""
    out = subprocess.run([str(python), "-c", _VERSIONS], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot import trl, torch and transformers:\n{out.stderr[-2000:]}")
    versions = json.loads(out.stdout.strip().splitlines()[-1])
    if ours is None:
        ours = [importlib.metadata.version(name) for name in STACK]
    if versions[:2] != ours:
        raise SystemExit(f"{python} has torch {versions[0]}, transformers {versions[1]}; this environment has "
                         f"{ours[0]}, {ours[1]}: make TRL's environment with --make-trl-env and do not upgrade them")
    return versions


# ------------------------------------------------------------------------------------------------ the plan
def parse_order(text: str) -> list[str]:
    """``--order``: a comma list of ``lit`` and ``trl`` (repeats allowed: ``lit,trl,trl,lit``)."""
    items = [item.strip().lower() for item in text.split(",") if item.strip()]
    if not items or any(item not in SYSTEMS for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {' and '.join(SYSTEMS)}, "
                                         "e.g. lit,trl,trl,lit")
    return items


def _lit_slots(text: str) -> str | int:
    """``--lit-slots``: one of ``LIT_SLOTS`` or a count of slots (an integer >= 1)."""
    value = int(text) if text.isascii() and text.isdigit() else text
    if is_lit_slots(value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(LIT_SLOTS)} or a count of slots (an "
                                     "integer >= 1)")


def plan(order: list[str], seeds: list[int], num_cells: int) -> list[dict[str, int | str]]:
    """The runs, in the order they run: cell by cell, seed by seed, ``order`` within; ``repeat`` counts a
    system's runs of one cell and seed."""
    runs = []
    for cell in range(num_cells):
        for seed in seeds:
            for index, system in enumerate(order):
                runs.append({"cell": cell, "seed": seed, "system": system, "repeat": order[:index].count(system)})
    return runs


def cell_label(spec: dict[str, Any]) -> str:
    return f"{spec['prompts_per_step']}x{spec['group_size']}x{spec['max_new_tokens']}"


# ------------------------------------------------------------------------------------------------ one run
def child_env(threads: int) -> dict[str, str]:
    return harness.repo_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                            TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                            TRANSFORMERS_OFFLINE="1")


def run_command(system: str, spec: dict[str, Any], run_dir: Path, trl_python: str | None) -> list[str]:
    """Write the run's spec (and lit_grpo's config) under ``run_dir``; the command that runs it."""
    records = run_dir / "steps.jsonl"
    harness.write_json(run_dir / "spec.json", spec)
    if system == "lit":
        config = run_dir / "lit_config.yaml"
        config.write_text(yaml.safe_dump(lit_config(spec, records), sort_keys=False))
        return harness.lit_grpo_command() + ["fit", "--config", str(config), "--trainer.default_root_dir",
                                             str(run_dir)]
    return [str(trl_python), "-m", "tools.compare_trl_runs", "trl", "--spec", str(run_dir / "spec.json"),
            "--out", str(records)]


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            pass
    return out


def run_status(seen: process_memory.Watched, output: str) -> str:
    """ok | timeout | stopped (this process was told to stop: SIGTERM) | oom (killed by the kernel, or an
    allocation failed) | failed."""
    if seen.stopped:
        return "stopped"
    if seen.timed_out:
        return "timeout"
    if seen.returncode == 0:
        return "ok"
    if seen.returncode == -9 or any(sign in output.lower() for sign in OOM_SIGNS):
        return "oom"
    return "failed"


def run_one(run: dict[str, Any], spec: dict[str, Any], run_dir: Path, trl_python: str | None,
            timeout_s: float | None, interval_s: float, live_log: Path | None = None) -> dict[str, Any]:
    """Run one system on one spec in a fresh process, watched from here; its record (status "stopped" where
    :class:`Stopped` came while it ran: the caller stops after saving it). The process writes its output into
    ``live_log`` where given (copied to the run's output.log once it ended), else into that output.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.jsonl", "output.log"):
        (run_dir / stale).unlink(missing_ok=True)
    command = run_command(run["system"], spec, run_dir, trl_python)
    seen = process_memory.Watched()
    log_path = live_log or run_dir / "output.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(spec["threads"]),
                                   cwd=harness.ROOT)
        try:
            process_memory.watch(process, timeout_s, interval_s, seen)
        except Stopped:
            seen.stopped = True
            process.kill()  # reaped once the records are written (main): a GPU process may take seconds to go
        finally:  # never leave a training child running unwatched (Ctrl-C, an error while watching)
            if not seen.stopped:
                process_memory.kill_and_reap(process, seen)
    output = log_path.read_text(errors="replace")
    if live_log is not None:
        shutil.copyfile(live_log, run_dir / "output.log")
    return run_record(run, spec, seen, read_records(run_dir / "steps.jsonl"), output, command, run_dir)


def run_record(run: dict[str, Any], spec: dict[str, Any], seen: process_memory.Watched,
               records: list[dict[str, Any]], output: str, command: list[str], run_dir: Path) -> dict[str, Any]:
    """One run's record: its steps (each with its window's RSS peak), their medians and the process's peaks; and
    ``unfinished_rollout``, the rollout record of a step stopped in its update (lit_grpo; else None)."""
    steps = [r for r in records if r.get("event") == "step"]
    unfinished = [r for r in records if r.get("event") == "rollout" and r["step"] > len(steps)]
    for step in steps:
        step["rss_peak_bytes"] = process_memory.window_peak(seen.samples, step["start"], step["end"])
    start = next((r for r in records if r.get("event") == "start"), {})
    end = next((r for r in records if r.get("event") == "end"), {})
    status = run_status(seen, output)
    record = {**run, "label": cell_label(spec), "status": status, "returncode": seen.returncode,
              "wall_s": seen.wall_s, "command": command, "run_dir": str(run_dir), "steps": steps,
              "info": {k: v for k, v in start.items() if k != "event"},
              "maxrss_bytes": seen.maxrss_bytes, "sampled_peak_rss_bytes": seen.peak_rss_bytes,
              "last_vm_hwm_bytes": seen.hwm_bytes, "own_vm_hwm_bytes": end.get("vm_hwm_bytes"),
              "unfinished_rollout": unfinished[0] if unfinished else None}
    record.update(run_figures(steps, spec["untimed_steps"]))
    if status != "ok":
        record["error"] = output[-3000:]
    return record


def run_figures(steps: list[dict[str, Any]], untimed: int) -> dict[str, Any]:
    """Medians of the timed steps' times and engine figures, the largest timed step's peaks, and the mean reward of
    all steps."""
    timed = [s for s in steps if s["step"] > untimed]
    out: dict[str, Any] = {"timed_steps": len(timed)}
    for key in (*TIMES, *ENGINE):
        out[key] = harness.median(s.get(key) for s in timed)
    for key in ("rss_peak_bytes", "cuda_peak_bytes"):
        values = [s[key] for s in timed if s.get(key) is not None]
        out[key] = max(values) if values else None
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    out["reward_mean"] = statistics.fmean(rewards) if rewards else None
    return out


# ------------------------------------------------------------------------------------------------ summary
def summarize(runs: list[dict[str, Any]], untimed: int = 1) -> list[dict[str, Any]]:
    """Per cell: per system, the medians over every timed step of its runs, the median of its runs' peaks, its
    runs' statuses, and the mean reward per seed; the ratios lit_grpo / TRL; whether both saw the same prompts;
    with two seeds or more, whether the reward means lie within the seeds' spread."""
    out = []
    for cell in sorted({r["cell"] for r in runs}):
        in_cell = [r for r in runs if r["cell"] == cell]
        entry: dict[str, Any] = {"cell": cell, "label": in_cell[0]["label"], "systems": {}}
        for system in SYSTEMS:
            mine = [r for r in in_cell if r["system"] == system]
            if mine:
                entry["systems"][system] = system_summary(mine, untimed)
        both = entry["systems"]
        if len(both) == 2:
            entry["ratio_lit_over_trl"] = {key: _ratio(both["lit"][key], both["trl"][key])
                                           for key in (*TIMES, "rss_peak_bytes", "maxrss_bytes", "cuda_peak_bytes")}
            entry["same_prompts"] = same_prompts(in_cell)
            entry["reward"] = reward_comparison(both["lit"]["reward_by_seed"], both["trl"]["reward_by_seed"])
        out.append(entry)
    return out


def system_summary(runs: list[dict[str, Any]], untimed: int) -> dict[str, Any]:
    timed = [s for r in runs for s in r["steps"] if s["step"] > untimed]
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    by_seed: dict[int, list[float]] = {}
    for r in runs:
        if r["reward_mean"] is not None:
            by_seed.setdefault(r["seed"], []).append(r["reward_mean"])
    return {
        "runs": len(runs), "statuses": statuses, "timed_steps": len(timed),
        "steps_per_run": [len(r["steps"]) for r in runs],
        "unfinished_rollouts": [r["unfinished_rollout"] for r in runs if r.get("unfinished_rollout")],
        **{key: harness.median(s.get(key) for s in timed) for key in (*TIMES, *ENGINE)},
        **{key: harness.median(r[key] for r in runs) for key in ("rss_peak_bytes", "maxrss_bytes",
                                                                 "cuda_peak_bytes")},
        "reward_by_seed": {str(seed): statistics.fmean(values) for seed, values in sorted(by_seed.items())},
        "versions": {k: v for k, v in runs[0].get("info", {}).items() if k in ("torch", "transformers", "trl",
                                                                                "lightning", "threads")},
        "prompt_ids_match": runs[0].get("info", {}).get("prompt_ids_match"),
    }


def same_prompts(runs: list[dict[str, Any]]) -> bool | None:
    """Whether every run of a seed drew the same prompts step by step (None when a run recorded none)."""
    for seed in {r["seed"] for r in runs}:
        drawn = [[s.get("prompts") for s in r["steps"]] for r in runs if r["seed"] == seed and r["steps"]]
        if any(p is None for steps in drawn for p in steps):
            return None
        shortest = min((len(steps) for steps in drawn), default=0)
        if any(steps[:shortest] != drawn[0][:shortest] for steps in drawn):
            return False
    return True


def reward_comparison(lit: dict[str, float], trl: dict[str, float]) -> dict[str, Any]:
    """Mean and spread (max - min) over seeds of each system's mean reward; ``within_spread`` when both have two
    seeds or more: the two means differ by at most the larger spread."""
    out: dict[str, Any] = {}
    for name, values in (("lit", list(lit.values())), ("trl", list(trl.values()))):
        out[name] = {"mean": statistics.fmean(values) if values else None,
                     "spread": max(values) - min(values) if len(values) > 1 else None, "seeds": len(values)}
    spreads = [out[name]["spread"] for name in ("lit", "trl")]
    if None in spreads or out["lit"]["mean"] is None or out["trl"]["mean"] is None:
        out["within_spread"] = None
    else:
        out["within_spread"] = abs(out["lit"]["mean"] - out["trl"]["mean"]) <= max(spreads)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------------------------------------ the table
def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} x"


def _status(summary: dict[str, Any], steps: int) -> str:
    text = ", ".join(f"{status} x{count}" for status, count in summary["statuses"].items())
    done = summary["steps_per_run"]
    if set(summary["statuses"]) != {"ok"}:
        text += f" ({min(done)}-{max(done)} of {steps} steps done)"
    return text


def engine_note(summary: dict[str, Any]) -> str:
    """lit_grpo's engine in a few words: its slots, its decode step against its floor (medians: their ratio is the
    ratio of the medians), its tokens/s."""
    floor = summary.get("floor_ms_per_step")
    against = "" if not floor else f" against a floor of {floor:.2f} ms ({summary['ms_per_step'] / floor:.1f} x)"
    slots = summary.get("slots")
    return (f"lit_grpo's engine: {'?' if slots is None else f'{slots:g}'} slots, a decode step "
            f"{summary['ms_per_step']:.2f} ms{against}, {summary.get('tokens_per_s') or 0:.0f} tokens/s")


def unfinished_note(rollout: dict[str, Any]) -> str:
    """A step stopped in its update: what its rollout measured."""
    peak = rollout.get("cuda_peak_bytes")
    return (f"step {rollout['step']} stopped in its update, after a rollout of {_seconds(rollout.get('rollout_s'))} s"
            + ("" if peak is None else f" (CUDA peak so far {_gib(peak)} GiB)")
            + (f": {engine_note(rollout)}" if rollout.get("ms_per_step") is not None else ""))


def markdown(report: dict[str, Any]) -> str:
    """The comparison as a markdown table, with the settings and definitions under it."""
    config = report["config"]
    steps = config["steps_total"]
    cuda = config["device"] == "cuda"
    memory = "CUDA peak GiB" if cuda else "peak RSS GiB"
    untimed = config.get("untimed_steps", 1)
    warm_up = (f"after {untimed} warm-up step{'s' * (untimed > 1)}" if untimed
               else "no warm-up (the first step's captures counted)")
    lines = [f"GRPO step, lit_grpo against TRL ({config['model']}, {config['precision']}, {config['device']}, "
             f"{config['threads']} threads; {config['steps']} timed steps {warm_up}, order "
             f"{','.join(config['order'])}, seeds {','.join(map(str, config['seeds']))}, lit_grpo's slots "
             f"{config.get('lit_slots', 'fixed')})", "",
             f"| B x G x tokens | system | step s | rollout s | generate s | update s | {memory} | maxrss GiB | "
             "reward | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["summary"]:
        for system, s in entry["systems"].items():
            peak = s["cuda_peak_bytes"] if cuda else s["rss_peak_bytes"]
            reward = statistics.fmean(s["reward_by_seed"].values()) if s["reward_by_seed"] else None
            lines.append(f"| {entry['label']} | {SYSTEM_NAMES[system]} | {_seconds(s['step_s'])} | "
                         f"{_seconds(s['rollout_s'])} | {_seconds(s['generate_s'])} | {_seconds(s['update_s'])} | "
                         f"{_gib(peak)} | {_gib(s['maxrss_bytes'])} | "
                         f"{'-' if reward is None else f'{reward:.3f}'} | {_status(s, steps)} |")
        ratio = entry.get("ratio_lit_over_trl")
        if ratio:
            peak = ratio["cuda_peak_bytes"] if cuda else ratio["rss_peak_bytes"]
            lines.append(f"| {entry['label']} | lit_grpo / TRL | {_times(ratio['step_s'])} | "
                         f"{_times(ratio['rollout_s'])} | {_times(ratio['generate_s'])} | "
                         f"{_times(ratio['update_s'])} | {_times(peak)} | {_times(ratio['maxrss_bytes'])} | | |")
    lines.append("")
    for entry in report["summary"]:
        notes = []
        if entry.get("same_prompts") is False:
            notes.append("the two systems drew DIFFERENT prompts")
        trl = entry["systems"].get("trl", {})
        if trl.get("prompt_ids_match") is False:
            notes.append("TRL rendered the prompts to other tokens than lit_grpo")
        lit = entry["systems"].get("lit", {})
        if lit.get("ms_per_step") is not None:
            notes.append(engine_note(lit))
        notes.extend(unfinished_note(rollout) for rollout in lit.get("unfinished_rollouts", []))
        reward = entry.get("reward")
        if reward and reward["within_spread"] is not None:
            notes.append(f"reward means {reward['lit']['mean']:.3f} (lit_grpo, spread {reward['lit']['spread']:.3f}) "
                         f"and {reward['trl']['mean']:.3f} (TRL, spread {reward['trl']['spread']:.3f}) over "
                         f"{reward['lit']['seeds']} seeds: "
                         + ("within the spread" if reward["within_spread"] else "NOT within the spread"))
        if notes:
            lines.append(f"- {entry['label']}: " + "; ".join(notes))
    settings = report["trl_settings"]
    first = next(iter(settings["GRPOConfig"].values()))
    lines.append(f"- TRL {settings.get('version') or TRL_VERSION}, GRPOConfig: "
                 + ", ".join(f"{k}={v!r}" for k, v in first.items()))
    for label, fields in list(settings["GRPOConfig"].items())[1:]:
        lines.append(f"  - {label}: " + ", ".join(f"{k}={v!r}" for k, v in fields.items() if first.get(k) != v))
    lines.extend(f"- TRL {key}: {value}" for key, value in settings["other"].items())
    lines.append("- step: end of one optimizer step to the end of the next; rollout: lit_grpo's batch fetch "
                 "(prompts, generation, rewards, advantages), TRL's _generate_and_score_completions (the same "
                 "work); generate: the generation alone; update: step - rollout. Medians over the timed steps.")
    lines.append(f"- {memory}: " + ("torch.cuda.max_memory_allocated over a step, the largest timed step's; "
                                    if cuda else "")
                 + f"RSS of the child sampled from outside every {config['interval_s'] * 1000:g} ms, the "
                 "largest sample in a timed step's window (median over runs); maxrss: the kernel's peak RSS over "
                 "the whole process and those it reaped (wait4's ru_maxrss, loading"
                 + (" and the warm-up included)." if untimed else " included)."))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Details: the docstring of tools/compare_trl.py",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the interpreter of an environment with TRL (see --make-trl-env)")
    parser.add_argument("--make-trl-env", type=Path, metavar="DIR",
                        help=f"make a venv with trl=={TRL_VERSION} at DIR, then exit")
    parser.add_argument("--shape", choices=list(SHAPES), default="demo")
    parser.add_argument("--steps", type=int, help="timed GRPO steps per run, after the warm-up steps (default: "
                        + ", ".join(f"{name} {shape['steps']}" for name, shape in SHAPES.items()) + ")")
    parser.add_argument("--untimed-steps", type=int, help="warm-up steps before the timed ones (default: 1; "
                        + ", ".join(f"{name} {shape['untimed_steps']}" for name, shape in SHAPES.items()
                                    if "untimed_steps" in shape) + ")")
    parser.add_argument("--group-sizes", type=harness.comma_numbers(1), default=None,
                        help="only the shape's cells of these G (comma list; default every cell)")
    parser.add_argument("--seeds", type=harness.comma_numbers(0), default=[0], help="comma list of seeds")
    parser.add_argument("--order", type=parse_order, default=["lit", "trl", "trl", "lit"],
                        help="the runs of each seed, in order (default lit,trl,trl,lit)")
    harness.add_model_argument(parser, default="smollm2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default=None, help="default: the demo's (32-true)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (and OMP_NUM_THREADS)")
    parser.add_argument("--trl-generation", choices=TRL_GENERATION, default="generate")
    parser.add_argument("--lit-slots", type=_lit_slots, default="fixed",
                        help="lit_grpo's slots: fixed (the shape's: 8 in the G sweeps), all (one per sample), auto "
                             "(from the GPU's free memory), or a count N (the same N at every G)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run; past it the run is killed and "
                                                                         "recorded as a timeout")
    parser.add_argument("--interval-s", type=float, default=0.05, help="RSS sampling interval")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/compare_trl"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--archive", type=Path, help="the work dir's runs as a gzipped tar, written anew after every "
                                                     "run and on SIGTERM (with --out-dir: OUT_DIR/NAME.runs.tgz)")
    parser.add_argument("--live-log", type=Path, help="the run in flight writes its output here as it goes (with "
                                                      "--out-dir: OUT_DIR/live.log), kept by a SIGKILL")
    parser.add_argument("--out-dir", type=Path, help="where --json, --markdown and --archive are not given: "
                                                     "OUT_DIR/NAME.json, OUT_DIR/NAME.md and OUT_DIR/NAME.runs.tgz, "
                                                     "NAME the shape with what else picks the runs (out_name)")
    args = parser.parse_args(argv)
    if args.out_dir is not None:
        name = out_name(args)
        args.json = args.json or args.out_dir / f"{name}.json"
        args.markdown = args.markdown or args.out_dir / f"{name}.md"
        args.archive = args.archive or args.out_dir / f"{name}.runs.tgz"
        args.live_log = args.live_log or args.out_dir / "live.log"
    if args.steps is None:
        args.steps = SHAPES[args.shape]["steps"]
    if args.untimed_steps is None:
        args.untimed_steps = SHAPES[args.shape].get("untimed_steps", 1)
    for flag, value, minimum in (("--steps", args.steps, 1), ("--untimed-steps", args.untimed_steps, 0),
                                 ("--threads", args.threads, 1)):
        if value < minimum:
            parser.error(f"{flag} {value}: use an integer >= {minimum}")
    for flag, value in (("--interval-s", args.interval_s), ("--timeout-s", args.timeout_s)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value}: use a number of seconds > 0")
    if args.make_trl_env is None and args.trl_python is None and "trl" in args.order:
        parser.error("give --trl-python (an interpreter with TRL) or --make-trl-env DIR")
    shape_groups = [cell["group_size"] for cell in cells(args.shape, demo_settings())]
    unknown = sorted(set(args.group_sizes or []) - set(shape_groups))
    if unknown:
        parser.error(f"--group-sizes {','.join(map(str, unknown))}: --shape {args.shape} has G "
                     f"{', '.join(map(str, shape_groups))}")
    return args


def out_name(args: argparse.Namespace) -> str:
    """The name of ``--out-dir``'s files: the shape, then ``_slots-N`` for a ``--lit-slots`` N other than fixed,
    ``_gA-B`` for ``--group-sizes`` A,B (sorted: the runs are the same in any order), and ``_lit`` or ``_trl`` where
    ``--order`` runs one system alone; so calls that run other cells into one folder keep each other's files."""
    name = args.shape + ("" if args.lit_slots == "fixed" else f"_slots-{args.lit_slots}")
    if args.group_sizes:
        name += "_g" + "-".join(str(g) for g in sorted(args.group_sizes))
    systems = set(args.order)
    return name + (f"_{systems.pop()}" if len(systems) == 1 else "")


def exit_status(runs: list[dict[str, Any]]) -> int:
    """The comparison's exit status once its runs are recorded: 1 where a run failed (an error of the run's own,
    its output in the record), else 0. A timeout or an out-of-memory end is a recorded outcome of the cell (its
    steps, its peak), not a failure; a stop exits with 143 before this."""
    return 1 if any(run["status"] == "failed" for run in runs) else 0


def specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per cell of ``--shape`` (seed 0; a run's seed is put in when it runs), of ``--group-sizes`` alone
    where given."""
    demo = demo_settings()
    return [build_spec(demo, cell, model=None if args.model == "smollm2" else args.model, device=args.device,
                       precision=args.precision, threads=args.threads, seed=0, steps=args.steps,
                       untimed_steps=args.untimed_steps, trl_generation=args.trl_generation, lit_slots=args.lit_slots)
            for cell in cells(args.shape, demo)
            if args.group_sizes is None or cell["group_size"] in args.group_sizes]


def build_report(args: argparse.Namespace, cell_specs: list[dict[str, Any]], trl_version: str,
                 runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--json`` record of the runs done so far (module docstring)."""
    return {
        "config": harness.config_record(args, steps_total=args.steps + args.untimed_steps, model=cell_specs[0]["model"],
                                        precision=cell_specs[0]["precision"]),
        "trl_settings": {"version": trl_version,
                         "GRPOConfig": {cell_label(s): {k: v for k, v in trl_config(s, "RUN_DIR").items()
                                                        if k != "output_dir"} for s in cell_specs},
                         "other": trl_other_settings(cell_specs[0])},
        "runs": runs,
        "summary": summarize(runs, args.untimed_steps),
    }


def run_line(record: dict[str, Any]) -> str:
    """One finished run in a line: status, steps, medians and peaks (the CUDA peak where there is one)."""
    cuda = "" if record["cuda_peak_bytes"] is None else f"CUDA peak {_gib(record['cuda_peak_bytes'])} GiB, "
    engine = "" if record.get("ms_per_step") is None else f"; {engine_note(record)}"
    if record.get("unfinished_rollout"):
        engine += f"; {unfinished_note(record['unfinished_rollout'])}"
    return (f"{SYSTEM_NAMES[record['system']]:8s} {record['label']} seed {record['seed']}: {record['status']}, "
            f"{len(record['steps'])} steps, step {_seconds(record['step_s'])} s, rollout "
            f"{_seconds(record['rollout_s'])} s, {cuda}peak RSS {_gib(record['rss_peak_bytes'])} GiB, maxrss "
            f"{_gib(record['maxrss_bytes'])} GiB{engine} ({record['run_dir']})")


class Stopped(BaseException):
    """SIGTERM reached this process (a command's time limit): the run in flight is killed and recorded as
    "stopped", the records are written once more, and the comparison ends (not an Exception, so that no
    ``except Exception`` on the way swallows it)."""


def _stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the last writes short
    raise Stopped(signal.Signals(signum).name)


def _reap_children() -> None:
    """Wait for every child of this process to end (a stopped run's, killed but not waited for)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def archive_runs(work_dir: Path, path: Path | None) -> None:
    """``work_dir`` as a gzipped tar at ``path`` (the folder's own name at the top), replaced whole; nothing when
    ``path`` is None or no run has made the folder yet."""
    if path is None or not work_dir.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work_dir, arcname=work_dir.name)
    os.replace(partial, path)


def save(args: argparse.Namespace, cell_specs: list[dict[str, Any]], trl_version: str | None,
         runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``--json`` (the report of ``runs``), its table to ``--markdown`` and ``--archive``; the report."""
    report = build_report(args, cell_specs, trl_version, runs)
    harness.write_json(args.json, report)
    harness.write_text(args.markdown, markdown(report))
    archive_runs(args.work_dir, args.archive)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.make_trl_env is not None:
        python = make_trl_env(args.make_trl_env.expanduser())
        print(f"TRL environment ready: --trl-python {python}")
        return {}
    # TRL's environment is checked where TRL runs (importing it takes a while)
    trl_version = check_trl_python(args.trl_python)[2] if "trl" in args.order else None
    cell_specs = specs(args)
    runs: list[dict[str, Any]] = []
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for run in plan(args.order, args.seeds, len(cell_specs)):
            spec = {**cell_specs[run["cell"]], "seed": run["seed"]}
            run_dir = args.work_dir / f"{args.shape}_{cell_label(spec)}" / f"seed{run['seed']}" / \
                f"{len(runs):02d}_{run['system']}"
            runs.append(run_one(run, spec, run_dir, args.trl_python, args.timeout_s, args.interval_s, args.live_log))
            print(run_line(runs[-1]), file=sys.stderr, flush=True)
            report = save(args, cell_specs, trl_version, runs)
            if runs[-1]["status"] == "stopped":
                raise Stopped("SIGTERM")
    except Stopped as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if runs:  # again: the signal may have come while the last records were written
            save(args, cell_specs, trl_version, runs)
        else:
            archive_runs(args.work_dir, args.archive)
        print(f"compare_trl: stopped by {stop} after {len(runs)} runs; the records are written", file=sys.stderr,
              flush=True)
        _reap_children()
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown(report))
    status = exit_status(runs)
    if status:
        failed = [f"{SYSTEM_NAMES[r['system']]} {r['label']} seed {r['seed']} ({r['run_dir']})" for r in runs
                  if r["status"] == "failed"]
        print(f"compare_trl: {len(failed)} of {len(runs)} runs failed (their output is in the records): "
              + "; ".join(failed), file=sys.stderr, flush=True)
        raise SystemExit(status)
    return report


if __name__ == "__main__":
    main()
