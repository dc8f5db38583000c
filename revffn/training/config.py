"""Training config: the YAML schema, `key=value` overrides, and validation before anything is built.

Every key has a type, a default and (for numbers) a range. `load_config` reads the file, applies
overrides (dotted keys reach method sections: `revffn.adapter_warmup_steps=20`), and validates it
all at once: one `UserError` lists every problem, each naming `FILE:LINE`, the key, the bad value
and the fix. Nothing is allocated or written before this passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from revffn.errors import UserError, closest
from revffn.schema import SHOWN_CHARS, Key, Record, check_value, coerce, record_type, shown
from revffn.training.trackers import TRACKERS

QUICKSTART = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"


# Names follow LLaMA-Factory / TRL / HF TrainingArguments where one exists.
SCHEMA: dict[str, Key] = {
    "model": Key(str, None, "builtin:base, builtin:smollm2[-moe], a tiny preset (tiny-qwen2-moe, ...), a local HF "
                 "model directory, a GGUF file, or a Hub ID ORG/NAME[@REVISION] (HF cache; downloaded unless "
                 "HF_HUB_OFFLINE=1)", required=True, path=True),
    "model_config": Key(dict, {}, "HF config overrides, e.g. {num_hidden_layers: 4} (presets and local dirs; "
                        "model_config=null clears a file's)"),
    "method": Key(str, "revffn", "fine-tuning method (see the README's Methods table)"),
    "data": Key(str, None, "training data: a JSON/JSONL/parquet/arrow/csv file, a save_to_disk directory, "
                "hf:NAME[:CONFIG][@SPLIT] or builtin:NAME (README: Data formats)", required=True, path=True),
    "eval_data": Key((str, type(None)), None, "evaluation data (same formats); null for none", path=True),
    "output_dir": Key(str, None, "where config, metrics, checkpoints, final/ and the report go", required=True,
                      path=True),
    "overwrite": Key(bool, False, "allow starting a fresh run in an output_dir that holds one"),
    "max_steps": Key(int, None, "optimizer steps to run", min=1, required=True),
    "save_steps": Key(int, 0, "checkpoint every N steps (0: only the final model)", min=0),
    "save_total_limit": Key(int, 2, "checkpoints kept (older ones are deleted)", min=1),
    "eval_steps": Key(int, 0, "evaluate on eval_data every N steps (0: only at the end)", min=0),
    "logging_steps": Key(int, 1, "log metrics every N steps", min=1),
    "report_to": Key(str, "none", "trackers that also get every metrics line, comma-separated: none | tensorboard "
                     "(output_dir/tensorboard) | wandb | mlflow (configured by their WANDB_* / MLFLOW_* variables)",
                     choices=("none", *TRACKERS), multiple=True),
    "seed": Key(int, 0, "seed for init, data order and dropout"),
    "resume": Key((bool, str), False, "false | true (latest checkpoint in output_dir) | a checkpoint path", path=True),
    "max_restarts": Key(int, 0, "restart from the last checkpoint after a crash, a kill or a stall, up to N "
                        "times (each attempt then runs in a child process)", min=0),
    "stall_timeout_s": Key(int, 1800, "seconds without a completed optimizer step (its eval and checkpoint "
                           "included) before the run writes every thread's stack to events.jsonl and exits with "
                           "code 3; max_restarts restarts it (0 disables)", min=0),
    "memory_growth_window": Key(int, 50, "steps over which a steady rise of the memory in use after each step "
                                "warns of a leak (events.jsonl, the report), after as many warm-up steps (0 "
                                "disables)", min=0),
    "memory_growth_tolerance_mib": Key(float, 64.0, "the rise over memory_growth_window steps that warns (MiB)",
                                       min=0, min_exclusive=True),
    "per_device_train_batch_size": Key(int, 4, "examples per micro-batch", min=1),
    "gradient_accumulation_steps": Key(int, 1, "micro-batches per optimizer step", min=1),
    "global_batch_size": Key((int, type(None)), None, "examples per optimizer step over all processes (null: "
                             "per_device_train_batch_size x processes x gradient_accumulation_steps); set, the "
                             "accumulation is derived, so the batch stays the same on any number of GPUs", min=1),
    "learning_rate": Key(float, 1e-4, "peak learning rate", min=0, min_exclusive=True),
    "lr_scheduler_type": Key(str, "cosine", "learning-rate schedule after warmup",
                             choices=("cosine", "constant", "linear")),
    "warmup_steps": Key(int, 0, "linear LR warmup steps", min=0),
    "min_lr_ratio": Key(float, 0.0, "final LR as a fraction of the peak (cosine, linear)", min=0, max=1),
    "weight_decay": Key(float, 0.0, "AdamW decoupled weight decay", min=0),
    "adam_beta1": Key(float, 0.9, "AdamW beta1", min=0, max=1),
    "adam_beta2": Key(float, 0.999, "AdamW beta2", min=0, max=1),
    "adam_epsilon": Key(float, 1e-8, "AdamW epsilon", min=0, min_exclusive=True),
    "max_grad_norm": Key(float, 1.0, "gradient clipping norm (0 disables; per parameter with optimizer_in_backward)",
                         min=0),
    "optimizer": Key(str, "adamw", "adamw | adamw8bit, adamw4bit (torchao) | adafactor (torch)",
                     choices=("adamw", "adamw8bit", "adamw4bit", "adafactor")),
    "optimizer_in_backward": Key(bool, False, "step each parameter as soon as its gradient is complete, and free "
                                 "it: one parameter's gradient held at a time (needs gradient_accumulation_steps 1)"),
    "optimizer_offload": Key(str, "none", "none | cpu: optimizer states and step on the host (CUDA only, torchao)",
                             choices=("none", "cpu")),
    "bf16_stochastic_round": Key(bool, False, "bf16 weights: round each update stochastically (torchao) so small "
                                 "updates are not lost"),
    "max_seq_length": Key(int, 512, "truncate examples to this many tokens", min=2),
    "packing": Key(bool, False, "pack examples into full-length rows"),
    "streaming": Key(bool, False, "read data (hf: or a table source) as a datasets IterableDataset: each "
                     "process reads its own shard and tokenizes as it trains, never the whole set in RAM; a "
                     "resume restarts at the exact example"),
    "dtype": Key(str, "auto", "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16",
                 choices=("auto", "float32", "bfloat16")),
    "device": Key(str, "auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda")),
    "distributed": Key(str, "auto", "auto (ddp when launched by torchrun with WORLD_SIZE > 1) | none | ddp "
                       "(DistributedDataParallel) | fsdp (FSDP2: parameters, gradients, optimizer state sharded)",
                       choices=("auto", "none", "ddp", "fsdp")),
    "distributed_timeout": Key(int, 1800, "seconds a collective waits for the other ranks before the run fails "
                               "(a dead or hung rank)", min=1),
    "router_aux_loss_coef": Key((float, type(None)), None, "router load-balancing loss weight (null: model's)",
                                min=0),
    "tokenizer": Key((str, type(None)), None, "tokenizer directory or Hub ID (null: the model's, or the shipped one)",
                     path=True),
    "eval_max_new_tokens": Key(int, 48, "greedy tokens generated per example for exact-match eval", min=1),
    "eval_generate_limit": Key(int, 64, "eval examples scored by exact match at the end of training (0: none; "
                               "under ddp by rank 0; under fsdp none: `revffn eval final/`)", min=0),
}

RESUME_MAY_CHANGE = frozenset({
    "output_dir", "overwrite", "resume", "max_restarts",  # where the run writes, how it restarts
    "logging_steps", "save_steps", "save_total_limit",  # how often it writes
    "eval_data", "eval_steps", "eval_max_new_tokens", "eval_generate_limit",  # what it measures
    "max_steps",  # how long it runs: extending a run re-shapes the rest of a cosine/linear schedule, on purpose
    "device", "distributed", "distributed_timeout",  # where it runs (the resolved dtype is compared instead)
    "report_to", "stall_timeout_s", "memory_growth_window", "memory_growth_tolerance_mib",  # how it is watched
})
"""The keys a resume may change. Every other key, and the method's options, changes the math of the
steps to come: a resume that changes one is refused (`setup.check_resume_config`). The batch is
compared by the keys that set it: `global_batch_size` when set (the per-device split and the derived
accumulation may then change with the number of processes), else per_device_train_batch_size and
gradient_accumulation_steps; the number of processes itself may change (docs/multi_gpu.md)."""


@dataclass(frozen=True)
class _ConfigRecord(Record):
    """What a `TrainConfig` is beyond its keys: the method sections (each a typed, frozen options record of
    the method's own `SCHEMA`, `Method.Options`) and the file it was read from."""

    @property
    def values(self) -> dict:
        """The top-level keys as a new dict (changing it changes nothing: use `cfg.replace(key=value)`)."""
        return {k: getattr(self, k) for k in SCHEMA}

    def options(self, name: str) -> Record:
        """Method `name`'s options, typed and frozen (an empty record for a method without options)."""
        return self.sections.get(name) or Record()

    def section(self, name: str) -> dict:
        """Method `name`'s options as a new dict."""
        return dict(self.options(name))

    def to_dict(self) -> dict:
        return {**self.values, **{k: dict(v) for k, v in self.sections.items()}}


TrainConfig = record_type("TrainConfig", SCHEMA, _ConfigRecord, extra=[
    ("sections", dict, field(default_factory=dict)), ("source", str, field(default="<defaults>"))], module=__name__)
TrainConfig.__doc__ = """A validated training config, built once by `load_config`: one typed, frozen field per
`SCHEMA` key (`cfg.max_steps`), `sections` {method: its options record}, `source` (the YAML file).
A changed copy is `cfg.replace(key=value)`."""


NOT_READ = object()  # a MATH_KEYS_ADDED function's answer for a run that did not read the key
MATH_KEYS_ADDED = {  # a math key added after checkpoints existed -> the value those checkpoints were trained with
    "revffn.adapter_skip": False,
    "revffn.adapter_warmup_ratio": None,
    "revffn.stream_width": "half",
    "revffn.heal_norms": False,
    "revffn.heal_hidden_coef": 0.0,
    "revffn.coupling": "additive",
    # or a function of the checkpoint's config: the value, or NOT_READ where that run did not read the key
    "revffn.buffer_momentum": lambda saved: "negative" if saved.get("revffn.coupling") == "buffered" else NOT_READ,
}


def math_config(cfg: TrainConfig, weights_dtype) -> dict:
    """The keys a resume may not change (`RESUME_MAY_CHANGE`), the method's options as dotted keys and
    `dtype` as the run resolved it (`auto` is bf16 on CUDA, fp32 on CPU): kept in each checkpoint's
    manifest and compared on resume."""
    out = {k: v for k, v in cfg.values.items() if k not in RESUME_MAY_CHANGE}
    if cfg.global_batch_size is not None:
        del out["per_device_train_batch_size"], out["gradient_accumulation_steps"]
    out["dtype"] = str(weights_dtype).removeprefix("torch.")
    out.update({f"{cfg.method}.{k}": v for k, v in cfg.section(cfg.method).items()})
    return out


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line in the YAML text (for FILE:LINE messages)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                lines[key] = k.start_mark.line + 1
                walk(v, key + ".")

    walk(root, "")
    return lines


def _read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"config file {str(path)!r} not found. Fix: check the path, or run `revffn train` "
                        "with no file for the built-in quickstart.") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UserError(f"config file {str(path)!r}:{line} is not UTF-8 text (byte {e.start}). Fix: give a YAML file "
                        "saved as UTF-8.") from None
    except IsADirectoryError:
        raise UserError(f"config file {str(path)!r} is a directory. Fix: give the path of a YAML file.") from None
    except OSError as e:
        raise UserError(f"config file {str(path)!r} cannot be read ({e.strerror}). Fix: check its permissions.") \
            from None
    try:
        data = bounded_yaml(text, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{where}: YAML syntax error: {problem}. Fix: correct the YAML at that line "
                        "(indentation, a missing ':' or an unclosed quote).") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of key: value, got {type(data).__name__}. Fix: "
                        "write one `key: value` per line (see revffn/recipes/quickstart.yaml).")
    return data, _key_lines(text)


MAX_YAML_VALUES = 100_000  # the nodes a YAML document may hold once its aliases are expanded


def _expanded(node, memo: dict, open_: set) -> int:
    """How many nodes `node` stands for with every alias expanded (linear: each node is counted once)."""
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in open_:  # an anchor inside itself: expands forever
        return MAX_YAML_VALUES + 1
    open_.add(id(node))
    children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                else node.value if isinstance(node, yaml.SequenceNode) else [])
    n = 1
    for child in children:
        n += _expanded(child, memo, open_)
        if n > MAX_YAML_VALUES:
            break
    open_.discard(id(node))
    memo[id(node)] = n
    return n


def _no_repeated_keys(node, where: str, lines: bool, seen_nodes: set | None = None) -> None:
    """A key written twice in one mapping: YAML keeps the last one silently (PyYAML does), so a setting the file
    shows would not be the one run."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if node is None or id(node) in seen_nodes:  # (an alias: checked where it was anchored)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in first:
                    at = f":{k.start_mark.line + 1}" if lines else ""
                    also = f" (first at line {first[k.value]})" if lines else ""
                    raise UserError(f"{where}{at}: key {k.value[:SHOWN_CHARS]!r} is given twice{also}; YAML would keep "
                                    "the last silently. Fix: keep one of them.")
                first[k.value] = k.start_mark.line + 1
            _no_repeated_keys(v, where, lines, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for child in node.value:
            _no_repeated_keys(child, where, lines, seen_nodes)


def bounded_yaml(text: str, where: str):
    """`yaml.safe_load(text)`, refusing a key given twice in one mapping (`_no_repeated_keys`) and a document whose
    aliases expand past MAX_YAML_VALUES values (an alias bomb: a few lines that expand to billions of values once
    anything walks them)."""
    root = yaml.compose(text)
    _no_repeated_keys(root, where, "\n" in text.strip())
    if root is not None and _expanded(root, {}, set()) > MAX_YAML_VALUES:
        at = ""
        if isinstance(root, yaml.MappingNode):  # name the key that holds it
            big = max(root.value, key=lambda kv: _expanded(kv[1], {}, set()))
            line = f":{big[0].start_mark.line + 1}" if "\n" in text.strip() else ""
            at = f"{line}: {str(big[0].value)[:SHOWN_CHARS]}"
        raise UserError(f"{where}{at}: its YAML aliases expand to more than {MAX_YAML_VALUES:,} values (an alias "
                        "bomb?). Nothing was run. Fix: write the value out without anchors (&) and aliases (*).")
    return yaml.safe_load(text)


def parse_overrides(items: list[str], path_keys: frozenset[str] = frozenset()) -> dict:
    """`["a=1", "revffn.freeze_router=false"]` -> nested dict; values parsed as YAML scalars, except those of
    `path_keys` (file and directory keys), taken as the string written (a path may hold ` #` or colons), unless
    it is quoted (a YAML string, unquoted as YAML does) or true/false/null."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"override {shown(item)} is not key=value. Fix: write it as e.g. max_steps=100.")
        key, raw = item.split("=", 1)
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""  # a YAML string: read as YAML
        if key.strip() in path_keys and not quoted and raw.strip().lower() not in ("true", "false", "null", "~", ""):
            value = raw
        else:
            try:
                value = bounded_yaml(raw, f"override {key.strip()}") if raw != "" else ""
            except yaml.YAMLError:
                value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _dotted(d: dict, prefix: str = ""):
    for k, v in d.items():
        yield f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _dotted(v, f"{prefix}{k}.")


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for k, v in over.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def _model_defaults(method: str, data: dict) -> dict:
    """The defaults of `method`'s options that the config's model decides (`Method.model_defaults`: a converted
    directory's structure), for the method the config trains; none where the model reference does not read (its own
    check reports it)."""
    from revffn.methods import METHODS

    if data.get("method") != method:  # (another method's section is never read: no model lookup for it)
        return {}
    try:
        model = coerce(data["model"], SCHEMA["model"]) if "model" in data else SCHEMA["model"].default
        return METHODS[method].model_defaults(model) if isinstance(model, str) else {}
    except Exception:
        return {}


def load_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read, override and validate a training config. `path=None` is the built-in quickstart, whose `eval_data` (its
    own task's test split) goes with its `data`: a `data` override without an `eval_data` one evaluates on nothing,
    rather than scoring another task's exact match at the end of the run.

    Raises:
        UserError: listing every problem at once.
    """
    from revffn.methods import METHODS, method_section_schema

    src = Path(path) if path is not None else QUICKSTART
    data, lines = _read_yaml(src)
    path_keys = frozenset([k for k, key in SCHEMA.items() if key.path] + [
        f"{m}.{k}" for m, keys in method_section_schema().items() for k, key in keys.items() if key.path])
    over = parse_overrides(overrides or [], path_keys)
    if path is None and "data" in over and "eval_data" not in over:
        over["eval_data"] = None  # (the quickstart's test split is its own task's)
    data = _merge(data, over)
    overridden = set(_dotted(over))

    def where(k: str) -> str:
        if k in overridden:
            return "override: "
        return f"{src}:{lines[str(k)]}: " if str(k) in lines else f"{src}: "  # (a YAML key may be a number)

    problems: list[str] = []
    values, sections = {}, {}
    section_schemas = method_section_schema()
    for k, v in data.items():
        if k in SCHEMA:
            continue
        if k in section_schemas:
            if not isinstance(v, dict):
                problems.append(f"{where(k)}{k}: must be a mapping of method options, got {shown(v)}. Fix: e.g. "
                                f"`{k}: {{{next(iter(section_schemas[k]))}: ...}}`, one of its keys "
                                f"{', '.join(section_schemas[k])}.")
                continue
            sec = {}
            for sk, sv in v.items():
                full = f"{k}.{sk}"
                if sk not in section_schemas[k]:
                    near = closest(full, [f"{k}.{name}" for name in section_schemas[k]])  # what to type
                    problems.append(f"{where(full)}unknown key {shown(full)}.{near} "
                                    f"Fix: one of the {k} keys: {', '.join(section_schemas[k])}.")
                    continue
                sv = coerce(sv, section_schemas[k][sk])
                msg = check_value(full, sv, section_schemas[k][sk])
                if msg:
                    problems.append(where(full) + msg)
                sec[sk] = sv
            sections[k] = {sk: key.default for sk, key in section_schemas[k].items()} | _model_defaults(k, data) | sec
        else:
            known = list(SCHEMA) + list(section_schemas)
            problems.append(f"{where(k)}unknown key {shown(k)}.{closest(str(k), known)} Fix: remove it, or use a key "
                            "the README's 'Config keys' lists.")
    for k, key in SCHEMA.items():
        if k not in data:
            if key.required:
                problems.append(f"{src}: missing required key {k!r} ({key.help}). Fix: add `{k}: ...` to the file, "
                                f"or {k}=... on the command line.")
            values[k] = key.default
            continue
        v = coerce(data[k], key)
        msg = check_value(k, v, key)
        if msg:
            problems.append(where(k) + msg)
        values[k] = v
    method = values.get("method")
    if isinstance(method, str) and method not in METHODS:
        problems.append(f"{where('method')}method: unknown method {shown(method)}.{closest(method, METHODS)} "
                        f"Fix: one of {', '.join(METHODS)}.")
    for name, schema in section_schemas.items():
        sections.setdefault(name, {sk: key.default for sk, key in schema.items()} | _model_defaults(name, data))
    if problems:
        head = f"{len(problems)} problem{'s' * (len(problems) > 1)} in the config:\n  - " if len(problems) > 1 else ""
        raise UserError(head + "\n  - ".join(problems))
    sections = {name: METHODS[name].Options(**sec) for name, sec in sections.items()}
    cfg = TrainConfig(**values, sections=sections, source=str(src))
    if isinstance(method, str) and method in METHODS:
        METHODS[method].validate(cfg)
    return cfg
