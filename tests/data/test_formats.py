"""Dataset file parsing: every accepted format, JSON vs JSONL, builtin:, and the error messages."""

import json

import pytest

from revffn.data.formats import load_examples
from revffn.errors import UserError

FORMATS = {
    "alpaca": ({"instruction": "Add.", "input": "2 3", "output": "5", "system": "Be brief."},
               [("system", "Be brief."), ("user", "Add.\n\n2 3"), ("assistant", "5")]),
    "alpaca_no_input": ({"instruction": "Say hi.", "input": "", "output": "hi"},
                        [("user", "Say hi."), ("assistant", "hi")]),
    "sharegpt": ({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q1"},
                                    {"from": "gpt", "value": "a1"}, {"from": "user", "value": "q2"},
                                    {"from": "assistant", "value": "a2"}]},
                 [("system", "S"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]),
    "sharegpt_system_column": ({"system": "S", "conversations": [{"from": "human", "value": "q"},
                                                                 {"from": "gpt", "value": "a"}]},
                               [("system", "S"), ("user", "q"), ("assistant", "a")]),  # LLaMA-Factory's column
    "messages": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                 [("user", "q"), ("assistant", "a")]),
    "prompt_completion": ({"prompt": "q", "completion": "a"}, [("user", "q"), ("assistant", "a")]),
    # content as a list of parts (OpenAI's and transformers' chat format): the texts joined as they stand
    "content_parts": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q "},
                                                                {"type": "text", "text": "two"}]},
                                    {"role": "assistant", "content": [{"text": "a"}]}]},
                      [("user", "q two"), ("assistant", "a")]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_normalises(name, write_jsonl):
    record, expected = FORMATS[name]
    (ex,) = load_examples(write_jsonl([record]))
    assert [(m["role"], m["content"]) for m in ex["messages"]] == expected
    assert ex["text"] is None
    assert ex["answer"] == expected[-1][1]
    assert ex["source"].endswith("train.jsonl:1")


def test_turns_after_the_last_answer_are_dropped(write_jsonl):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "?"}]
    (ex,) = load_examples(write_jsonl([{"messages": msgs}]))
    assert ex["messages"] == msgs[:2] and ex["answer"] == "a"


def test_plain_text(write_jsonl):
    (ex,) = load_examples(write_jsonl([{"text": "just prose"}]))
    assert ex == {"messages": [], "text": "just prose", "source": ex["source"], "answer": None, "tools": None}


def test_jsonl_skips_blank_lines_and_counts_lines(write_jsonl):
    path = write_jsonl([{"text": "a"}, "", "   ", {"prompt": "q", "completion": "a"}])
    examples = load_examples(path)
    assert [e["source"].rsplit(":", 1)[1] for e in examples] == ["1", "4"]


def test_json_list_gives_start_lines(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "a"}, {"prompt": "q", "completion": "c"}], indent=2))
    examples = load_examples(str(path))
    assert [e["source"] for e in examples] == [f"{path}:2", f"{path}:5"]
    assert examples[1]["answer"] == "c"


def test_builtin():
    examples = load_examples("builtin:reversal_train")
    assert len(examples) == 600 and examples[0]["source"] == "builtin:reversal_train:1"
    with pytest.raises(UserError, match="reversal_train"):
        load_examples("builtin:quickstart_trian")


def _error(path, key="data") -> str:
    with pytest.raises(UserError) as info:
        load_examples(path, key=key)
    return str(info.value)


def test_missing_file_names_key_and_path(tmp_path):
    msg = _error(str(tmp_path / "nope.jsonl"), key="eval_data")
    assert msg.startswith("eval_data: file") and "nope.jsonl" in msg and "Fix" in msg


GOOD = {"instruction": "i", "output": "o"}
BAD_RECORDS = {
    "malformed": ('{"instruction": "i", "output": }', ["invalid JSON"]),
    "missing_output": ({"instruction": "i", "input": "x"}, ["'output'"]),
    "missing_completion": ({"prompt": "q"}, ["'completion'"]),
    "unknown_format": ({"question": "q", "answer": "a"}, ["question", "accepted formats"]),
    "wrong_type": ({"instruction": "i", "output": 5}, ["'output'", "string", "int"]),
    "bad_role": ({"messages": [{"role": "usr", "content": "q"}, {"role": "assistant", "content": "a"}]},
                 ["messages[0]", "'usr'", "'user'"]),
    "bad_from": ({"conversations": [{"from": "bot", "value": "x"}]}, ["conversations[0]", "'bot'"]),
    "no_assistant": ({"messages": [{"role": "user", "content": "q"}]}, ["no assistant turn"]),
    "assistant_first": ({"messages": [{"role": "assistant", "content": "a"}]}, ["starts with an assistant"]),
    "not_object": ('["a", "b"]', ["expected a JSON object"]),
    "text_not_str": ({"text": ["a"]}, ["'text'", "list"]),
    "image_part": ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                                 {"role": "assistant", "content": "a"}]},
                   ["messages[0].content[0]: a part of type 'image'", "Fix: drop the other parts"]),
    "part_not_object": ({"messages": [{"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]},
                        ["messages[0].content[0]: a str (\"q\") where a part object belongs"]),
    "sharegpt_image_part": ({"conversations": [{"from": "human", "value": [{"type": "image"}]},
                                               {"from": "gpt", "value": "a"}]},
                           ["conversations[0].value[0]: a part of type 'image'"]),
    "no_parts": ({"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "a"}]},
                 ["messages[0].content: an empty list of content parts. Fix:"]),
    "sharegpt_two_systems": ({"system": "S", "conversations": [{"from": "system", "value": "T"},
                                                               {"from": "human", "value": "q"},
                                                               {"from": "gpt", "value": "a"}]},
                             ["a system prompt twice", "Fix: keep one"]),
    "user_calls": ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]},
                                 {"role": "assistant", "content": "a"}]},
                   ["messages[0]: tool_calls on a 'user' turn", "Fix: move them"]),
    "call_no_function": ({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
                         ["messages[1].tool_calls[0]: a call is an object with a \"function\" object", "Fix: "]),
    "call_arguments_not_json": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
        ["messages[1].tool_calls[0].function.arguments: not JSON", "Fix: an object, or its JSON text"]),
    "tools_not_a_list": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                          "tools": '{"name": "f"}'}, ["field 'tools' must be a list of function schemas"]),
    "function_call_not_json": ({"conversations": [{"from": "human", "value": "q"},
                                                  {"from": "function_call", "value": "get_weather(Paris)"}]},
                               ["conversations[1].value: a function_call turn's value is the call as JSON"]),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_bad_record_names_file_line_and_field(case, write_jsonl):
    record, needles = BAD_RECORDS[case]
    msg = _error(write_jsonl([GOOD, GOOD, record], name="bad.jsonl"))
    assert "bad.jsonl:3" in msg and msg.startswith("data: ")
    for needle in needles:
        assert needle in msg


def test_bad_json_list_element_and_syntax(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([GOOD, {"instruction": "x"}], indent=2))
    msg = _error(str(path))
    assert "bad.json:6" in msg and "'output'" in msg
    path.write_text('[\n  {"text": "a"},\n  {"text": }\n]')
    msg = _error(str(path))
    assert "bad.json:3" in msg and "invalid JSON" in msg


def test_empty_dataset(write_jsonl, tmp_path):
    assert "no examples" in _error(write_jsonl(["", ""], name="empty.jsonl"))
    (tmp_path / "empty.json").write_text("[]")
    assert "empty.json" in _error(str(tmp_path / "empty.json"))


def test_the_old_names_of_the_reversal_sets_still_read_with_a_deprecation_line(capsys):
    from revffn.data.formats import load_examples

    old, new = load_examples("builtin:quickstart_test", "data"), load_examples("builtin:reversal_test", "data")
    assert [e["messages"] for e in old] == [e["messages"] for e in new] and len(new) == 64
    err = capsys.readouterr().err
    assert "builtin:quickstart_test is now builtin:reversal_test" in err and err.count("\n") == 1


def test_tool_use_normalises_as_trl_and_llama_factory_give_it(write_jsonl):
    """OpenAI's messages (tools and arguments as objects or as JSON text, as Hub tables store them) and
    LLaMA-Factory's sharegpt (function_call, observation) give the same conversation."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    openai = {"tools": json.dumps(tools), "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {**call, "arguments": json.dumps(call["arguments"])}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "assistant", "content": "18 C."}]}
    sharegpt = {"tools": tools, "conversations": [
        {"from": "human", "value": "Weather?"}, {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": "18 C"}, {"from": "gpt", "value": "18 C."}]}
    calling = {"messages": openai["messages"][:2]}  # the conversation ends with the call
    (a, b, c) = load_examples(write_jsonl([openai, sharegpt, calling]))
    assert a["tools"] == b["tools"] == tools and c["tools"] is None
    assert a["messages"][1]["tool_calls"] == [{"type": "function", "function": call, "id": "c1"}]
    assert b["messages"][1] == {"role": "assistant", "tool_calls": [{"type": "function", "function": call}],
                                "content": ""}
    assert a["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "18 C"}
    assert b["messages"][2] == {"role": "tool", "content": "18 C"} and a["answer"] == b["answer"] == "18 C."
    assert c["answer"] is None  # a turn that calls is not scored by exact match: its text is the template's
    bare = {"messages": [{"role": "user", "content": "Now?"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "now", "arguments": None}}]}]}  # (a table's null: no arguments)
    assert load_examples(write_jsonl([bare]))[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {}
