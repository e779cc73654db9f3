"""Reading tool calls out of an assistant turn's text, in the formats lit_grpo reads without a response schema.

The Hermes / Qwen format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``HERMES_CALL``, its body
JSON), or Qwen3.5's ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``
(``xml_call``), read after a reasoning block's ``</think>`` (``split_reasoning``: the block is the turn's
``reasoning_content``, as TRL parses Qwen3's turns). ``lit_grpo.rollout.tools.ToolBox.parse`` reads a turn with
them where the tokenizer has no response schema for its ``parse_response``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: The Hermes / Qwen tool-call format, for tokenizers without a response schema.
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
#: Qwen3.5's body of a ``<tool_call>`` block, ``<function=NAME>`` around its ``<parameter=KEY>`` blocks.
XML_FUNCTION = re.compile(r"<function=([^\n>]+)>(.*?)</function>", re.DOTALL)
#: One argument of a Qwen3.5 call: its value is the text between the tags, less the newlines the template puts around
#: it (TRL's Qwen3.5 response template strips it so too).
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\s*(.*?)\s*</parameter>", re.DOTALL)

#: How many of the tokens before a turn ``reasoning_open`` reads: enough for a ``<think>`` a byte tokenizer splits.
OPEN_REASONING_TAIL = 32


def reasoning_open(tokenizer: Any, prefix: Sequence[int]) -> bool:
    """Whether the text before a turn (``prefix``: its token ids) leaves a ``<think>`` block open, so the turn
    starts inside it: a template that pre-writes the opener in the generation prompt (as a thinking model's does)."""
    tail = tokenizer.decode(list(prefix[-OPEN_REASONING_TAIL:])) if prefix else ""
    return tail.rfind("<think>") > tail.rfind("</think>")


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a turn's text, as TRL's Qwen3 response template reads a reasoning block: a turn that
    starts with ``<think>`` (after whitespace), or inside one its prompt left open (``opened``), reasons up to its
    ``</think>`` (to its end where the block never closes); ``reasoning`` is that text stripped (empty for an empty
    block), ``rest`` what follows the block. ``(None, text)`` where the turn opens no block: a ``</think>`` without
    its opener is text (TRL's parser keeps it in the content)."""
    if text.lstrip().startswith("<think>"):
        body = text.lstrip()[len("<think>"):]
    elif opened:
        body = text
    else:
        return None, text
    end = body.find("</think>")
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len("</think>"):]


def read_calls(raw: Any) -> list[dict] | None:
    """``[{"name", "arguments"}]`` of a turn's parsed tool calls (each ``{"name", "arguments"}``, or TRL's
    ``{"type": "function", "function": {...}}``), or None where one cannot be read: the whole turn is then text, as
    TRL's ``parse_response`` validates them. Missing or null arguments are ``{}`` (a call of no argument)."""
    if not isinstance(raw, list):
        return None
    calls = []
    for call in raw:
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            return None
        arguments = function.get("arguments")
        calls.append({"name": function["name"], "arguments": {} if arguments is None else arguments})
    return calls


def call_body(body: str, tools: Sequence[dict] = ()) -> Any:
    """A ``<tool_call>`` block's body as ``read_calls`` takes it: Hermes JSON (``{"name", "arguments"}``), or
    Qwen3.5's ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>`` (``xml_call``); None where it is
    neither (the turn is then text, as TRL's parser falls back)."""
    return xml_call(body, tools) if body.startswith("<function=") else json_value(body)


def xml_call(body: str, tools: Sequence[dict] = ()) -> dict | None:
    """``{"name", "arguments"}`` of a Qwen3.5 call's body (``tools``: the schemas, which type its values); None
    where it is not one whole ``<function=...>...</function>`` block of parameters and whitespace, or names a
    parameter twice. The template writes a value as text (a mapping or a list as JSON), so a value is read as
    JSON (TRL's Qwen3.5 parser), and where that fails, or the tool's schema types it a string or another type than
    the JSON value's, kept as the text (Qwen's own parser: ``_xml_value``)."""
    whole = XML_FUNCTION.fullmatch(body.strip())
    if whole is None:
        return None
    name, inside = whole.group(1), whole.group(2)
    parameters = XML_PARAMETER.findall(inside)
    if XML_PARAMETER.sub("", inside).strip() or len({key for key, _ in parameters}) != len(parameters):
        return None
    types = next((tool["function"].get("parameters", {}).get("properties", {}) for tool in tools
                  if tool.get("function", {}).get("name") == name), {})
    return {"name": name, "arguments": {key: _xml_value(value, types.get(key, {}).get("type"))
                                        for key, value in parameters}}


#: A JSON schema's type names and the Python types of their JSON values (bool is no integer or number here).
_JSON_TYPES: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "boolean": (bool,),
                                            "object": (dict,), "array": (list,), "null": (type(None),),
                                            "string": (str,)}


def _xml_value(text: str, kind: Any) -> Any:
    """A Qwen3.5 argument's value: the text where the schema types it a string (``"75001"`` stays text), else its
    JSON value (Python's ``True`` / ``False`` / ``None``, which the template writes for those, as JSON's), else the
    text. Where the schema types it (``kind``: a JSON schema type or a list of them), a JSON value of another type
    stays text, as Qwen's own parser keeps a value that does not parse as its type (``2.5`` for an integer), and
    so does a JSON string (the template writes a string as it is: quotes are its own); ``null`` is None whatever the
    type but a string."""
    if kind == "string":
        return text
    spelled = {"True": "true", "False": "false", "None": "null"}.get(text, text)
    value = json_value(spelled)
    if value is None:
        return None if spelled == "null" else text
    allowed = [_JSON_TYPES.get(name) if isinstance(name, str) else None
               for name in (kind if isinstance(kind, list) else [kind])]
    if None in allowed:  # no type, or one this reading does not know: the JSON value as it reads
        return value
    if isinstance(value, str):  # a string type among others: the text as written, quotes and all
        return text
    fits = any(isinstance(value, types) and not (isinstance(value, bool) and bool not in types) for types in allowed)
    return value if fits else text


def json_value(body: str) -> Any:
    """``body`` decoded, or None where it is not JSON (a call whose body is not is no call: ``read_calls``)."""
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return None
