"""The documentation site (mkdocs.yml, docs/) builds offline with ``--strict``, and its API reference is whole.

``--strict`` turns every warning into a failure: a link to a page or anchor that does not exist, a ``:::`` block
naming an object griffe cannot find, a docstring whose ``Args:`` name a parameter the signature lacks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mkdocs_build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)],
                          cwd=config_dir, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    proc = _mkdocs_build(ROOT, site_dir)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]
    return site_dir


def test_every_page_of_the_nav_is_built(site):
    for page in ("index", "engine", "scheduler", "training", "reliability", "benchmarks", "api"):
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not built"
    assert (site / "slot_timeline.png").is_file()


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
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "global_step 1" in proc.stdout


def test_the_trl_port_in_the_docs_runs_its_reward_module_unchanged(tmp_path):
    """docs/training.md's TRL port: its reward module (TRL's signatures, chat completions) and its config, as written,
    train a step through ``lit-grpo fit`` on the tiny model, the module found in the working folder."""
    import json

    from tools.harness import lit_grpo_command, repo_env

    text = (ROOT / "docs" / "training.md").read_text()
    section = text[text.index("### A TRL script, ported"):text.index("## Callbacks and what they log")]
    (module,) = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if b.startswith("# my_rewards.py")]
    (config,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    (tmp_path / "my_rewards.py").write_text(module)
    (tmp_path / "trl_port.yaml").write_text(config)
    with open(tmp_path / "train.jsonl", "w") as rows:
        for i in range(6):
            rows.write(json.dumps({"prompt": [{"role": "system", "content": "Answer in <answer></answer>."},
                                              {"role": "user", "content": f"What is {i} + {i}?"}],
                                   "solution": str(2 * i)}) + "\n")
    overrides = ["--model.model", "tiny-llama", "--trainer.max_steps", "1", "--trainer.precision", "32-true",
                 "--data.sampling.max_new_tokens", "8", "--data.sampling.group_size", "2",
                 "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]
    proc = subprocess.run([*lit_grpo_command(), "fit", "--config", "trl_port.yaml", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=repo_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lit_grpo: 1 step" in proc.stdout + proc.stderr
