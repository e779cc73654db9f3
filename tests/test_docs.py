"""The documentation site (mkdocs.yml, docs/) builds offline with ``--strict``, and its API reference is whole.

``--strict`` turns every warning into a failure: a link to a page or anchor that does not exist, a ``:::`` block
naming an object griffe cannot find, a docstring whose ``Args:`` name a parameter the signature lacks. And what the
pages give a user to copy holds: each command's flags are its tool's, each YAML snippet is a config ``lit-grpo``
accepts, each file of the repository they name exists, and prose keeps within 120 columns.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import forked_cli
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mkdocs_build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)],
                          cwd=config_dir, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built once for its tests, which share an xdist group so that one worker builds it, not two."""
    site_dir = tmp_path_factory.mktemp("site")
    proc = _mkdocs_build(ROOT, site_dir)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]
    return site_dir


@pytest.mark.xdist_group("docs_site")
def test_every_page_of_the_nav_is_built(site):
    for page in ("index", "engine", "scheduler", "training", "reliability", "benchmarks", "api"):
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not built"
    assert (site / "slot_timeline.png").is_file()


@pytest.mark.xdist_group("docs_site")
def test_the_api_reference_documents_every_public_name(site):
    """Each name a user imports from ``lit_grpo`` or ``lit_grpo.callbacks`` has its own entry in docs/api.md."""
    import lit_grpo
    import lit_grpo.callbacks

    html = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="([\w.]+)"', html))
    documented = {anchor.rsplit(".", 1)[-1] for anchor in anchors}
    public = set(lit_grpo.__all__) | set(lit_grpo.callbacks.__all__)
    assert public - documented == set()


def test_a_broken_link_or_an_unknown_reference_fails_the_build(tmp_path):
    """The strict build is what catches them: the same site with one bad link, then one bad reference."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")  # the griffe extension reads it
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("lit_grpo", "callbacks", "datamodules"):
        (tmp_path / name).symlink_to(ROOT / name)
    index = tmp_path / "docs" / "index.md"
    original = index.read_text()

    index.write_text(original + "\nSee [the missing page](missing_page.md).\n")
    proc = _mkdocs_build(tmp_path, tmp_path / "site_link")
    assert proc.returncode != 0 and "missing_page.md" in proc.stderr

    index.write_text(original + "\n::: lit_grpo.no_such_module\n")
    proc = _mkdocs_build(tmp_path, tmp_path / "site_ref")
    assert proc.returncode != 0 and "lit_grpo.no_such_module" in proc.stderr


def test_the_readme_links_to_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to no docs page"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert missing == []


#: A file or folder of the repository a page's code names: a path under one of its top folders, a file by its
#: extension (or a ``module.name``), a folder by its trailing slash; ``tools/call_frequency``, a logged key, is none.
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|tools|tests|lit_grpo|datamodules|callbacks|docs)/"
                       r"(?:[\w-]+/)*(?:[\w-]+\.[\w.]*\w)?)(?![\w./-])")
#: Prose that names a file as it was at a commit (``9bfe290's `lit_grpo/cli.py```), which may be gone since.
AT_A_COMMIT = re.compile(r"\b[0-9a-f]{7,40}'s\s*$")


def docs_repository_paths(pages: list[Path]) -> list[tuple[str, str]]:
    """Every (page, path) of the repository in the pages' code, those named at a commit left out."""
    found = []
    for page in pages:
        text = page.read_text()
        for at, span in _code_spans_at(text):
            if not AT_A_COMMIT.search(text[max(0, at - 60):at]):
                found += [(page.name, path) for path in REPO_PATH.findall(span)]
    return found


def in_repository(path: str) -> bool:
    """``path`` is a file or folder of the repository, or a ``module.name`` that its module's file defines."""
    if (ROOT / path).exists():
        return True
    module, _, name = path.rpartition(".")
    source = ROOT / f"{module}.py"
    definition = rf"^(?:def|class) {name}\b|^{name}\s*[:=]"
    return source.is_file() and re.search(definition, source.read_text(), re.M) is not None


def test_every_repository_path_the_docs_name_exists():
    """A config, tool, test or module that README.md or docs/*.md names in its code (``configs/demo.yaml``,
    ``lit_grpo/update/loss.py``, ``tests/scheduler_helpers.planted_rollout``) is in the repository."""
    paths = docs_repository_paths(PAGES)
    assert ("README.md", "configs/demo.yaml") in paths and len(paths) > 100, "the reader finds no paths"
    assert sorted({(page, path) for page, path in paths if not in_repository(path)}) == []


def test_the_path_reader_skips_a_file_named_at_a_commit_and_finds_a_missing_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `lit-grpo fit --config configs/nope.yaml` (9bfe290's `lit_grpo/cli.py`, then\n"
                    "`tests/scheduler_helpers.planted_rollout`), logging `tools/call_frequency`, in `lit_grpo/nope/`."
                    "\n\n```bash\npython -m tools.x configs/tiny.yaml\n```\n")
    paths = docs_repository_paths([page])
    assert paths == [("page.md", "configs/nope.yaml"), ("page.md", "tests/scheduler_helpers.planted_rollout"),
                     ("page.md", "lit_grpo/nope/"), ("page.md", "configs/tiny.yaml")]
    assert [in_repository(path) for _, path in paths] == [False, True, False, True]
    assert not in_repository("tests/scheduler_helpers.no_such_helper")


def test_the_readme_lightning_example_trains(tmp_path):
    """The README's "own Lightning project" snippet runs as written, on the tiny model for one step."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "trainer.fit" in b]
    assert len(blocks) == 1, "the README should hold one Lightning example"
    code = blocks[0].replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', '"tiny-llama"')
    code = code.replace("max_steps=30", "max_steps=1, enable_progress_bar=False, accelerator='cpu'")
    code = code.replace("max_new_tokens=64", "max_new_tokens=8")
    assert '"tiny-llama"' in code and "max_steps=1" in code, "the example's model or step count changed"
    script = tmp_path / "example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + code
                      + "\nprint('global_step', trainer.global_step)\n")
    proc = forked_cli.run([], tmp_path, script=str(script))  # as `python example.py`, forked warm
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "global_step 1" in proc.stdout
    # the warnings a plain fit printed about lit_grpo's own objects: its request stream's __len__, its loaders'
    # flattening by Lightning's pytree helper
    for noise in ("Your `IterableDataset` has `__len__` defined", "`isinstance(treespec, LeafSpec)` is deprecated"):
        assert noise not in proc.stderr, proc.stderr[-4000:]


def _write_port(folder: Path, start: str, end: str, module: str, config: str) -> None:
    """docs/training.md's port between the headings ``start`` and ``end`` into ``folder``: its Python block that
    opens with ``# MODULE`` as ``module``, its one YAML block as ``config``."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index(start):text.index(end)]
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if b.startswith(f"# {module}")]
    (yaml_text,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    (folder / module).write_text(code)
    (folder / config).write_text(yaml_text)


def test_the_trl_port_in_the_docs_runs_its_reward_module_unchanged(tmp_path):
    """docs/training.md's TRL port: its reward module (TRL's signatures, chat completions) and its config, as written,
    train a step through ``lit-grpo fit`` on the tiny model, the module found in the working folder."""
    import json

    from tools.harness import repo_env

    _write_port(tmp_path, "### A TRL script, ported", "## verl's GRPO settings in lit-grpo's YAML", "my_rewards.py",
                "trl_port.yaml")
    with open(tmp_path / "train.jsonl", "w") as rows:
        for i in range(6):
            rows.write(json.dumps({"prompt": [{"role": "system", "content": "Answer in <answer></answer>."},
                                              {"role": "user", "content": f"What is {i} + {i}?"}],
                                   "solution": str(2 * i)}) + "\n")
    overrides = ["--model.model", "tiny-llama", "--trainer.max_steps", "1", "--trainer.precision", "32-true",
                 "--data.sampling.max_new_tokens", "8", "--data.sampling.group_size", "2",
                 "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]
    proc = forked_cli.run(["fit", "--config", "trl_port.yaml", *overrides], tmp_path, repo_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lit_grpo: 1 step" in proc.stdout + proc.stderr
    # as TRL's run, quietly: its seed set (TRL's 42), its validation off without a warning of an empty loader
    assert "No seed found" not in proc.stderr and "across ranks is zero" not in proc.stderr, proc.stderr[-4000:]


def test_the_verl_port_in_the_docs_runs_its_reward_module_unchanged(tmp_path):
    """docs/training.md's verl port: its reward module (verl's compute_score) and its config, as written, train a step
    through ``lit-grpo fit`` on the tiny model on one CPU process, on rows in verl's gsm8k parquet layout."""
    import datasets

    from tools.harness import repo_env

    _write_port(tmp_path, "### A verl run, ported", "## Callbacks and what they log", "my_reward.py", "verl_port.yaml")
    (tmp_path / "gsm8k").mkdir()
    for split, rows in (("train", range(6)), ("test", range(6, 8))):  # examples/data_preprocess/gsm8k.py's layout
        datasets.Dataset.from_list([
            {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer "
                                                                                   "after '####'."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": split, "index": i}} for i in rows
        ]).to_parquet(tmp_path / "gsm8k" / f"{split}.parquet")
    overrides = ["--model.model", "tiny-llama", "--model.fsdp", "false", "--model.train_micro_batch_size", "2",
                 "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
                 "--trainer.precision", "32-true", "--trainer.max_steps", "1", "--data.dataset", "gsm8k",
                 "--data.val_size", "2", "--data.prompts_per_step", "4", "--data.sampling.group_size", "2",
                 "--data.sampling.max_new_tokens", "8", "--trainer.default_root_dir", str(tmp_path / "runs"),
                 "--trainer.enable_progress_bar", "false"]
    proc = forked_cli.run(["fit", "--config", "verl_port.yaml", *overrides], tmp_path, repo_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "lit_grpo: 1 step" in out and "val/accuracy" in out, out[-4000:]  # compute_score's values


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A command the docs give: ``python -m tools.NAME`` (or ``tools.NAME``, or a tool's bare name opening a span) or
#: ``lit-grpo SUBCOMMAND``.
COMMAND = re.compile(r"(?:python -m )?tools\.(\w+)|lit-grpo (fit|validate|export)\b|^(\w+) (?=\.\.\.|--)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w.-]*")


def _code_spans_at(text: str) -> list[tuple[int, str]]:
    """The page's code in reading order, each with the offset of its block or span: each line of a fenced block
    (``\\`` continuations joined, ``#`` comments cut) and each inline backtick span (one that wraps a line read as
    one line)."""
    spans, fenced = [], re.compile(r"```[^\n]*\n(.*?)```", re.S)
    for match in re.finditer(rf"{fenced.pattern}|`([^`]+)`", text, re.S):
        if match.group(1) is not None:
            spans += [(match.start(), line.split(" #")[0]) for line in match.group(1).replace("\\\n", " ").splitlines()]
        else:
            spans.append((match.start(), match.group(2).replace("\n", " ")))
    return sorted(spans)


def _code_spans(text: str) -> list[str]:
    """:func:`_code_spans_at` without the offsets."""
    return [span for _, span in _code_spans_at(text)]


def docs_commands() -> list[tuple[str, str, str]]:
    """Every (page, tool, flag) of a command in README.md and docs/*.md; a span opening with ``...`` continues the
    page's last command. bench_fit passes what follows `` -- `` and its ``--variant NAME=ARGS`` to ``lit-grpo fit``."""
    tools = {path.stem for path in (ROOT / "tools").glob("*.py")}
    found = []
    for page in PAGES:
        last = None
        for span in _code_spans(page.read_text()):
            starts = [(m.start(), m.group(1) or (f"lit-grpo {m.group(2)}" if m.group(2) else m.group(3)))
                      for m in COMMAND.finditer(span)]
            starts = [(at, tool) for at, tool in starts if tool in tools or tool.startswith("lit-grpo")]
            if not starts and last and span.startswith("..."):
                starts = [(0, last)]
            for (at, tool), (end, _) in zip(starts, [*starts[1:], (len(span), None)]):
                last, args = tool, span[at:end]
                if tool == "bench_fit":
                    forwarded = " ".join(re.findall(r"\"[\w-]*=([^\"]*)\"", args)) + " " + args.partition(" -- ")[2]
                    args = args.partition(" -- ")[0]
                    found += [(page.name, "lit-grpo fit", flag) for flag in FLAG.findall(forwarded)]
                found += [(page.name, tool, flag) for flag in FLAG.findall(re.sub(r"\"[^\"]*\"", "", args))]
    return found


def test_every_flag_a_docs_command_gives_is_one_its_tool_takes(tmp_path):
    """Each ``--flag`` of a ``python -m tools.NAME`` or ``lit-grpo`` command in the README and the docs pages is in
    that tool's ``--help``; the helps are read in one process of their own (a tool may set process-wide state),
    forked warm."""
    import json

    commands = docs_commands()
    tools = sorted({tool for _, tool, _ in commands})
    assert {"bench_rollout", "bench_fit", "lit-grpo fit", "lit-grpo export"} <= set(tools), tools
    reader = ("import contextlib, importlib, io, json, os, sys\n"
              "sys.path.insert(0, os.getcwd())  # the repository root, for tools\n"
              "helps = {}\n"
              "for name in sys.argv[1:]:\n"
              "    out = io.StringIO()\n"
              "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):\n"
              "        try:\n"
              "            if name.startswith('lit-grpo '):\n"
              "                from lit_grpo.cli import main\n"
              "                main([name.split()[1], '--help'])\n"
              "            else:\n"
              "                importlib.import_module('tools.' + name).main(['--help'])\n"
              "        except SystemExit:\n"
              "            pass\n"
              "    helps[name] = out.getvalue()\n"
              "print(json.dumps(helps))\n")
    script = tmp_path / "read_helps.py"
    script.write_text(reader)
    proc = forked_cli.run(tools, ROOT, script=str(script))
    assert proc.returncode == 0, proc.stderr[-4000:]
    helps = json.loads(proc.stdout.splitlines()[-1])
    assert all("usage" in helps[tool].lower() for tool in tools), [tool for tool in tools if not helps[tool]]
    unknown = sorted({(page, tool, flag) for page, tool, flag in commands
                      if not re.search(rf"{re.escape(flag)}(?![\w-])", helps[tool])})
    assert unknown == []


def test_the_command_reader_finds_continued_and_forwarded_flags(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("Run `python -m tools.bench_faults --kills 20`, then:\n\n| `... --signal TERM` |\n\n"
                    "`python -m tools.bench_fit --seeds 0 --variant a= --variant \"x=--model.cpu_linear torch\" -- "
                    "--data.size 2` and `bench_grpo_memory ... --prompts 1`, `tools.bench_rollout\n--stop-strings`.\n\n"
                    "```bash\nlit-grpo export --ckpt_path CKPT \\\n  --out DIR   # --not-a-flag\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    assert docs_commands() == [
        ("page.md", "bench_faults", "--kills"), ("page.md", "bench_faults", "--signal"),
        ("page.md", "lit-grpo fit", "--model.cpu_linear"), ("page.md", "lit-grpo fit", "--data.size"),
        ("page.md", "bench_fit", "--seeds"), *[("page.md", "bench_fit", "--variant")] * 2,
        ("page.md", "bench_grpo_memory", "--prompts"), ("page.md", "bench_rollout", "--stop-strings"),
        ("page.md", "lit-grpo export", "--ckpt_path"), ("page.md", "lit-grpo export", "--out")]


@pytest.mark.parametrize("page, block", [
    pytest.param(page.name, block, id=f"{page.stem}-{n}") for page in PAGES
    for n, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S))])
def test_every_yaml_snippet_in_the_docs_is_a_config_lit_grpo_accepts(capsys, tmp_path, page, block):
    """Each YAML block of the docs, laid over configs/tiny.yaml, is parsed and checked as ``lit-grpo fit`` would
    (``--print_config``: nothing is built)."""
    from lit_grpo.cli import main

    snippet = tmp_path / "snippet.yaml"
    snippet.write_text(block)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config", str(snippet), "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err[-4000:]


def test_prose_lines_keep_within_120_columns_and_the_readme_within_150_lines():
    """Tables and fenced code may run longer; prose, list items and headings may not."""
    long_lines = []
    for page in PAGES:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            fenced ^= line.lstrip().startswith("```")
            if len(line) > 120 and not fenced and not line.startswith("|"):
                long_lines.append(f"{page.name}:{number} ({len(line)} columns)")
    assert long_lines == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_overviews_folder_table_names_every_module():
    """docs/index.md's table of folders names each module file of lit_grpo/ and datamodules/ (callbacks/: one
    callback per file, its docstring the account)."""
    table = "\n".join(line for line in (ROOT / "docs" / "index.md").read_text().splitlines() if line.startswith("|"))
    named = set(re.findall(r"`(?:[\w/]+/)?(\w+\.py)`", table))
    modules = {path.name for folder in ("lit_grpo", "datamodules") for path in (ROOT / folder).rglob("*.py")}
    assert sorted(modules - named - {"__init__.py", "__main__.py"}) == []


@pytest.mark.parametrize("page", ["README.md", "docs/engine.md"])
def test_the_engine_snippet_runs_as_written(page):
    """The engine's snippet, as a user copies it, on the tiny model with short completions: every name it uses is
    defined in it (the prompts too), and its result has the shape it names."""
    text = (ROOT / page).read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "engine.generate(" in b]
    code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', '"tiny-llama"')
    code = code.replace("group_size=32", "group_size=4").replace("micro_group_size=8", "micro_group_size=2")
    code = code.replace("max_new_tokens=1024", "max_new_tokens=4")
    assert '"tiny-llama"' in code and "max_new_tokens=4" in code, "the snippet's model or length changed"
    namespace: dict = {}
    exec(compile(code, page, "exec"), namespace)
    result, prompts = namespace["result"], namespace["prompts"]
    assert len(result.completion_ids) == len(prompts) and all(len(row) == 4 for row in result.completion_ids)
    assert [len(c) for row in result.completion_ids for c in row] == [
        len(lp) for row in result.logprobs for lp in row]


def test_the_plain_pytorch_loop_in_the_training_page_trains():
    """docs/training.md's loop without Lightning, on the tiny model with short completions: it runs as written, its
    log-probs at the step's start are the sampler's, and its optimizer steps move the weights."""
    import torch

    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("### The pieces without Lightning"):text.index("## The shared-prefix update")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', '"tiny-llama"').replace("lr=1e-6", "lr=1e-2")
    # the tiny model never ends a sample early: a reward of its first token's parity varies within a group
    code = code.replace("max_new_tokens=128", "max_new_tokens=6").replace("float(len(c) < 64)", "float(c[0] % 2)")
    assert '"tiny-llama"' in code and "c[0] % 2" in code, "the loop's model, length or reward changed"
    namespace: dict = {}
    exec(compile(code, "training.md", "exec"), namespace)
    model, micro, old_logps = namespace["model"], namespace["micro"], namespace["old_logps"]
    assert namespace["step"] == 2 and torch.isfinite(namespace["loss"])
    assert model.training, "the engine left the model in train mode, as the loop set it"
    with torch.no_grad():  # after the last step: the weights moved from those that sampled its rollout
        moved, _ = namespace["completion_logps"](model, micro)
    assert not torch.allclose(moved, old_logps, atol=1e-4)
    torch.testing.assert_close(namespace["logps"].detach(), old_logps, atol=1e-4, rtol=0)


def test_the_scheduler_pages_gate_note_example_reads_as_the_gate_writes_it():
    """docs/scheduler.md quotes a preempting gate's ``gate_note``; the note the gate writes has its form, digits
    aside (lognormal lengths, whose tail the gate preempts on)."""
    import random

    from lit_grpo.scheduling import LeastAttainedScheduler, RolloutWork

    (quoted,) = re.findall(r'"(preempting: [^"]+)"', (ROOT / "docs" / "scheduler.md").read_text())
    scheduler, rng = LeastAttainedScheduler(), random.Random(0)
    for _ in range(32):
        scheduler.observe([min(256, max(1, round(rng.lognormvariate(4.8, 1.0)))) for _ in range(16)])
    preempting, note = scheduler.judge(RolloutWork(prompt_lengths=[1] * 4, group_size=16, num_slots=8,
                                                   max_new_tokens=256))
    assert preempting, note
    assert re.sub(r"\d+", "9", quoted) == re.sub(r"\d+", "9", note), (quoted, note)


def _given_in(summary: dict, config: dict, where: str = "") -> list[str]:
    """The keys of ``summary`` (nested) whose value ``config`` does not hold."""
    wrong = []
    for key, value in summary.items():
        held = config.get(key, "<absent>") if isinstance(config, dict) else "<absent>"
        if isinstance(value, dict):
            wrong += _given_in(value, held, f"{where}{key}.")
        elif held != value:
            wrong.append(f"{where}{key}: {value!r} in the docs, {held!r} in the config")
    return wrong


def test_the_gpu_quick_starts_summary_of_its_recipe_holds_the_recipes_values():
    """docs/training.md's GPU quick start says what configs/qwen3_1.7b_gpu.yaml sets, as YAML flow mappings: each
    value it gives is the config's."""
    import yaml

    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("What it sets:"):text.index("`RunCheckpoint` keeps")]
    summary: dict = {}
    for span in re.findall(r"`([^`]+)`", section):
        summary.update(yaml.safe_load(span.replace("\n", " ")))
    assert set(summary) == {"trainer", "model", "data"}, summary
    config = yaml.safe_load((ROOT / "configs" / "qwen3_1.7b_gpu.yaml").read_text())
    assert _given_in(summary, config) == []
    assert _given_in({"model": {"lr": 2.0e-6, "loss": {"beta": 0.0}}, "data": {"size": 1}}, config) == [
        "model.lr: 2e-06 in the docs, 1e-06 in the config", "data.size: 1 in the docs, 20000 in the config"]
