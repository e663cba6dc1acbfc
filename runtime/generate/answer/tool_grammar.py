"""Grammars that force a block of tool calls in a format's markup, for tool_choice "required" or a named function:
Lark text in llguidance's dialect (`%json {schema}` holds a call's arguments to its function's parameters schema).
Each writer gives the rules of one format with the block as rule `tool_calls`; tools.tool_choice_grammar puts a
`start` in front. A marker that is one token of the vocabulary (`ids`: its text -> its id) is written as that token,
`<[id]>`: llguidance keeps added tokens apart from text, so a string would never match them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from dsfp4.runtime.generate.answer import tool_markup as mk

# a function whose schema gives no parameters takes any object
ANY_OBJECT = {"type": "object"}
NL = "\n"
# whitespace before a block of calls, at most (R1's "</think>\n\n" has two)
GAP = 4


def lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def seq(text: str, ids: Mapping[str, int]) -> str:
    """`text` as a Lark sequence: its single-token markers as tokens, the text between as strings."""
    if not text:
        return ""
    if not ids:
        return lit(text)
    marker = re.compile("|".join(re.escape(m) for m in sorted(ids, key=len, reverse=True)))
    parts, at = [], 0
    for found in marker.finditer(text):
        if found.start() > at:
            parts.append(lit(text[at : found.start()]))
        parts.append(f"<[{ids[found.group()]}]>")
        at = found.end()
    if at < len(text):
        parts.append(lit(text[at:]))
    return " ".join(parts)


def _schema(function: Mapping) -> str:
    return json.dumps(function.get("parameters") or ANY_OBJECT, ensure_ascii=False)


def _block(
    open_: str, between: str, close: str, n: int, parallel: bool, ids: Mapping[str, int], trailing: bool = False
) -> str:
    """The block rule: one call, or with `parallel` one or more joined by `between`; `trailing`: `between` after
    every call, the last too (where `close` starts with it: llguidance's lexer would not tell them apart)."""
    if trailing:
        calls = f"(call {seq(between, ids)})" + ("+" if parallel else "")
    else:
        calls = "call" + ((f" ({seq(between, ids)} call)*" if between else " call*") if parallel else "")
    alternatives = " | ".join(f"fn_{i}" for i in range(n))
    # whitespace may come first where the block does not open with its own (V4's blank line): a few characters, or a
    # model could put the calls off for ever (a random one does, greedily)
    gap = "" if open_[:1].isspace() else f"/\\s{{0,{GAP}}}/ "
    return f"tool_calls: {gap}{seq(open_, ids)} {calls} {seq(close, ids)}\ncall: {alternatives}\n"


def grammar_v3(tools: Sequence[Mapping], parallel: bool, ids: Mapping[str, int]) -> str:
    """V3 / R1: `function<sep>NAME\\n```json\\n{args}\\n```` per call, a newline between calls."""
    rules = [_block(mk.CALLS_BEGIN, NL, mk.CALLS_END, len(tools), parallel, ids)]
    for i, t in enumerate(tools):
        f = t["function"]
        head = seq(f"{mk.CALL_BEGIN}{mk.CALL_TYPE}{mk.SEP}{f['name']}{NL}{mk.FENCE_OPEN}", ids)
        tail = seq(mk.FENCE_CLOSE + mk.CALL_END, ids)
        rules.append(f"fn_{i}: {head} args_{i} {tail}\nargs_{i}: %json {_schema(f)}\n")
    return "".join(rules)


def grammar_v31(tools: Sequence[Mapping], parallel: bool, ids: Mapping[str, int]) -> str:
    """V3.1: `NAME<sep>{args}` per call, calls chained without separators."""
    rules = [_block(mk.CALLS_BEGIN, "", mk.CALLS_END, len(tools), parallel, ids)]
    for i, t in enumerate(tools):
        f = t["function"]
        head, tail = seq(mk.CALL_BEGIN + f["name"] + mk.SEP, ids), seq(mk.CALL_END, ids)
        rules.append(f"fn_{i}: {head} args_{i} {tail}\nargs_{i}: %json {_schema(f)}\n")
    return "".join(rules)


def _dsml_param(rule: str, key: str, schema: Mapping | None, ids: Mapping[str, int]) -> str:
    """One parameter: its value as JSON to its schema; a string-typed one may also be raw text (the release's
    string="true", which the grammar keeps free of `<`: its closing tag starts with one)."""
    head = f'{mk.DSML_PARAM} name="{key}" string='
    end = seq(mk.DSML_PARAM_END + NL, ids)
    as_json = f"{seq(head + chr(34) + 'false' + chr(34) + '>', ids)} %json {json.dumps(schema or {})} {end}"
    if schema is None or schema.get("type") != "string":
        return f"{rule}: {as_json}\n"
    raw = f"{seq(head + chr(34) + 'true' + chr(34) + '>', ids)} /[^<]*/ {end}"
    return f"{rule}: {raw} | {as_json}\n"


def grammar_dsml(tools: Sequence[Mapping], parallel: bool, ids: Mapping[str, int]) -> str:
    """V4: an invoke per call with a parameter per property of the schema, in the schema's order (the required
    ones always, the others optional); a schema without properties takes any parameters, each JSON."""
    lead = mk.DSML_LEAD + mk.DSML_CALLS + NL
    rules = [_block(lead, NL, mk.DSML_CALLS_END, len(tools), parallel, ids, trailing=True)]
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or ANY_OBJECT
        props: Mapping = params.get("properties") or {}
        required = set(params.get("required") or ())
        items = []
        for j, (key, schema) in enumerate(props.items()):
            rules.append(_dsml_param(f"p_{i}_{j}", key, schema, ids))
            items.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        if not props:
            key_open, key_close = seq(f'{mk.DSML_PARAM} name="', ids), lit('" string="false">')
            end = seq(mk.DSML_PARAM_END + NL, ids)
            rules.append(f"p_{i}_any: {key_open} /[A-Za-z0-9_.-]+/ {key_close} %json {{}} {end}\n")
            items.append(f"p_{i}_any*")
        head = seq(f'{mk.DSML_INVOKE} name="{f["name"]}">{NL}', ids)
        rules.append(f"fn_{i}: {head} {' '.join(items)} {seq(mk.DSML_INVOKE_END, ids)}\n")
    return "".join(rules)
