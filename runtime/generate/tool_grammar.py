"""Grammars that force a block of tool calls in a format's markup, for tool_choice "required" or a named function:
Lark text in llguidance's dialect (`%json {schema}` holds a call's arguments to its function's parameters schema).
Each writer gives the rules of one format with the block as rule `tool_calls`; tool_format.tool_choice_grammar puts
a `start` in front. The markers are written as strings: the releases' tool tokens are added tokens that are not
special, so their text is what the tokenizer makes of them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dsfp4.runtime.generate import tool_markup as mk

# a function whose schema gives no parameters takes any object
ANY_OBJECT = {"type": "object"}
NL = "\n"


def lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _schema(function: Mapping) -> str:
    return json.dumps(function.get("parameters") or ANY_OBJECT, ensure_ascii=False)


def _block(open_: str, between: str, close: str, n: int, parallel: bool) -> str:
    """The block rule: one call, or with `parallel` one or more joined by `between`."""
    more = f" ({lit(between)} call)*" if between else " call*"
    calls = "call" + (more if parallel else "")
    alternatives = " | ".join(f"fn_{i}" for i in range(n))
    return f"tool_calls: {lit(open_)} {calls} {lit(close)}\ncall: {alternatives}\n"


def grammar_v3(tools: Sequence[Mapping], parallel: bool) -> str:
    """V3 / R1: `function<sep>NAME\\n```json\\n{args}\\n```` per call, a newline between calls."""
    rules = [_block(mk.CALLS_BEGIN, "\n", mk.CALLS_END, len(tools), parallel)]
    for i, t in enumerate(tools):
        f = t["function"]
        head = f"{mk.CALL_BEGIN}{mk.CALL_TYPE}{mk.SEP}{f['name']}\n{mk.FENCE_OPEN}"
        rules.append(
            f"fn_{i}: {lit(head)} args_{i} {lit(mk.FENCE_CLOSE + mk.CALL_END)}\nargs_{i}: %json {_schema(f)}\n"
        )
    return "".join(rules)


def grammar_v31(tools: Sequence[Mapping], parallel: bool) -> str:
    """V3.1: `NAME<sep>{args}` per call, calls chained without separators."""
    rules = [_block(mk.CALLS_BEGIN, "", mk.CALLS_END, len(tools), parallel)]
    for i, t in enumerate(tools):
        f = t["function"]
        rules.append(
            f"fn_{i}: {lit(mk.CALL_BEGIN + f['name'] + mk.SEP)} args_{i} {lit(mk.CALL_END)}\n"
            f"args_{i}: %json {_schema(f)}\n"
        )
    return "".join(rules)


def _regex_escape(text: str) -> str:
    """`text` inside a Lark /regex/: the regex's specials and the slash escaped."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in text)


def _dsml_param(rule: str, key: str, schema: Mapping | None) -> str:
    """One parameter: a string-typed one as raw text up to its closing tag, any other as JSON to its schema."""
    if schema is not None and schema.get("type") == "string":
        open_tag = lit(f'{mk.DSML_PARAM} name="{key}" string="true">')
        text = f"/(?s:.*){_regex_escape(mk.DSML_PARAM_END)}/"
        return f"{rule}: {open_tag} {rule}_text {lit(NL)}\n{rule}_text[lazy]: {text}\n"
    open_tag = lit(f'{mk.DSML_PARAM} name="{key}" string="false">')
    body = json.dumps(schema or {}, ensure_ascii=False)
    return f"{rule}: {open_tag} %json {body} {lit(mk.DSML_PARAM_END + NL)}\n"


def grammar_dsml(tools: Sequence[Mapping], parallel: bool) -> str:
    """V4: an invoke per call with a parameter per property of the schema, in the schema's order (the required
    ones always, the others optional); a schema without properties takes any parameters, each JSON."""
    lead = mk.DSML_LEAD + mk.DSML_CALLS + "\n"
    rules = [_block(lead, "\n", "\n" + mk.DSML_CALLS_END, len(tools), parallel)]
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or ANY_OBJECT
        props: Mapping = params.get("properties") or {}
        required = set(params.get("required") or ())
        items = []
        for j, (key, schema) in enumerate(props.items()):
            rules.append(_dsml_param(f"p_{i}_{j}", key, schema))
            items.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        if not props:
            key_open, key_close = lit(f'{mk.DSML_PARAM} name="'), lit('" string="false">')
            rules.append(
                f"p_{i}_any: {key_open} /[A-Za-z0-9_.-]+/ {key_close} %json {{}} {lit(mk.DSML_PARAM_END + NL)}\n"
            )
            items.append(f"p_{i}_any*")
        head = f'{mk.DSML_INVOKE} name="{f["name"]}">\n'
        rules.append(f"fn_{i}: {lit(head)} {' '.join(items)} {lit(mk.DSML_INVOKE_END)}\n")
    return "".join(rules)
