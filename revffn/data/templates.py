"""Render normalised examples to text segments, marking which segments are trained on.

Loss is taken on assistant responses only; system/user turns and the role headers are masked.

* With `tokenizer.chat_template` set, every assistant turn i is cut out of the template's own
  rendering: prefix = render(messages[:i], add_generation_prompt=True), full = render(messages[:i+1]),
  and the trained segment is full[len(prefix):] (for the shipped tokenizer: content + "<|end|>\\n").
* Without one, `FALLBACK_TEMPLATE` is used:

      <|system|>\\n{content}\\n        (if any)
      <|user|>\\n{content}\\n
      <|assistant|>\\n{content}{eos}   (content + eos is trained, the header is not)

  The role headers are plain text there (they are not special tokens of a foreign tokenizer).

Plain-text examples are one trained segment: text + eos (eos marks the document end when packed).
"""

from __future__ import annotations

from revffn.errors import UserError

# Role -> text before the content. An assistant turn is header + content + eos_token.
FALLBACK_TEMPLATE = {
    "system": "<|system|>\n{content}\n",
    "user": "<|user|>\n{content}\n",
    "assistant": "<|assistant|>\n",
}


def _fallback_turn(message: dict, eos: str) -> tuple[str, str]:
    """(untrained header text, trained text) of one turn under `FALLBACK_TEMPLATE`."""
    if message["role"] == "assistant":
        return FALLBACK_TEMPLATE["assistant"], message["content"] + eos
    return FALLBACK_TEMPLATE[message["role"]].format(content=message["content"]), ""


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat_segments(messages: list[dict], tokenizer, source: str) -> list[tuple[str, bool]]:
    """Segments cut from the chat template's renderings of growing prefixes of the conversation."""
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, full = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1], False)
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
        return _chat_segments(messages, tokenizer, example.get("source", "?"))
    segments: list[tuple[str, bool]] = []
    for message in messages:
        header, trained = _fallback_turn(message, eos)
        if segments and not segments[-1][1]:  # merge consecutive untrained text into one segment
            segments[-1] = (segments[-1][0] + header, False)
        else:
            segments.append((header, False))
        if trained:
            segments.append((trained, True))
    return segments


def render_prompt(messages: list[dict], tokenizer) -> str:
    """Prompt text for generation: all `messages` followed by the assistant generation prompt."""
    for i, m in enumerate(messages):
        if m.get("role") not in FALLBACK_TEMPLATE or not isinstance(m.get("content"), str):
            raise UserError(f"messages[{i}]: expected {{role: system|user|assistant, content: str}}, got {m!r}.")
    if getattr(tokenizer, "chat_template", None):
        return _render(tokenizer, messages, True)
    eos = tokenizer.eos_token or ""
    return "".join("".join(_fallback_turn(m, eos)) for m in messages) + FALLBACK_TEMPLATE["assistant"]


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
