"""Templates, loss masking, truncation, packing and padding."""

import pytest

from revffn.data.collate import IGNORE_INDEX, collate, tokenize_dataset
from revffn.data.formats import load_examples, normalise
from revffn.data.templates import render_prompt, render_segments
from revffn.data.tokenizer import load_tokenizer
from revffn.errors import UserError

MULTI = normalise({"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse: red cat"},
    {"role": "assistant", "content": "cat red"}, {"role": "user", "content": "Reverse: sun moon star"},
    {"role": "assistant", "content": "star moon sun"}]}, "x.jsonl:1")
SINGLE = normalise({"instruction": "Tom has 3 apples and buys 4 more.", "output": "3 + 4 = 7\nAnswer: 7"}, "x.jsonl:2")


def _trained(ids, labels):
    return [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]


def _encode(example, tokenizer):
    return tokenize_dataset([example], tokenizer, 4096).items[0]


@pytest.mark.parametrize("path", ["chat", "fallback"])
def test_labels_mask_exactly_the_prompt(path, tok, fallback_tok):
    tokenizer, end = (tok, "<|end|>\n") if path == "chat" else (fallback_tok, "<|end|>")
    assert bool(tokenizer.chat_template) == (path == "chat")
    for example in (SINGLE, MULTI):
        ids, labels = _encode(example, tokenizer)
        segments = render_segments(example, tokenizer)
        assert "".join(text for text, _ in segments) == tokenizer.decode(ids)
        expected = []  # per-token mask built from the segments
        for text, train in segments:
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            expected += [train] * n
        assert [lab != IGNORE_INDEX for lab in labels] == expected
        assert all(lab == t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX)
        answers = [m["content"] + end for m in example["messages"] if m["role"] == "assistant"]
        assert tokenizer.decode(_trained(ids, labels)) == "".join(answers)
        assert labels[0] == IGNORE_INDEX  # the prompt starts untrained


@pytest.mark.parametrize("path", ["chat", "fallback"])
def test_render_prompt_matches_training_prefix(path, tok, fallback_tok):
    tokenizer = tok if path == "chat" else fallback_tok
    prompt = render_prompt(MULTI["messages"][:-1], tokenizer)
    full = "".join(text for text, _ in render_segments(MULTI, tokenizer))
    assert full.startswith(prompt) and full[len(prompt):].startswith("star moon sun")
    assert prompt.endswith("<|assistant|>\n")


def test_chat_template_uses_special_tokens(tok):
    ids, labels = _encode(SINGLE, tok)
    for name in ("<|user|>", "<|assistant|>", "<|end|>"):
        assert tok.convert_tokens_to_ids(name) in ids
    assert ids[-2:] == [tok.eos_token_id, tok("\n", add_special_tokens=False)["input_ids"][0]]


def test_plain_text_trains_every_token(tok):
    ex = normalise({"text": "Return a new list."}, "t:1")
    ids, labels = _encode(ex, tok)
    assert labels == ids and tok.decode(ids) == "Return a new list." + tok.eos_token


def test_template_that_rewrites_history_is_a_clear_error():
    t = load_tokenizer(None)
    t.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}>>{% endif %}")
    with pytest.raises(UserError, match=r"tokenizer: .*chat_template.*x.jsonl:2"):
        render_segments(SINGLE, t)


def test_truncation_is_counted_and_dropped(tok):
    examples = load_examples("builtin:gsm_train")[:20]
    full = tokenize_dataset(examples, tok, 4096)
    lengths = [len(ids) for ids, _ in full.items]
    cut = sorted(lengths)[10]  # about half the examples are longer than this
    ds = tokenize_dataset(examples, tok, cut)
    assert ds.stats["n_truncated"] == sum(n > cut for n in lengths) > 0
    assert all(len(ids) <= cut for ids, _ in ds.items)
    assert ds.stats["n_dropped"] + len(ds.items) == ds.stats["n_examples"] == 20
    assert ds.stats["n_train_tokens"] < full.stats["n_train_tokens"]


def test_empty_after_truncation_raises(tok):
    examples = load_examples("builtin:gsm_train")[:5]
    with pytest.raises(UserError, match=r"^train_data: .*max_seq_length=8.*Fix: raise max_seq_length"):
        tokenize_dataset(examples, tok, 8, key="train_data")


@pytest.mark.parametrize("length", [32, 50, 128])
def test_packing_rows_and_tokens(tok, length):
    examples = load_examples("builtin:format_train")[:40]
    plain = tokenize_dataset(examples, tok, length)
    packed = tokenize_dataset(examples, tok, length, packing=True)
    rows = packed.items
    assert all(len(ids) == length for ids, _ in rows[:-1]) and 0 < len(rows[-1][0]) <= length
    assert len(rows) < len(plain.items)
    flat = [t for ids, _ in plain.items for t in ids]
    assert [t for ids, _ in rows for t in ids] == flat
    assert [t for _, lab in rows for t in lab] == [t for _, lab in plain.items for t in lab]
    assert packed.stats["n_train_tokens"] == plain.stats["n_train_tokens"]


def test_collate_pads_right(tok):
    items = tokenize_dataset(load_examples("builtin:reversal_train")[:4], tok, 64).items
    batch = collate(items, pad_id=tok.pad_token_id)
    width = max(len(ids) for ids, _ in items)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, width)
    for row, (ids, labels) in enumerate(items):
        n = len(ids)
        assert batch["input_ids"][row, :n].tolist() == ids and batch["labels"][row, :n].tolist() == labels
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert (batch["input_ids"][row, n:] == tok.pad_token_id).all() and (batch["labels"][row, n:] == -100).all()
    assert len({len(ids) for ids, _ in items}) > 1  # the batch really needed padding


def test_examples_with_nothing_to_train_on_are_not_blamed_on_truncation(tok):
    examples = [normalise({"text": ""}, "x"), normalise({"text": ""}, "y")]
    with pytest.raises(UserError, match=r"^data: no trainable example: none of the 2 examples has a token to train "
                                        r"on \(its response, or its text, is empty\)\. Fix: give each example"):
        tokenize_dataset(examples, tok, 512)


# -- tool use: tools offered, an assistant turn that calls one, the tool's result ------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_USE = normalise({"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "content": "18 C, sunny"},
    {"role": "assistant", "content": "18 C and sunny."}]}, "t.jsonl:1")
# a template that renders tools and calls, as Qwen2.5's and Llama 3.1's do (in the shipped tokenizer's own markup)
TOOL_TEMPLATE = ("{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %}<call>{{ c['function'] | tojson }}</call>{% endfor %}"
                 "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("template,call,tools", [
    (TOOL_TEMPLATE, '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>', "<|system|>\nTools: "),
    (None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "<|tools|>\n"),
])  # None: the shipped tokenizer's own template, which renders them as the fallback does
def test_a_tool_call_is_trained_and_the_tool_s_result_is_not(template, call, tools):
    t = load_tokenizer(None)
    t.chat_template = template or t.chat_template
    ids, labels = _encode(TOOL_USE, t)
    prompt = t.decode([i for i, lab in zip(ids, labels) if lab == IGNORE_INDEX])
    assert t.decode(_trained(ids, labels)) == call + "<|end|>\n18 C and sunny.<|end|>\n"
    assert prompt.startswith(tools + '[{"type": "function"') and "<|tool|>\n18 C, sunny<|end|>" in prompt
    after = render_prompt(TOOL_USE["messages"][:-1], t, TOOL_USE["tools"])  # what eval generates after
    assert t.decode(ids) == after + "18 C and sunny.<|end|>\n"


def test_the_fallback_template_renders_tools_and_calls(fallback_tok):
    ids, labels = _encode(TOOL_USE, fallback_tok)
    eos = fallback_tok.eos_token
    assert fallback_tok.decode(_trained(ids, labels)) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + eos
        + "18 C and sunny." + eos)
    assert fallback_tok.decode(ids).startswith('<|tools|>\n[{"type": "function", "function": {"name": "get_weather"')
    assert "<|tool|>\n18 C, sunny\n<|assistant|>\n" in fallback_tok.decode(ids)


@pytest.mark.parametrize("template,says", [
    ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}", "does not render tool_calls"),
    (TOOL_TEMPLATE.partition("{% endif %}")[2], "does not render the tools offered"),
    ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", "refuses the conversation of t.jsonl:1: no tool role"),
])
def test_a_template_that_would_drop_the_tools_is_refused_naming_the_example(template, says):
    t = load_tokenizer(None)
    t.chat_template = template
    with pytest.raises(UserError, match=f"^tokenizer: its chat_template {says}.*Fix: "):
        render_segments(TOOL_USE, t)
