"""``lit-grpo export``: a training checkpoint (or a live policy) to a transformers model directory.

    lit-grpo export --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --out my-model
    lit-grpo export --ckpt_path CKPT --out DIR --dtype bfloat16        # cast the weights on the way out
    lit-grpo export --ckpt_path CKPT --out DIR --adapter_only          # a LoRA run: the adapter alone

The directory is what ``transformers`` (and vLLM, SGLang, llama.cpp's converter, the Hub) load with no lit_grpo
installed: ``model.safetensors`` (or shards), ``config.json``, the tokenizer with its chat template, and a
``generation_config.json`` whose EOS ids are the ones the rollout engine stops on, so ``generate`` ends where
training's completions ended (a run with ``data.tools`` also stopped at its chat template's end-of-turn token,
``ToolBox.stop_token_ids``, which a Qwen base model's EOS is not: the checkpoint's data settings name the tools).
A LoRA run is merged into the base weights by default (peft's ``merge_and_unload``); ``adapter_only`` writes
peft's adapter directory instead, which needs the base model to load.

A checkpoint holds the module's init arguments (``hyper_parameters``: the base model's name, its dtype, the LoRA
config) and the policy's weights under ``state_dict`` with the prefix ``policy.``; the base is rebuilt from its
name with :func:`lit_grpo.runtime.models.load_model_and_tokenizer` and the trained weights are loaded over it
strictly, so a checkpoint of another architecture fails naming the keys that differ.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from lit_grpo.runtime.checkpoints import check_writable, find_last_checkpoint, read_checkpoint_header
from lit_grpo.runtime.head_precision import cast_lm_head_to_fp32, layers_dtype
from lit_grpo.runtime.models import DTYPES, follow_umask, load_model_and_tokenizer, resolve_dtype, with_lora
from lit_grpo.runtime.sizes import disk_bytes, format_bytes
from lit_grpo.runtime.validation import check_choice, check_thread_count, config_errors, default_threads, shown_setting
from lit_grpo.sampling.engine import stop_token_ids

#: ``--dtype`` values: "auto" keeps the dtype the policy was trained in; the others (and their short forms, as
#: ``model.dtype`` takes them) cast the weights.
EXPORT_DTYPES = ("auto", *(name for name in DTYPES if name != "float64"))
POLICY_PREFIX = "policy."
#: The files of an earlier export that an ``overwrite`` removes before writing: a stale one could be loaded instead
#: of the new model (transformers takes a single ``model.safetensors`` over shards, and a directory with an
#: ``adapter_config.json`` as a LoRA adapter), and save_pretrained removes none of them.
MODEL_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json", "adapter_config.json",
               "adapter_model.safetensors", "adapter_model.bin", "config.json", "generation_config.json")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_policy` wrote: the directory, its size on disk, the weights' dtype, whether it holds a
    LoRA adapter alone, and the seconds it took."""

    out: Path
    bytes: int
    dtype: torch.dtype
    adapter_only: bool
    seconds: float

    def describe(self) -> str:
        """One line for a terminal: where, how big, what."""
        kind = "LoRA adapter" if self.adapter_only else "transformers model"
        return (f"{self.out} ({kind}, {str(self.dtype).removeprefix('torch.')}, {format_bytes(self.bytes)}, "
                f"{self.seconds:.1f} s)")


def check_dtype(dtype: str | None) -> str:
    """``dtype`` if it is one of ``EXPORT_DTYPES`` (None means "auto"); else a ValueError naming it."""
    return check_choice("dtype", "auto" if dtype is None else dtype, EXPORT_DTYPES)


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _prepare_out(out: Path, overwrite: bool) -> None:
    if not str(out).strip() or out == Path("."):  # an empty --out would write into the working directory
        raise ValueError(f"--out {str(out)!r} names no new directory; give the folder to write, e.g. --out model")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace its model files "
                         "or choose another directory")
    try:
        check_writable(out, what="--out", fix="give a folder that can be written")
    except OSError as error:
        raise ValueError(str(error)) from None


def _remove_model_files(out: Path) -> None:
    """Remove what an earlier export wrote to ``out`` (``MODEL_FILES``); other files stay."""
    for pattern in MODEL_FILES:
        for path in out.glob(pattern):
            if path.is_file():
                path.unlink()


def export_policy(policy: torch.nn.Module, tokenizer: Any, out: str | Path, dtype: str | None = "auto",
                  adapter_only: bool = False, overwrite: bool = False, in_place: bool = False,
                  extra_eos_token_ids: Sequence[int] = ()) -> ExportResult:
    """Write ``policy`` and ``tokenizer`` to ``out`` as a transformers model directory (module docstring).

    ``dtype``: one of ``EXPORT_DTYPES``; "auto" keeps each parameter's own (a bf16 model's float32 router stays
    float32; an adapter alone: the adapter's, which peft trains in float32 over a bf16 base). ``adapter_only``: only
    for a LoRA (peft) policy, the adapter alone. ``policy`` is left as it was (a copy is merged or cast where that
    is needed) unless ``in_place``, which saves the copy's memory when the policy is not used afterwards.
    ``extra_eos_token_ids``: token ids the rollouts also stopped on beside the EOS ids (``run_stop_token_ids``).
    """
    started = time.perf_counter()
    dtype = check_dtype(dtype)
    out = Path(out).expanduser()
    if adapter_only and not _is_peft(policy):
        raise ValueError("adapter_only=True needs a LoRA run (model.peft_config); this policy has no adapter")
    _prepare_out(out, overwrite)
    # "auto" casts nothing: the adapter as it trained (float32 over a bf16 base), and the layers a model keeps in
    # float32 beside bf16 weights (a MoE router) stay so.
    cast = dtype != "auto"
    if cast:
        torch_dtype = resolve_dtype(dtype)
    elif not adapter_only:
        # not a float32 head's (cast_lm_head_to_fp32), which a tied embedding shares and may come first
        torch_dtype = layers_dtype(policy)
    else:
        torch_dtype = next((p.dtype for name, p in policy.named_parameters() if "lora_" in name),
                           next(policy.parameters()).dtype)
    merge = _is_peft(policy) and not adapter_only
    changes = merge or (cast and any(p.dtype != torch_dtype for p in policy.parameters() if p.is_floating_point()))
    model = copy.deepcopy(policy) if changes and not in_place else policy
    if merge:
        # Merge in the trained precision, then cast: rounding the adapter before adding it would lose its update.
        model = model.merge_and_unload()
    if cast:
        model = model.to(torch_dtype)
    base = model.get_base_model() if adapter_only else model
    live = (base.config, base.generation_config)
    # The settings below are the exported directory's: set on copies, so that a live policy keeps its own.
    base.config, base.generation_config = copy.deepcopy(base.config), copy.deepcopy(base.generation_config)
    try:
        base.config.use_cache = True  # gradient checkpointing turns the KV cache off for training only
        generation = base.generation_config
        generation.eos_token_id = sorted({*stop_token_ids(base, tokenizer), *map(int, extra_eos_token_ids)})
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        if generation.bos_token_id is None and tokenizer.bos_token_id is not None:
            generation.bos_token_id = tokenizer.bos_token_id
        if not adapter_only:
            eos = generation.eos_token_id
            base.config.eos_token_id = eos[0] if len(eos) == 1 else eos
            base.config.pad_token_id = generation.pad_token_id
        _remove_model_files(out)
        model.save_pretrained(out, safe_serialization=True)
        # safetensors writes 0600, readable by the exporting user alone; a file of the user's in out keeps its mode
        follow_umask(*(path for pattern in MODEL_FILES if pattern.endswith(".safetensors")
                       for path in out.glob(pattern)))
        written = str(base.config.dtype).removeprefix("torch.")  # save_pretrained's: the first weight's dtype
        if not adapter_only and written != str(torch_dtype).removeprefix("torch."):
            # transformers and vLLM load every layer in the config's dtype
            base.config.dtype = torch_dtype
            base.config.save_pretrained(out)
        if adapter_only:  # peft writes the adapter only; keep the generation settings beside it
            generation.save_pretrained(out)
    finally:
        base.config, base.generation_config = live
    tokenizer.save_pretrained(out)
    return ExportResult(out=out, bytes=disk_bytes(out), dtype=torch_dtype, adapter_only=adapter_only,
                        seconds=time.perf_counter() - started)


def load_checkpoint(ckpt_path: str | Path) -> Mapping[str, Any]:
    """The checkpoint's contents (memory-mapped: the weights are read only when used); errors name the file and
    what is wrong (:func:`lit_grpo.runtime.checkpoints.read_checkpoint_header`)."""
    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        raise ValueError(f"--ckpt_path {str(path)!r} is a directory (a sharded FSDP checkpoint?); export takes one "
                         ".ckpt file such as lightning_logs/version_0/checkpoints/last.ckpt")
    try:
        checkpoint = read_checkpoint_header(path)
    except FileNotFoundError:
        raise ValueError(f"--ckpt_path {str(path)!r} does not exist") from None
    except ValueError as err:
        raise ValueError(f"--ckpt_path {str(path)!r} is not a readable PyTorch checkpoint: {err}") from None
    if "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise ValueError(f"--ckpt_path {str(path)!r} is not a lit_grpo training checkpoint (it needs 'state_dict' and "
                         f"'hyper_parameters'; it has {sorted(checkpoint)})")
    return checkpoint


def _hold_as_saved(policy: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Each floating parameter in the dtype the checkpoint holds it in: a run under ``bf16-true`` leaves
    ``model.dtype`` null and saves bf16 weights, which the model rebuilt in the checkpoint's float32 would widen."""
    for name, param in policy.named_parameters():
        saved = state.get(name)
        if saved is not None and saved.is_floating_point() and saved.dtype != param.dtype:
            param.data = param.data.to(saved.dtype)


def policy_from_checkpoint(ckpt_path: str | Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """``(policy, tokenizer, hyper_parameters)``: the base model rebuilt from the checkpoint's settings (LoRA
    adapter included) with the trained weights loaded strictly."""
    checkpoint = load_checkpoint(ckpt_path)
    if not isinstance(checkpoint["hyper_parameters"], Mapping):
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r}: its hyper_parameters are "
                         f"{type(checkpoint['hyper_parameters']).__name__}, not the settings GRPOModule saves")
    hp = dict(checkpoint["hyper_parameters"])
    if "model" not in hp:
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r}: hyper_parameters hold no 'model' (keys {sorted(hp)}); "
                         "it was not saved by GRPOModule")
    state = {k[len(POLICY_PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(POLICY_PREFIX)}
    if not state:
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r} holds no policy weights (no state_dict key starts with "
                         f"{POLICY_PREFIX!r})")
    with config_errors(f"--ckpt_path {str(ckpt_path)!r}: its model.dtype"):
        resolve_dtype(hp.get("dtype"))
    policy, tokenizer = load_model_and_tokenizer(hp["model"], hp.get("dtype"))
    if hp.get("cast_lm_head_to_fp32"):  # as GRPOModule built it: before LoRA, whose copies of the head then match
        cast_lm_head_to_fp32(policy)
    if hp.get("peft_config"):
        policy = with_lora(policy, hp["peft_config"])
    own = policy.state_dict()
    reshaped = [f"{key} {tuple(value.shape)} (the model's {tuple(own[key].shape)})" for key, value in state.items()
                if key in own and value.shape != own[key].shape]
    if reshaped:
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r}: its weights do not fit model={hp['model']!r}: "
                         f"{', '.join(reshaped[:3])}")
    _hold_as_saved(policy, state)
    missing, unexpected = policy.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r}: its weights do not fit model={hp['model']!r} "
                         f"({shown_setting('peft_config', hp.get('peft_config'))}): missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    return policy.eval(), tokenizer, hp


def run_stop_token_ids(data_settings: Mapping[str, Any] | None, policy: torch.nn.Module, tokenizer: Any,
                       ckpt_path: str | Path) -> list[int]:
    """The ids a run's rollouts stopped on beside the EOS ids, from its data settings (a checkpoint's
    ``datamodule_hyper_parameters``; None: a checkpoint without them): with ``tools``, the chat template's
    end-of-turn token (``ToolBox.stop_token_ids``, the tools imported by their names as the run resolved them);
    else none. Raises naming the checkpoint where the tools do not import or the template ends no turn."""
    from lit_grpo.rollout.tools import ToolBox

    settings = dict(data_settings or {})
    if not settings.get("tools"):
        return []
    try:
        box = ToolBox(settings["tools"], tokenizer, settings.get("max_tool_calling_iterations"),
                      settings.get("chat_template_kwargs"), settings.get("system_prompt"),
                      settings.get("prompt_template") or "{prompt}")
        return box.stop_token_ids(policy)
    except ValueError as error:
        raise ValueError(f"--ckpt_path {str(ckpt_path)!r}: the run called tools "
                         f"({shown_setting('data.tools', settings['tools'])}), "
                         f"whose rollouts also stopped at the chat template's end-of-turn token, which export reads "
                         f"with them: {error}") from error


def export_checkpoint(ckpt_path: str | Path, out: str | Path, dtype: str | None = "auto",
                      adapter_only: bool = False, overwrite: bool = False) -> ExportResult:
    """:func:`policy_from_checkpoint` then :func:`export_policy`, with the stop ids of the run's tools
    (:func:`run_stop_token_ids`)."""
    check_dtype(dtype)
    checkpoint = load_checkpoint(ckpt_path)
    if adapter_only and not checkpoint["hyper_parameters"].get("peft_config"):
        raise ValueError(f"--adapter_only needs a LoRA run; {str(ckpt_path)!r} was trained without "
                         "model.peft_config (export the whole model instead)")  # said before the model loads
    data_settings = checkpoint.get("datamodule_hyper_parameters")
    policy, tokenizer, _ = policy_from_checkpoint(ckpt_path)
    stops = run_stop_token_ids(data_settings, policy, tokenizer, ckpt_path)
    return export_policy(policy, tokenizer, out, dtype=dtype, adapter_only=adapter_only, overwrite=overwrite,
                         in_place=True, extra_eos_token_ids=stops)


class _ExportParser(argparse.ArgumentParser):
    """Errors as ``lit-grpo fit`` says them: one ``error:`` line and a tip (exit 2), not the usage block first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\ntip: lit-grpo export --help lists the options\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _ExportParser(
        prog="lit-grpo export", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Write a transformers model directory (safetensors weights, config, tokenizer with its chat "
                    "template, generation config) from a lit_grpo training checkpoint.",
        epilog="Load it anywhere, with no lit_grpo installed:\n"
               "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
               "  model = AutoModelForCausalLM.from_pretrained(DIR); tokenizer = AutoTokenizer.from_pretrained(DIR)")
    parser.add_argument("--ckpt_path", required=True, help="a training checkpoint (.ckpt), e.g. "
                        "lightning_logs/version_0/checkpoints/last.ckpt, or last: the newest last.ckpt of a run "
                        "under --root, as lit-grpo fit --ckpt_path last finds it")
    parser.add_argument("--root", default=".", help="with --ckpt_path last: where the runs are, searched 3 folders "
                        "deep for checkpoints/ (default: the working directory, as trainer.default_root_dir)")
    parser.add_argument("--out", required=True, help="the directory to write (created; must be empty unless "
                        "--overwrite)")
    parser.add_argument("--dtype", default="auto", help=f"weights' dtype, one of {', '.join(EXPORT_DTYPES)} "
                        "(auto: the dtype the policy was trained in)")
    parser.add_argument("--adapter_only", action="store_true", help="a LoRA run: write the peft adapter alone "
                        "instead of the merged model (loading it needs the base model)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out, replacing the "
                        "model files an earlier export left there")
    parser.add_argument("--torch_num_threads", type=int, default=None, help="torch.set_num_threads(N) (default: "
                        "OMP_NUM_THREADS where set, else the cores this process may use, a CPU quota counted)")
    return parser


def main(args: Sequence[str] | None = None) -> int:
    """``lit-grpo export ...``; errors are one line naming the bad value (exit status 2)."""
    parser = build_parser()
    options = parser.parse_args(list(sys.argv[1:] if args is None else args))
    try:
        check_dtype(options.dtype)
    except ValueError as error:
        parser.error(f"--{error}")
    if options.torch_num_threads is not None:
        try:
            check_thread_count("--torch_num_threads", options.torch_num_threads)
        except ValueError as error:
            parser.error(str(error))
        torch.set_num_threads(options.torch_num_threads)
    elif (threads := default_threads()) is not None:
        torch.set_num_threads(threads)
    if options.ckpt_path == "last":
        root = Path(options.root)
        # ROOT/checkpoints, and a logger's ROOT/SAVE_DIR[/NAME]/VERSION/checkpoints
        folders = [folder for depth in range(4) for folder in root.glob("*/" * depth + "checkpoints")]
        found = find_last_checkpoint(folders)
        if found is None:
            # a Lightning script of one's own keeps ModelCheckpoint's epoch=N-step=M.ckpt files, and no last.ckpt;
            # newest first: by name, epoch=1 would come before epoch=2, and epoch=10 before epoch=9
            paths = sorted((path for folder in folders for path in folder.glob("*.ckpt")),
                           key=lambda path: path.stat().st_mtime, reverse=True)
            others = [str(path) for path in paths]
            there = (f"; the checkpoints there, newest first: {', '.join(others[:5])}"
                     f"{' ...' if len(others) > 5 else ''} (give one as --ckpt_path)") if others else ""
            parser.error(f"--ckpt_path last: no last.ckpt in a checkpoints folder up to 3 levels under {root}; give "
                         f"the checkpoint's path, or --root the run's trainer.default_root_dir{there}")
        print(f"lit_grpo: --ckpt_path last: exporting {found}", file=sys.stdout)
        options.ckpt_path = str(found)
    try:
        result = export_checkpoint(options.ckpt_path, options.out, options.dtype, options.adapter_only,
                                   options.overwrite)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    print(f"lit_grpo: exported {result.describe()}", file=sys.stdout)
    if not result.adapter_only:
        print(f"  load it: AutoModelForCausalLM.from_pretrained({os.fspath(result.out)!r})")
    return 0
