"""The constraint of a DeepSeek chat prompt (`ChatPrompt.output_constraint`, from deepseek-recipe):
JSON for `response_format`, and for tools a Lark grammar of DeepSeek's own DSML tool-call block,
so a constrained answer is exactly what `deepseek-recipe` parses into OpenAI `tool_calls`.

The block (chat-encoding.md §2.3; V4.1 spells `calls`/`invoke`/`parameter` with a space after the
`｜DSML｜` token, V4 `tool_calls`/`invoke`/`parameter` without):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`｜DSML｜` is one special token (matched by id, never spelled by ordinary tokens). A string
parameter is raw text without `<` (at most `maxLength` characters when the schema says so);
any other parameter is JSON valid under its schema (llguidance's `%json`). Parameters come in
the schema's order, required ones always, optional ones possibly. With `tool_choice` auto the
answer is text without `<`, optionally followed by the block; with `required` (or a named tool)
the prompt has already opened the block, so the answer is its invokes and its end.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.serve.engine.types import StructuredOutputsParams

__all__ = ["chat_constraint", "tool_call_grammar"]


def chat_constraint(output_constraint: tuple[str, str] | None, *, model_type: str,
                    tokenizer) -> StructuredOutputsParams | None:
    """The structured-output spec of deepseek-recipe's `(kind, schema)` (None: none) for a model
    of `model_type` with `tokenizer` (a `tokenizers.Tokenizer`: where `｜DSML｜` is)."""
    dsml_token_id = tokenizer.token_to_id("｜DSML｜")
    if output_constraint is None:
        return None
    kind, schema = output_constraint
    if kind == "json":
        return StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=schema)
    if kind in ("tool_call", "tool_call_required"):
        if dsml_token_id is None:
            raise ValueError("tools: the tokenizer has no ｜DSML｜ token, so tool calls cannot be constrained")
        return StructuredOutputsParams(grammar=tool_call_grammar(
            json.loads(schema), v41=model_type == "deepseek_v41", dsml_token_id=dsml_token_id,
            required=kind == "tool_call_required"))
    raise ValueError(f"unknown output constraint kind {kind!r}")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: list[dict[str, Any]], *, v41: bool, dsml_token_id: int, required: bool) -> str:
    """The Lark grammar (llguidance) of the DSML tool-call block for `tools` (Chat-style function
    tools), see the module docstring."""
    dsml = f"<[{dsml_token_id}]>"
    sp = " " if v41 else ""
    block = "calls" if v41 else "tool_calls"

    def tag(opening: str, name: str, rest: str = ">") -> str:  # <｜DSML｜ invoke ...> or </｜DSML｜ invoke>
        return f"{_lit(opening)} {dsml} {_lit(sp + name + rest)}"

    rules, invokes = [], []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        name = function["name"]
        schema = function.get("parameters") or {}
        properties = schema.get("properties") or {}
        required_params = set(schema.get("required") or ())
        parts = []
        for j, (pname, pschema) in enumerate(properties.items()):
            is_string = isinstance(pschema, dict) and pschema.get("type") == "string" and "enum" not in pschema \
                and "pattern" not in pschema
            if is_string:
                limit = pschema.get("maxLength")
                value = f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"
            else:
                value = f"%json {json.dumps(pschema if isinstance(pschema, dict) else {})}"
            rule = f"p{i}_{j}"
            opening = tag("<", "parameter", f' name={json.dumps(pname)} string="{"true" if is_string else "false"}">')
            rules.append(f"{rule}: {opening} {value} {tag('</', 'parameter', '>\n')}")
            parts.append(rule if pname in required_params else f"{rule}?")
        invoke = f"invoke{i}"
        body = " ".join(parts)
        rules.append(f"{invoke}: {tag('<', 'invoke', f' name={_lit(name)}>' + chr(10))} {body} "
                     f"{tag('</', 'invoke', '>' + chr(10))}")
        invokes.append(invoke)
    rules.append("invoke: " + " | ".join(invokes))
    end = tag("</", block, ">")
    if required:
        start = f"start: invoke+ {end}"
    else:
        start = f"start: TEXT ({tag('<', block, '>' + chr(10))} invoke+ {end})?\nTEXT: /[^<]*/"
    return "\n".join([start, *rules]) + "\n"
