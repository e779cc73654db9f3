"""Two-process training runs for the multi-process tests: ``lit-grpo fit`` of the tiny config on 2 CPU processes
(gloo), each rank's steps recorded by ``tools.step_recorder.StepRecorder``."""

from pathlib import Path

import torch

import forked_cli
from tools.harness import ROOT, free_port, repo_env

TINY = str(ROOT / "configs" / "tiny.yaml")


def fit_two_processes(tmp: Path, *args: str, steps: int = 2, launcher: bool = False) -> str:
    """Fit the tiny config for ``steps`` steps on 2 CPU processes (scale_rewards batch, dapo) with ``args`` added;
    returns the StepRecorder path (its records of every rank, and each rank's batch of step 1).

    The ranks are forked ``lit-grpo`` processes (tests/forked_cli.py) launched as 2 nodes x 1 process of one thread
    each. With ``launcher`` rank 0 is forked and Lightning's own launcher (``--trainer.devices 2``) starts rank 1
    from it as a real process; ``OMP_NUM_THREADS`` is then left out of the environment, so the threads per rank
    are what a user's run gets by default: its share of the cores."""
    record = tmp / "rec"
    argv = [
        "fit", "--config", TINY, *args, "--trainer.default_root_dir", str(tmp / "run"),
        "--trainer.accelerator", "cpu", "--trainer.max_steps", str(steps),
        "--model.scale_rewards", "batch", "--model.lr", "1e-2",
        "--trainer.callbacks+=tools.step_recorder.StepRecorder",
        f"--trainer.callbacks.path={record}", "--trainer.callbacks.save_batches=[1]"]
    if launcher:
        env = {key: value for key, value in repo_env().items() if key != "OMP_NUM_THREADS"}
        proc = forked_cli.run([*argv, "--trainer.devices", "2"], tmp, env, timeout=400)
        outputs = [(proc.returncode, proc.stdout + proc.stderr, None)]
    else:
        outputs = forked_cli.run_ranks([*argv, "--trainer.num_nodes", "2", "--trainer.devices", "1"], tmp,
                                       free_port(), timeout=400, env=repo_env())
    for rank, (code, output, _) in enumerate(outputs):
        assert code == 0, f"rank {rank} ended with {code}:\n{output[-6000:]}"
        # Lightning's all_gather runs torch's deprecated autograd gather: nothing a user can act on
        assert "all_gather is deprecated" not in output, output[-6000:]
        # FSDP2's warning of a view among the sharded policy's outputs: transformers' hidden_states[0]
        assert "returned a view tensor" not in output, output[-6000:]
    assert "distributed_backend=gloo" in outputs[0][1]
    return str(record)


def save_eos_model(path: Path) -> str:
    """tiny-llama with its output head's EOS row scaled up, saved to ``path``: its samples end at many different
    steps (the plain random model runs nearly every sample to the cap), as a real model's do."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 20
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
