"""Read a data source into normalised chat examples: a JSON list or JSONL file, `builtin:NAME`, or a
table read through `datasets` (`tables`: hf:NAME[:CONFIG][@SPLIT], a save_to_disk directory, a
parquet, arrow or csv file), whose rows are taken exactly as JSON records.

Accepted example formats, detected per example by its keys:

* alpaca:    {"instruction", "input"?, "output", "system"?}  (user = instruction + "\\n\\n" + input)
* sharegpt:  {"conversations": [{"from": human|user|gpt|assistant|system|function_call|observation, "value"}],
             "system"?, "tools"?}  (LLaMA-Factory's: a function_call turn is the assistant's, an observation the
             tool's, "system" the system prompt)
* messages:  {"messages": [{"role": system|user|assistant|tool, "content"}], "tools"?}; a content may be a list
             of parts, [{"type": "text", "text"}, ...] as in OpenAI's and transformers' chat format, joined into one
             text; an assistant turn may carry "tool_calls" ([{"type": "function", "function": {"name",
             "arguments"}}], its content then optional), a tool turn "name" and "tool_call_id", as TRL takes them
* prompt/completion: {"prompt", "completion"} (strings, or lists of {"role", "content"} messages)
* text:      {"text"}  (plain text, trained on every token)

Every example becomes `{"messages": [...], "text": str | None, "source": "FILE:LINE", "answer": str | None,
"tools": list | None}` (a table row's source is `SOURCE[INDEX]`, its 0-based row index; `tools` are the function
schemas the chat template is given, from a list or a JSON text of one).
`messages` ends with the last assistant turn (turns after it carry no loss and are dropped), so
`messages[:-1]` is the prompt and `answer` (the reference for exact-match eval) is `messages[-1]["content"]`
(None where that turn calls tools: what it should generate is the template's rendering of the calls).
`builtin:NAME` reads `revffn/assets/data/NAME.jsonl`. Every problem raises one `UserError` naming
FILE:LINE (or SOURCE[INDEX]), the field and the fix.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from revffn.data import tables
from revffn.errors import UserError, closest

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "assets" / "data"
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
CHAT_KEYS = {"messages", "conversations", "instruction", "prompt", "completion"}  # a record's format: which it has
FORMAT_KEYS = CHAT_KEYS | {"text"}
FORMATS_HELP = ("accepted formats: alpaca {instruction, input?, output, system?}; sharegpt {conversations: "
                "[{from, value}], system?, tools?}; messages {messages: [{role, content, tool_calls?}], tools?}; "
                "{prompt, completion}; {text}")


def builtin_names() -> list[str]:
    """Names usable as `builtin:NAME`."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))


# old names of built-in sets, kept for one release: name -> its new name (a deprecation line each use)
RENAMED = {f"quickstart_{split}": f"reversal_{split}" for split in ("train", "val", "test")}


def _resolve(path: str, key: str) -> tuple[Path, str]:
    """The file to read and the name to show in messages."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name in RENAMED:
            print(f"revffn: {key}: builtin:{name} is now builtin:{RENAMED[name]} (the word-reversal task); the old "
                  "name goes in the next release.", file=sys.stderr)
            name = RENAMED[name]
        if name not in builtin_names():
            raise UserError(f"{key}: unknown builtin dataset {path!r}.{closest(name, builtin_names())} "
                            f"Fix: one of {', '.join('builtin:' + n for n in builtin_names())}.")
        return BUILTIN_DIR / f"{name}.jsonl", path
    file = Path(path).expanduser()
    if not file.is_file():
        raise tables.missing_file(path, key)
    return file, path


def _records(file: Path, name: str) -> Iterator[tuple[str, object]]:
    """(NAME:LINE, parsed object) for every record: JSONL lines, or the elements of a top-level JSON list.
    A generator, so a JSONL file is parsed a line at a time as the examples are normalised."""
    try:
        text = file.read_text(encoding="utf-8-sig")  # -sig: tolerate a byte-order mark
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UserError(f"{name}:{line}: not UTF-8 text (byte {e.start}). Fix: save the file as UTF-8 JSON/JSONL.") \
            from None
    except OSError as e:
        raise UserError(f"{name}: cannot be read ({e.strerror}). Fix: check the path and its permissions.") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{name}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno}). "
                            "Fix: correct the JSON syntax at that position.") from None
        yield from ((f"{name}:{line}", item) for line, item in zip(_element_lines(text), items))
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{name}:{lineno}: invalid JSON line: {e.msg} (column {e.colno}). Fix: a JSONL file "
                            "holds one complete JSON object per line; a .json file holds one list [...].") from None
        yield f"{name}:{lineno}", record


def _element_lines(text: str) -> list[int]:
    """1-based line where each element of a (valid) top-level JSON list starts."""
    decoder, lines = json.JSONDecoder(), []
    pos = text.index("[") + 1
    while True:
        while text[pos] in " \t\r\n,":  # separators; the text already parsed, so nothing else occurs here
            pos += 1
        if text[pos] == "]":
            return lines
        lines.append(text.count("\n", 0, pos) + 1)
        _, pos = decoder.raw_decode(text, pos)


_SURROGATES = re.compile("[\ud800-\udfff]")


def _str(rec: dict, field: str, where: str, optional: bool = False) -> str:
    value = rec.get(field)
    if value is None:
        if optional:
            return ""
        raise UserError(f"{where}: missing field {field!r}. Fix: add it ({FORMATS_HELP}).")
    if not isinstance(value, str):
        raise UserError(f"{where}: field {field!r} must be a string, got {type(value).__name__} "
                        f"{json.dumps(value)[:60]}. Fix: quote the value or convert it to text.")
    return _SURROGATES.sub("\ufffd", value)  # a lone UTF-16 surrogate (valid JSON "\ud800") is no character


def _message_list(value: object, field: str, where: str, role_key: str, content_key: str,
                  roles: dict[str, str]) -> list[dict]:
    """Validate a list of turn objects and map them to {role, content}."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: field {field!r} must be a non-empty list of {{{role_key}, {content_key}}} objects, "
                        f"got {json.dumps(value)[:60]}. Fix: e.g. [{{\"{role_key}\": \"user\", \"{content_key}\": "
                        "\"...\"}, ...].")
    out = []
    for i, turn in enumerate(value):
        at = f"{where}: {field}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(f"{at} must be an object {{{role_key}, {content_key}}}, got {json.dumps(turn)[:60]}.")
        role = _str(turn, role_key, at)
        if role not in roles:
            raise UserError(f"{at}: unknown {role_key} {role!r}.{closest(role, roles)} "
                            f"Fix: use one of {', '.join(roles)}.")
        message = {"role": roles[role]}
        if role == "function_call":  # LLaMA-Factory's: the value is the call(s), {"name", "arguments"} as JSON text
            calls = _json_text(turn, content_key, at)
            calls = [{"type": "function", "function": c} for c in (calls if isinstance(calls, list) else [calls])]
            out.append({**message, "tool_calls": _tool_calls(calls, f"{at}.{content_key}"), "content": ""})
            continue
        if turn.get("tool_calls") is not None:
            if message["role"] != "assistant":
                raise UserError(f"{at}: tool_calls on a {role!r} turn; only the assistant calls tools. Fix: move "
                                "them to the assistant turn that makes the calls.")
            message["tool_calls"] = _tool_calls(turn["tool_calls"], f"{at}.tool_calls")
        for key in ("name", "tool_call_id"):  # a tool turn's answer to a call, as OpenAI's format names it
            if message["role"] == "tool" and turn.get(key) is not None:
                message[key] = _str(turn, key, at)
        calls = "tool_calls" in message  # (a turn that only calls tools has no content)
        message["content"] = _parts(turn[content_key], f"{at}.{content_key}") \
            if isinstance(turn.get(content_key), list) else _str(turn, content_key, at, optional=calls)
        out.append(message)
    return out


def _json_text(turn: dict, field: str, at: str) -> object:
    text = _str(turn, field, at)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{at}.{field}: a function_call turn's value is the call as JSON, {{\"name\", "
                        f"\"arguments\"}} (or a list of them), and this is not JSON ({e.msg}, column {e.colno}). "
                        "Fix: write the call as JSON, or make the turn a gpt turn.") from None


def _tool_calls(calls: object, at: str) -> list[dict]:
    """An assistant turn's `tool_calls`: [{"type": "function", "function": {"name", "arguments"}}], arguments an
    object or its JSON text (parsed, as chat templates render an object)."""
    fix = ("Fix: [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
           "{\"city\": \"Paris\"}}}].")
    if not isinstance(calls, list) or not calls:
        raise UserError(f"{at}: must be a non-empty list of calls, got {json.dumps(calls)[:60]}. {fix}")
    out = []
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise UserError(f"{where}: a call is an object with a \"function\" object, got {json.dumps(call)[:60]}. "
                            f"{fix}")
        name, arguments = _str(function, "name", f"{where}.function"), function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise UserError(f"{where}.function.arguments: not JSON ({e.msg}, column {e.colno}). Fix: an object, "
                                "or its JSON text.") from None
        if not isinstance(arguments, dict):
            raise UserError(f"{where}.function.arguments: must be an object, got {json.dumps(arguments)[:60]}. {fix}")
        out.append({"type": "function", "function": {"name": name, "arguments": arguments},
                    **({"id": call["id"]} if isinstance(call.get("id"), str) else {})})
    return out


def _tools(value: object, where: str) -> list[dict] | None:
    """A record's `tools`: the function schemas offered, a list of objects or its JSON text (as LLaMA-Factory and
    many Hub datasets store it); None when absent or empty."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: field 'tools' is not JSON ({e.msg}, column {e.colno}). Fix: a list of "
                            "function schemas, or its JSON text.") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise UserError(f"{where}: field 'tools' must be a list of function schemas (objects), got "
                        f"{json.dumps(value)[:60]}. Fix: e.g. [{{\"type\": \"function\", \"function\": {{\"name\": "
                        "\"get_weather\", \"parameters\": {...}}}].")
    return value or None


def _parts(parts: list, at: str) -> str:
    """A content given as a list of parts (`[{"type": "text", "text": ...}]`; `at` names the field): the texts joined
    as they stand (a text model has nothing to do with an image or audio part: refused, naming it)."""
    texts = []
    for j, part in enumerate(parts):
        where = f"{at}[{j}]"
        if not isinstance(part, dict) or part.get("type", "text") != "text":
            kind = f"a part of type {part.get('type')!r}" if isinstance(part, dict) else \
                f"a {type(part).__name__} ({json.dumps(part)[:40]}) where a part object belongs"
            raise UserError(f"{where}: {kind}; the content parts a text model reads are "
                            "{\"type\": \"text\", \"text\": ...}. Fix: drop the other parts, or give the content "
                            "as a string.")
        texts.append(_str(part, "text", where))
    if not texts:
        raise UserError(f"{at}: an empty list of content parts. Fix: give the content as a string, or "
                        "[{\"type\": \"text\", \"text\": ...}].")
    return "".join(texts)


def _messages(rec: dict, where: str) -> list[dict]:
    """The conversation of a chat-format record (alpaca, sharegpt, messages, prompt/completion)."""
    identity = {r: r for r in ROLES}
    if "messages" in rec:
        return _message_list(rec["messages"], "messages", where, "role", "content", identity)
    if "conversations" in rec:
        turns = _message_list(rec["conversations"], "conversations", where, "from", "value", SHAREGPT_ROLES)
        system = _str(rec, "system", where, optional=True)  # LLaMA-Factory's system column
        if system and turns[0]["role"] == "system":
            raise UserError(f"{where}: a system prompt twice, in field 'system' and as conversations[0]. Fix: keep "
                            "one of them.")
        return ([{"role": "system", "content": system}] if system else []) + turns
    if "instruction" in rec:
        system, instruction = _str(rec, "system", where, optional=True), _str(rec, "instruction", where)
        user_input, output = _str(rec, "input", where, optional=True), _str(rec, "output", where)
        msgs = [{"role": "system", "content": system}] if system else []
        user = instruction + "\n\n" + user_input if user_input else instruction
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    if "prompt" in rec or "completion" in rec:
        turns = []
        for field, role in (("prompt", "user"), ("completion", "assistant")):
            if isinstance(rec.get(field), list):  # conversational prompt/completion (as in TRL)
                turns += _message_list(rec[field], field, where, "role", "content", identity)
            else:
                turns.append({"role": role, "content": _str(rec, field, where)})
        return turns
    raise UserError(f"{where}: cannot tell the format of an example with keys {sorted(rec)}. Fix: use one of the "
                    f"{FORMATS_HELP}.")


def normalise(rec: object, where: str) -> dict:
    """One raw record -> the normalised example (see module docstring); `where` is FILE:LINE."""
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__} {json.dumps(rec)[:60]}. "
                        f"Fix: make each example an object ({FORMATS_HELP}).")
    if "text" in rec and not CHAT_KEYS & rec.keys():
        return {"messages": [], "text": _str(rec, "text", where), "source": where, "answer": None, "tools": None}
    msgs = _messages(rec, where)
    assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant_at:
        raise UserError(f"{where}: the conversation has no assistant turn, so there is nothing to train on. "
                        "Fix: add an assistant (or 'gpt') message with the expected response.")
    first = next(m for m in msgs if m["role"] != "system")
    if first["role"] == "assistant":
        raise UserError(f"{where}: the conversation starts with an assistant turn. "
                        "Fix: put a user message before the first assistant message.")
    msgs = msgs[: assistant_at[-1] + 1]  # later turns carry no loss; now messages[:-1] is the prompt
    answer = None if "tool_calls" in msgs[-1] else msgs[-1]["content"]
    return {"messages": msgs, "text": None, "source": where, "answer": answer, "tools": _tools(rec.get("tools"), where)}


def _table_records(path: str, key: str) -> Iterator[tuple[str, dict]]:
    """(SOURCE[INDEX], row) of a table source, once its columns are known to name a format."""
    table = tables.load_table(path, key)
    if not FORMAT_KEYS & set(table.column_names):
        raise UserError(f"{key}: {path!r} has columns {table.column_names}, none of which any format reads. Fix: "
                        f"rename its columns (Dataset.rename_column) to fit one of the {FORMATS_HELP}.")
    return ((f"{path}[{i}]", row) for i, row in enumerate(tables.rows(table)))


def load_examples(path: str, key: str = "data") -> list[dict]:
    """All examples of a data source (see the module docstring), normalised; UserError on any bad record."""
    if tables.is_table(path):
        records = _table_records(path, key)
    else:
        records = _records(*_resolve(path, key))
    try:
        examples = [normalise(rec, where) for where, rec in records]
    except UserError as e:  # name the config key too, so the user knows which setting reads this file
        raise UserError(f"{key}: {e}") from None
    if not examples:
        raise UserError(f"{key}: {path!r} holds no examples. Fix: add at least one example ({FORMATS_HELP}).")
    return examples
