"""Rollout recordings: what ``tools.record_lengths`` writes and the replays read.

A recording is one JSON object (gzip-compressed when the file name ends in ``.gz``)::

    {"meta": {how it was made: model, task, settings, command, versions},
     "lengths": [[L of sample k of prompt p, ...] per prompt p],      # EOS included
     "truncated": [[bool, ...] per prompt],                           # ended at the cap, not on EOS
     "prompt_ids": [[token id, ...] per prompt],                      # token recordings only
     "completion_ids": [[[token id, ...] per sample] per prompt]}     # token recordings only

A length recording drives ``--lengths`` replays (forced EOS); a token recording also drives ``--tokens`` replays
(every sample's own tokens, so the model computes the hidden states it computed live) and the predictor study;
``read_replay`` reads a benchmark's ``--tokens`` or ``--lengths`` file.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def read_recording(path: Path | str) -> dict[str, Any]:
    """The recording at ``path``, checked: ``lengths`` is ``[B][G]`` with G alike for every prompt and, in a token
    recording, matches ``completion_ids``. A ValueError names the file and what is wrong."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        record = json.loads(raw)
    except (OSError, ValueError) as error:
        raise ValueError(f"recording {path}: cannot read it ({error})") from None
    lengths = record.get("lengths") if isinstance(record, dict) else None
    if not lengths or not all(isinstance(row, list) and row for row in lengths):
        raise ValueError(f"recording {path}: needs 'lengths', a non-empty list of per-prompt lists")
    if len({len(row) for row in lengths}) != 1:
        raise ValueError(f"recording {path}: every prompt needs the same number of samples, got "
                         f"{sorted({len(row) for row in lengths})}")
    if "completion_ids" in record:
        sizes = [[len(c) for c in group] for group in record["completion_ids"]]
        if sizes != lengths or len(record.get("prompt_ids", ())) != len(lengths):
            raise ValueError(f"recording {path}: 'completion_ids' and 'prompt_ids' do not match 'lengths'")
    return record


def has_tokens(record: dict[str, Any]) -> bool:
    return "completion_ids" in record


def write_recording(path: Path | str, record: dict[str, Any]) -> None:
    """Write ``record`` (gzip when ``path`` ends in ``.gz``; no timestamp inside, so equal records give equal
    files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)


class Replay:
    """A recording cut into rollouts of ``B`` prompts and their first ``G`` samples, for ``generate``'s ``lengths=``
    or ``tokens=``. Rollout 0 is the measured one; rollout i > 0 a warm-up, on the recording's next prompts, so that
    no scheduler or predictor is measured on samples it learned from: the recording must hold them all
    (``tools.make_length_sets`` writes warm-up prompts after the measured ones).
    """

    def __init__(self, record: dict[str, Any], kind: str, B: int, G: int) -> None:
        if kind == "tokens" and not has_tokens(record):
            raise ValueError("the recording has no 'completion_ids' (record them with tools.record_lengths "
                             "--tokens), or replay its lengths with --lengths")
        lengths = record["lengths"]
        if B > len(lengths) or G > len(lengths[0]):
            raise ValueError(f"the recording holds {len(lengths)} prompts x {len(lengths[0])} samples; asked for "
                             f"B={B}, G={G}")
        self.record, self.kind, self.B, self.G = record, kind, B, G

    def rollout(self, index: int) -> tuple[list[list[int]] | None, dict[str, Any]]:
        """``(prompt ids, or None for a length replay, which keeps the task's; generate's replay keyword)``."""
        total = len(self.record["lengths"])
        first = index * self.B
        if first + self.B > total:
            raise ValueError(f"the recording holds {total} prompts: rollout {index} of B={self.B} needs "
                             f"{first + self.B} (fewer warm-up rollouts, or a recording with more prompts)")
        rows = slice(first, first + self.B)
        if self.kind == "lengths":
            return None, {"lengths": [row[: self.G] for row in self.record["lengths"][rows]]}
        prompts = [list(p) for p in self.record["prompt_ids"][rows]]
        return prompts, {"tokens": [group[: self.G] for group in self.record["completion_ids"][rows]]}


def read_replay(args) -> Replay | None:
    """The ``--tokens`` or ``--lengths`` recording as a ``Replay`` (None: no replay), setting ``args.prompts``,
    ``args.group_size`` and (--tokens) ``args.max_new_tokens`` from the file unless given."""
    if not (args.tokens or args.lengths):
        return None
    flag, path = ("--tokens", args.tokens) if args.tokens else ("--lengths", args.lengths)
    try:
        record = read_recording(path)
        lengths = record["lengths"]
        args.prompts, args.group_size = args.prompts or len(lengths), args.group_size or len(lengths[0])
        replay = Replay(record, flag[2:], args.prompts, args.group_size)
    except ValueError as error:
        raise SystemExit(f"{flag} {path}: {error}") from None
    if args.tokens:
        cap = (record.get("meta") or {}).get("max_new_tokens")
        if not isinstance(cap, int):
            raise SystemExit(f"--tokens {path}: its meta has no max_new_tokens (the cap it was recorded under)")
        args.max_new_tokens = cap if args.max_new_tokens is None else args.max_new_tokens
        if args.max_new_tokens > cap:
            raise SystemExit(f"--max-new-tokens {args.max_new_tokens} is above the --tokens recording's cap "
                             f"max_new_tokens={cap}: its truncated samples hold no tokens past {cap}")
    return replay
