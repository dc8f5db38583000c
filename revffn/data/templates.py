"""Render normalised examples to text segments, marking which segments are trained on.

Loss is taken on assistant responses only; system/user turns and the role headers are masked.

* With `tokenizer.chat_template` set, every assistant turn i is cut out of the template's own
  rendering: prefix = render(messages[:i], add_generation_prompt=True), full = render(messages[:i+1]),
  and the trained segment is full[len(prefix):] (for the shipped tokenizer: content + "<|end|>\\n").
* Without one, `FALLBACK_TEMPLATE` is used:

      <|tools|>\\n{tools as JSON}\\n   (if the example offers tools)
      <|system|>\\n{content}\\n        (if any)
      <|user|>\\n{content}\\n
      <|assistant|>\\n{content}{eos}   (content + eos is trained, the header is not; each tool call follows
                                      the content as <tool_call>\\n{"name", "arguments"}\\n</tool_call>)
      <|tool|>\\n{content}\\n          (a tool's result, untrained)

  The role headers are plain text there (they are not special tokens of a foreign tokenizer).
* Tools (`tools`, an assistant turn's `tool_calls`) go to the chat template as transformers takes them
  (`apply_chat_template(messages, tools=...)`); a template that renders the same text without them would train
  the calls as empty turns, so it is refused, naming the example.

Plain-text examples are one trained segment: text + eos (eos marks the document end when packed).
"""

from __future__ import annotations

import json

from revffn.errors import UserError

# Role -> text before the content. An assistant turn is header + content + eos_token.
FALLBACK_TEMPLATE = {
    "system": "<|system|>\n{content}\n",
    "user": "<|user|>\n{content}\n",
    "assistant": "<|assistant|>\n",
    "tool": "<|tool|>\n{content}\n",
}
FALLBACK_TOOLS = "<|tools|>\n{tools}\n"
FALLBACK_CALL = "<tool_call>\n{call}\n</tool_call>"


def _fallback_turn(message: dict, eos: str) -> tuple[str, str]:
    """(untrained header text, trained text) of one turn under `FALLBACK_TEMPLATE`."""
    if message["role"] == "assistant":
        calls = [FALLBACK_CALL.format(call=json.dumps(c["function"])) for c in message.get("tool_calls", ())]
        return FALLBACK_TEMPLATE["assistant"], "\n".join(filter(None, [message["content"], *calls])) + eos
    return FALLBACK_TEMPLATE[message["role"]].format(content=message["content"]), ""


def _fallback_tools(tools: list[dict] | None) -> str:
    return FALLBACK_TOOLS.format(tools=json.dumps(tools)) if tools else ""


def _render(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None,
            source: str = "?") -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as e:  # the template's own raise_exception, or a field it cannot render
        raise UserError(f"tokenizer: its chat_template refuses the conversation of {source}: {e}. Fix: a tokenizer "
                        "whose chat_template takes these roles and fields, or change the example.") from None


def _check_renders_tools(messages: list[dict], tokenizer, tools: list[dict] | None, source: str) -> None:
    """Refuse a template that renders the conversation the same without its tool calls, or without its tools."""
    if any("tool_calls" in m for m in messages):
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if _render(tokenizer, messages, False, tools, source) == _render(tokenizer, bare, False, tools, source):
            raise UserError(f"tokenizer: its chat_template does not render tool_calls (at {source}), so the calls "
                            "would train as empty turns. Fix: a tokenizer whose chat_template renders tool calls "
                            "(e.g. Qwen2.5's), one without chat_template (the fallback renders them), or write the "
                            "calls into the assistant content.")
    if tools and _render(tokenizer, messages, False, tools, source) == _render(tokenizer, messages, False, None,
                                                                                   source):
        raise UserError(f"tokenizer: its chat_template does not render the tools offered (at {source}), so the "
                        "model would learn calls to functions it was never shown. Fix: a tokenizer whose "
                        "chat_template renders tools, one without chat_template, or describe the tools in the "
                        "system message.")


def _chat_segments(messages: list[dict], tokenizer, source: str, tools: list[dict] | None = None
                   ) -> list[tuple[str, bool]]:
    """Segments cut from the chat template's renderings of growing prefixes of the conversation."""
    _check_renders_tools(messages, tokenizer, tools, source)
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True, tools, source)
        full = _render(tokenizer, messages[: i + 1], False, tools, source)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise UserError(
                f"tokenizer: its chat_template cannot be split into prompt and response at {source} "
                f"(assistant turn {i}): the rendering of messages[:{i}] with the generation prompt is not a "
                f"prefix of the rendering of messages[:{i + 1}], so the template rewrites earlier text "
                "(e.g. drops reasoning from history). Fix: use a tokenizer whose chat_template renders earlier "
                "turns unchanged, or one without chat_template (the fallback template is then used).")
        segments += [(prefix[len(done):], False), (full[len(prefix):], True)]
        done = full
    return [(text, train) for text, train in segments if text]


def render_segments(example: dict, tokenizer) -> list[tuple[str, bool]]:
    """The example's text as consecutive `(text, train_on)` segments; only assistant responses are trained."""
    eos = tokenizer.eos_token or ""
    if example.get("text") is not None:
        return [(example["text"] + eos, True)]
    messages = example["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages = messages[: last + 1]  # turns after the last response carry no loss
    if getattr(tokenizer, "chat_template", None):
        return _chat_segments(messages, tokenizer, example.get("source", "?"), example.get("tools"))
    segments: list[tuple[str, bool]] = [(tools, False)] if (tools := _fallback_tools(example.get("tools"))) else []
    for message in messages:
        header, trained = _fallback_turn(message, eos)
        if segments and not segments[-1][1]:  # merge consecutive untrained text into one segment
            segments[-1] = (segments[-1][0] + header, False)
        else:
            segments.append((header, False))
        if trained:
            segments.append((trained, True))
    return segments


def render_prompt(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> str:
    """Prompt text for generation: all `messages` followed by the assistant generation prompt."""
    for i, m in enumerate(messages):
        if m.get("role") not in FALLBACK_TEMPLATE or not isinstance(m.get("content"), str):
            raise UserError(f"messages[{i}]: expected {{role: system|user|assistant|tool, content: str}}, "
                            f"got {m!r}.")
    if getattr(tokenizer, "chat_template", None):
        return _render(tokenizer, messages, True, tools)
    eos = tokenizer.eos_token or ""
    return (_fallback_tools(tools) + "".join("".join(_fallback_turn(m, eos)) for m in messages)
            + FALLBACK_TEMPLATE["assistant"])


def chat_prompts(prompts: list[str], tokenizer, system: str | None = None) -> list[str]:
    """User `prompts` rendered as single-turn chats, ready for generation."""
    head = [{"role": "system", "content": system}] if system else []
    return [render_prompt([*head, {"role": "user", "content": p}], tokenizer) for p in prompts]


def loglikelihood_request(example: dict, tokenizer) -> tuple[str, str]:
    """`(context, continuation)` scoring an example's last response as training renders it
    (`render_segments`: for the shipped template, content + "<|end|>\\n"), given everything before it.

    The context's trailing whitespace (the newline after the shipped "<|assistant|>" header) starts the
    continuation: lm-eval's `loglikelihood` moves it there itself, so the pair is what it scores, with
    nothing moved. The continuation's log-probability is then the response's summed token log-probs
    (minus `evaluate`'s loss sum over it) plus that of the header's newline.

    Raises:
        UserError: the example has no response to score (a plain-text example).
    """
    if example.get("text") is not None or not example.get("messages"):
        raise UserError(f"{example.get('source', '?')}: a loglikelihood request needs a chat example ending in "
                        "an assistant turn, got plain text. Fix: use prompt/response examples.")
    segments = render_segments(example, tokenizer)
    before, response = "".join(text for text, _ in segments[:-1]), segments[-1][0]
    context = before.rstrip()
    return context, before[len(context):] + response
