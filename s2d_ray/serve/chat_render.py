"""Chat messages and tools to the prompt, with nothing a client sends dropped on the way.

Each message goes to the model's chat template with its `name` and `tool_call_id` (as vLLM and transformers pass
them). A template that does not read a field gets it in the text instead: a name as `name: ` before the content, a
tool answer's call id in a `<tool_response>` wrapper (the Hermes / Qwen convention the calls are written in).
Tools go through the template's own `tools` argument when it renders tools (transformers' `apply_chat_template(...,
tools=...)`), with the form the grammar enforces appended to the system text for `required` and a named function;
otherwise they are listed in a system message (structured/tools.py `tool_prompt`).
"""

from __future__ import annotations

import json
import re

from ..prompts import encode_messages
from ..structured.tools import ToolSpec, tool_instructions, tool_prompt

_READS_NAME = re.compile(r"""message\s*(\.\s*name\b|\[\s*['"]name['"]\s*\])""")


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default", "")
    return template if isinstance(template, str) else ""


def template_renders_tools(tokenizer) -> bool:
    """Whether the template reads `tools` (Hermes, Qwen, Llama 3.1 and SmolLM3 templates do)."""
    return re.search(r"\btools\b", template_text(tokenizer)) is not None


def message_dicts(tokenizer, messages) -> list[dict]:
    """The template's input: role, content and, where given, name and tool_call_id, each read by the template or
    written into the content."""
    template = template_text(tokenizer)
    reads_name, reads_id = _READS_NAME.search(template) is not None, "tool_call_id" in template
    out = []
    for m in messages:
        content = m.text()
        entry: dict = {"role": m.template_role()}
        if m.tool_call_id is not None:
            if reads_id:
                entry["tool_call_id"] = m.tool_call_id
            else:
                content = f"<tool_response>{json.dumps({'tool_call_id': m.tool_call_id})}\n{content}</tool_response>"
        if m.name is not None:
            if reads_name:
                entry["name"] = m.name
            else:
                content = f"{m.name}: {content}"
        entry["content"] = content
        out.append(entry)
    return out


def encode_chat(tokenizer, messages, tools: tuple[ToolSpec, ...] | None, mode: str | None,
                parallel: bool = True) -> list[int]:
    """Prompt ids of a chat, tools shown when `mode` (the effective tool_choice) is set; `parallel`: the form asked
    for allows several calls."""
    dicts = message_dicts(tokenizer, messages)
    if mode is None or not tools:
        return encode_messages(tokenizer, dicts)
    if template_renders_tools(tokenizer):
        how = tool_instructions(mode, parallel) if mode != "auto" else ""
        if how:
            _add_system(dicts, how)
        schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.schema}} for t in tools]
        return encode_messages(tokenizer, dicts, tools=schemas)
    _add_system(dicts, tool_prompt(tools, mode, parallel))
    return encode_messages(tokenizer, dicts)


def _add_system(dicts: list[dict], text: str) -> None:
    if dicts and dicts[0]["role"] == "system":
        dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + text}
    else:
        dicts.insert(0, {"role": "system", "content": text})
