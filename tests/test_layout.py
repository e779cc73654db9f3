"""The house's plan, checked: every module imports only its own layer or lower ones, and the names a user imports
work from ``lit_grpo`` and ``lit_grpo.callbacks``. (Files are split by idea, not by a line count.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Package folders (as imported) and their layer: a module may import its own layer and lower ones only.
LAYERS = {
    "lit_grpo.runtime": 0,
    "lit_grpo.scheduling": 1,
    "lit_grpo.sampling": 2,
    "lit_grpo.batch": 3,
    "lit_grpo.rollout": 4,
    "lit_grpo.update": 5,
    "lit_grpo.export": 5,
    "lit_grpo.datamodules": 6,
    "lit_grpo.callbacks": 6,
    "lit_grpo.cli": 7,
}
SOURCES = {"lit_grpo": ROOT / "lit_grpo", "lit_grpo.callbacks": ROOT / "callbacks",
           "lit_grpo.datamodules": ROOT / "datamodules"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "lit_grpo" and parts[0] in ("callbacks", "datamodules"):
                continue
            modules[name] = path
    return modules


def _layer(module: str) -> int | None:
    for prefix, layer in sorted(LAYERS.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _imports(path: Path, module: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = module.rsplit(".", node.level if path.name != "__init__.py" else node.level - 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("lit_grpo")}


def test_every_module_has_a_layer_and_imports_no_higher_one():
    modules = _modules()
    assert "lit_grpo.update.module" in modules and "lit_grpo.callbacks.run_checkpoint" in modules
    problems = []
    for module, path in sorted(modules.items()):
        if module == "lit_grpo":
            continue  # the public API names everything, loaded lazily
        own = _layer(module)
        if own is None:
            problems.append(f"{module} belongs to no layer")
            continue
        for imported in sorted(_imports(path, module)):
            layer = _layer(imported)
            if layer is not None and layer > own:
                problems.append(f"{module} (layer {own}) imports {imported} (layer {layer})")
    assert not problems, "\n".join(problems)


def test_the_default_scheduler_imports_nothing_of_the_length_aware_method():
    """The default of "infinite" (least attained service) and the contract it runs on stand without the opt-in
    length-aware method (``lit_grpo.scheduling.length_aware``): only the config that names both may import it."""
    modules = _modules()
    default = sorted(m for m in modules if m.startswith("lit_grpo.scheduling.")
                     and not m.startswith("lit_grpo.scheduling.length_aware") and m != "lit_grpo.scheduling.config")
    assert {"lit_grpo.scheduling.base", "lit_grpo.scheduling.driver", "lit_grpo.scheduling.least_attained",
            "lit_grpo.scheduling.simulate"} <= set(default)
    problems = [f"{module} imports {name}" for module in default for name in sorted(_imports(modules[module], module))
                if name.startswith("lit_grpo.scheduling.length_aware")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["GRPOModule", "RolloutDataModule", "RolloutEngine", "SamplingConfig", "RolloutBatch",
                                  "GRPOLoss", "DAPOLoss", "make_loss", "accuracy_reward", "math_reward"])
def test_the_public_names_import_from_the_package(name):
    import lit_grpo

    assert getattr(lit_grpo, name).__name__ == name
    assert name in lit_grpo.__all__


def test_the_callbacks_import_from_their_package_and_unknown_names_fail():
    import lit_grpo
    import lit_grpo.callbacks as callbacks

    assert {"RunCheckpoint", "PeakMemoryMonitor", "FitSummary"} <= set(callbacks.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lit_grpo.Nope  # noqa: B018
