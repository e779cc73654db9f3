"""Stop strings: a sample ends once its completion's text contains one of them (vLLM's ``stop``, transformers'
``stop_strings``, TRL's ``generation_kwargs``).

The check runs on the host after each decode step, where the step's tokens already are, on the text of each row's
last few tokens only: a string of ``n`` UTF-8 bytes spans at most ``n`` tokens that hold text (a special token, which
the decoding skips, holds none; every other a byte or more), so the text from the last ``n + 1`` such tokens holds it
whenever the newest token completes it (the one token more keeps it off the window's first token, whose leading
space some tokenizers drop); and since the check runs after every token, the first time it holds the string is the
token that completed it. The text is decoded as the reward functions' is (special tokens skipped). Only rows whose
newest token could complete a string are decoded: its own text holds a string's last character, or part of one (an
incomplete UTF-8 sequence), learnt once per token id.

The completion keeps that token (its text may run a few characters past the string) and the string itself, as
transformers' does: the tokens trained on are the tokens sampled, and the reward functions see their text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopStrings:
    """Which completions end on one of ``strings``, decoded with ``tokenizer``.

    Args:
        tokenizer: the policy's tokenizer (its ``batch_decode``).
        strings: non-empty strings.
    """

    def __init__(self, tokenizer: Any, strings: Sequence[str]):
        if not strings:
            raise ValueError("stop strings: give at least one (or none of this object)")
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.window = max(len(s.encode("utf-8")) for s in self.strings) + 1
        self._last_chars = {s[-1] for s in self.strings}
        # a token decoded alone may lose its leading space (SentencePiece): a string ending in one checks every row
        self._check_all = any(c.isspace() for c in self._last_chars)
        self._may_complete: dict[int, bool] = {}  # token id -> its text could complete a string
        self._holds_text: dict[int, bool] = {}  # token id -> it decodes to some text (a special token does not)

    def ended(self, completions: Sequence[Sequence[int]]) -> list[bool]:
        """``[N]``: each completion's text ends its sample (holds a stop string in its last ``window`` tokens
        that hold text).

        Args:
            completions: ``[N][T_i]`` token ids so far, each checked after every token it gained.
        """
        rows = [i for i, ids in enumerate(completions) if ids and self._could_complete(ids[-1])]
        ended = [False] * len(completions)
        if rows:
            texts = self.tokenizer.batch_decode([list(completions[i][self._window_start(completions[i]):])
                                                 for i in rows], skip_special_tokens=True)
            for i, text in zip(rows, texts):
                ended[i] = any(s in text for s in self.strings)
        return ended

    def _window_start(self, ids: Sequence[int]) -> int:
        """Where the window of ``ids`` starts: at its ``window``-th last token that holds text (or its first token),
        so that the special tokens among the last ones do not push a string's first tokens out of it."""
        start, held = len(ids), 0
        while start > 0 and held < self.window:
            start -= 1
            token = ids[start]
            if token not in self._holds_text:
                self._holds_text[token] = self.tokenizer.decode([token], skip_special_tokens=True) != ""
            held += self._holds_text[token]
        return start

    def _could_complete(self, token: int) -> bool:
        known = self._may_complete.get(token)
        if known is None:
            text = self.tokenizer.decode([token], skip_special_tokens=True)
            known = self._check_all or "\ufffd" in text or any(c in text for c in self._last_chars)
            self._may_complete[token] = known
        return known
