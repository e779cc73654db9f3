"""A trained reward model as a reward function (TRL's ``reward_funcs`` entry that names a model)::

    reward_funcs:
      - {name: reward_model, kwargs: {model: path/or/hub-id, dtype: bfloat16, batch_size: 16}}
      - org/reward-model-id          # the short form: a name with a '/' and no ':' (logged by its last part)

The model is a sequence classifier with one label (``AutoModelForSequenceClassification``, ``num_labels=1``), as
TRL loads it; a completion's reward is that label's logit for its prompt and itself together. The text scored is the
conversation, a chat prompt's messages (or a plain prompt as the user's turn) and then the completion's turns (the
assistant's, and with tool calls the tools'), rendered by the reward model's own chat template; where its tokenizer
has none, the prompt's text followed by the completion's, as TRL scores plain-text prompts (a conversation's turns'
contents a blank line apart, none left out). Its tokens are scored without truncation, ``batch_size`` texts a
forward, on the policy's device (``device: auto``: the current CUDA device where there is one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lit_grpo.runtime.validation import check_int, shown_setting
from lit_grpo.sampling.devices import indexed_device


class RewardModel:
    """Scores completions with a sequence-classification reward model (module docstring).

    Args:
        model: the reward model's hub id or folder (read offline where the hub is unreachable); a
            ``pathlib.Path`` is its text.
        dtype: the dtype it runs in (``model.dtype``'s names); None: its checkpoint's.
        device: "auto" (the current CUDA device, else the CPU) or a torch device name.
        batch_size: texts scored per forward, >= 1.
    """

    def __init__(self, model: str | os.PathLike, dtype: str | None = None, device: str = "auto",
                 batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from lit_grpo.runtime.models import hub_keywords, resolve_dtype

        if isinstance(model, os.PathLike):  # as its text, which the refusals below name and __name__ ends
            model = os.fsdecode(model)
        if not isinstance(model, str) or not model:
            raise ValueError(f"reward_model: {shown_setting('model', model)} must be a reward model's hub id or folder")
        batch_size = check_int("reward_model batch_size", batch_size, 1)
        try:  # checked before loading: a bad dtype is a setting's error, not the model's
            torch_dtype = resolve_dtype(dtype)
        except ValueError as error:
            raise ValueError(f"reward_model: {error}") from None
        _resolve_device(device)  # checked now, resolved at each call: a rank's CUDA device is set after the config
        self.device = device
        self.batch_size = batch_size
        self.__name__ = reward_model_name(model)
        try:
            # transformers' own tokenizer, not the policy's (load_tokenizer): it only pads here, so one without an
            # EOS token (an encoder's, BERT's) is as good as any
            source = _folder_or_id(model)
            where = hub_keywords(source) if isinstance(source, str) else {}  # a hub id: its cache where the hub is down
            self.tokenizer = AutoTokenizer.from_pretrained(source, **where)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, dtype=torch_dtype or "auto", **where,
                **({"adapter_kwargs": dict(where)} if where else {}))
        except (OSError, ValueError) as error:
            raise ValueError(f"reward_model: model={model!r} cannot be loaded as a sequence classifier with one label "
                             f"({type(error).__name__}: {str(error).splitlines()[0]:.300})") from None
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"reward_model: model={model!r} has a tokenizer with neither a pad token nor an EOS "
                                 "token, so a batch of texts cannot be padded; give the tokenizer a pad_token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the classifier scores each row's last token that is not padding: it must know which id pads
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval().requires_grad_(False)

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the reward model reads for each completion (module docstring); ``prompts`` and ``completions`` text,
        or chat messages (``reward_arguments``' conversational form)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return [_plain(prompt) + _plain(completion) for prompt, completion in zip(prompts, completions)]
        out = []
        for prompt, completion in zip(prompts, completions):
            history = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            turns = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
            conversation = [*map(dict, history), *map(dict, turns)]  # TRL's prompt + completion: every turn
            out.append(self.tokenizer.apply_chat_template(conversation, tokenize=False))
        return out

    @torch.inference_mode()
    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        device = _resolve_device(self.device)
        if self.model.device != device:
            self.model.to(device)
        texts = self.texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(device)
            scores.extend(self.model(**inputs).logits[:, 0].float().tolist())
        return scores


def _plain(part: Any) -> str:
    """A prompt or completion as plain text: itself, or its messages' contents a blank line apart (as a prompt
    renders without a chat template): no turn is left out."""
    return part if isinstance(part, str) else "\n\n".join(str(turn["content"]) for turn in part)


def _folder_or_id(model: str) -> str | Path:
    """The folder ``model`` names, ``~`` expanded (transformers reads ``~/rm`` as a hub id), else ``model`` as a hub
    id."""
    folder = Path(model).expanduser()
    return folder if folder.is_dir() else model


def _resolve_device(device: Any) -> torch.device:
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # ValueError: an index beyond a C long
        raise ValueError(f"reward_model: {shown_setting('device', device)} must be 'auto' or a torch device name "
                         "such as 'cpu' or 'cuda:0'") from None
    # the model's own device names its index: "cuda" compared with "cuda:0" would move it at every call
    return indexed_device(resolved) if torch.cuda.is_available() else resolved


def reward_model_name(model: str) -> str:
    """The name a reward model of ``model`` (a hub id or folder) gives itself: TRL's, the id's last part."""
    return Path(model.rstrip("/")).name


def is_reward_model_name(name: str) -> bool:
    """Whether a reward spec's name is the short form of a reward model (a '/' and no ':'; a module path has none)."""
    return "/" in name and ":" not in name


def reward_model_kwargs(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The short form's options: ``model`` is the name."""
    if "model" in kwargs:
        raise ValueError(f"reward function {name!r} names its reward model; its kwargs may not name another "
                         f"({shown_setting('model', kwargs['model'])})")
    return {"model": name, **kwargs}
