"""The `revffn` command line: one subcommand per job.

    revffn doctor [--device cuda] [--json]          is this machine ready? (the first thing to run on one)
    revffn train [CONFIG.yaml] [key=value ...]      fine-tune (no CONFIG: the built-in quickstart)
    revffn validate CONFIG.yaml [key=value ...]     check config and data without training
    revffn generate MODEL_DIR --prompt TEXT         greedy generation
    revffn eval MODEL_DIR --data FILE [--json]      loss, perplexity, exact match
    revffn check --model tiny-qwen2-moe --layers 4  reversible vs plain gradients
    revffn bench --model tiny-qwen2-moe --methods full,ckpt,revffn --out DIR   memory and speed per method
    revffn estimate --model qwen1.5-moe-a2.7b --method revffn --gpu-mem 80GB   analytic memory estimate per GPU
    revffn archs [--json] [--out docs/architectures.md]  every HF architecture, MoE and dense: exact, refused or failing
    revffn convert builtin:base --out DIR --heal-steps 400   convert once: calibrated, healed; train from DIR
    revffn upcycle builtin:smollm2 --experts 4 --top-k 2 --out DIR   a dense model to an exactly equal MoE

Exit codes: 0 ok, 1 failed (check over tolerance, training diverged or crashed, doctor found a problem),
2 bad input, 3 training stalled (no step in stall_timeout_s; every thread's stack is in events.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from revffn.data import DEFAULT_CALIBRATION
from revffn.errors import DiskFull, UserError, closest, disk_fault, one_line, unread
from revffn.models.cache import file_in_the_way
from revffn.progress import library_bars_off, quiet_known_noise
from revffn.reversible.buffered import CUBLAS_WORKSPACE


class _Parser(argparse.ArgumentParser):
    """argparse with revffn's errors: one line naming the flag and the fix, exit 2 (not the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. Fix: `{self.prog} --help` lists the flags and their values.\n")


def _int(s: str, says: str, low: int) -> int:
    """An integer of at least `low`; `says` what it must be."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {says}, got {s!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be {says}, got {s}")
    return v


def _positive(s: str) -> int:
    return _int(s, "a positive integer", 1)


def _sequence_length(s: str) -> int:
    """A max_seq_length: at least 2 tokens (one to predict from, one to predict)."""
    return _int(s, "at least 2 tokens (e.g. 512)", 2)


def _nonnegative(s: str) -> int:
    return _int(s, "0 or more", 0)


def _bounded_float(s: str, low: float, inclusive: bool, says: str) -> float:
    """A finite float above `low` (or equal, `inclusive`); NaN and inf refused."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {says}, got {s}") from None
    if not (low <= v if inclusive else low < v) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be {says}, got {s}")
    return v


def _positive_float(s: str) -> float:
    """A number > 0 (seconds, ...)."""
    return _bounded_float(s, 0.0, False, "a positive number")


def _nonnegative_float(s: str) -> float:
    return _bounded_float(s, 0.0, True, "a number >= 0")


def _heal_lr(s: str) -> float | None:
    """`auto` (None: measured, `training.export.probe_heal_lr`) or a positive learning rate."""
    if s == "auto":
        return None
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a positive number, got {s}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be auto or a positive number, got {s}")
    return v


def cmd_check(args) -> int:
    import torch

    from revffn.conversion.convert import AUTO, STREAM_DTYPES
    from revffn.memory.measure import refuse_beyond_free
    from revffn.models.loading import is_converted, model_kind, parse_dtype
    from revffn.models.model_config import check_width
    from revffn.reports.check import check_bytes, format_report, run_check

    model_kind(args.model, "--model")  # a tiny preset, a config-only preset (random init) or a directory
    dtype = parse_dtype(args.dtype, "--dtype")
    if is_converted(args.model, "--model"):
        raise UserError(f"--model: {args.model!r} is converted to RevFFN already; check converts a base model and "
                        "compares the two. Fix: give the base model it was converted from.")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available. Fix: --device cpu or auto.")
    additive = {"--stream-dtype": ("stream_dtype", "auto"), "--adapter-init": ("adapter_init", "coordinate"),
                "--stream-width": ("stream_width", "full")}
    table, needs = (additive, "--coupling additive") if args.coupling == "buffered" else \
        ({"--buffer-momentum": ("buffer_momentum", "positive")}, "--coupling buffered")
    for flag, (name, default) in table.items():
        if getattr(args, name) != default:
            default = " (the default)" if args.coupling == "buffered" else ""
            raise UserError(unread(flag, needs, f"this check has --coupling {args.coupling}{default}",
                                   f"drop {flag}, or give {needs}"))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())  # as run_check picks
    check_width(args.model, args.layers, args.hidden, compute=dtype, device="cuda" if cuda else "cpu")
    if need := check_bytes(args.model, args.layers, args.hidden, args.dtype, args.batch, args.seq):
        models, steps = need
        refuse_beyond_free(models + steps, torch.device("cuda" if cuda else "cpu"),
                           f"--model {args.model} at --batch {args.batch} --seq {args.seq}: the check (the model and "
                           f"its converted copy, {models / 2**30:.1f} GiB, and one step's activations, "
                           f"{steps / 2**30:.1f} GiB)",
                           "fewer --layers or a smaller --hidden" if models > steps else "a smaller --seq or --batch")
    report = run_check(args.model, args.layers, args.dtype, args.batch, args.seq, args.seed, args.adapter_init,
                       stream_dtype=STREAM_DTYPES.get(args.stream_dtype, AUTO), device=args.device, hidden=args.hidden,
                       stream_width=args.stream_width, coupling=args.coupling, buffer_momentum=args.buffer_momentum)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def cmd_doctor(args) -> int:
    from revffn.reports.doctor import format_doctor, run_doctor

    report = run_doctor(args.device, args.output_dir, args.probe_mib)
    print(json.dumps(report) if args.json else format_doctor(report))
    return 0 if report["healthy"] else 1


def cmd_bench(args) -> int:
    from revffn.reports.bench import BenchSpec, parse_sweep, resolve, run_bench, run_sweep
    from revffn.reports.render.bench import render_dir, write_bench, write_sweep

    if args.render:
        written = render_dir(args.render)
        if not written:
            raise UserError(f"--render {args.render}: no bench.json or sweep.json there. Fix: give a bench --out DIR.")
        print(f"revffn bench: rendered {', '.join(written)} in {args.render}")
        return 0
    if not args.out:
        raise UserError("--out DIR is required (where bench.json, bench.md and bench.png go).")
    check_out_dir(args.out, "bench.json, bench.md and bench.png")
    from revffn.methods import METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(METHODS)
    spec = resolve(BenchSpec(args.model, methods, args.layers, args.hidden, args.batch, args.seq, args.steps,
                             args.dtype, args.device, args.seed, args.threads, list(args.set), args.timeout,
                             args.nproc, args.distributed, [p.strip() for p in args.peers.split(",") if p.strip()],
                             args.repeat))
    if args.sweep:
        if spec.nproc > 1:
            raise UserError(f"--sweep with --nproc {spec.nproc}: a sweep runs in one process per point. Fix: "
                            "--nproc 1, or one bench per value without --sweep.")
        from revffn.models.loading import DTYPES
        from revffn.models.model_config import check_width

        var, values = parse_sweep(args.sweep)
        for value in values if var == "hidden" else ():
            check_width(spec.model, spec.layers, value, "--sweep hidden=", DTYPES[spec.dtype], spec.device)
        data = run_sweep(spec, var, values, args.argv)
        names = ", ".join(write_sweep(data, args.out))
    else:
        data = run_bench(spec, args.argv)
        names = ", ".join(write_bench(data, args.out))
    failed = [f"{r.get('value', '')} {r['method']}".strip() for r in data["results"] if r["status"] != "ok"]
    print(f"revffn bench: wrote {names} to {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def check_out_dir(out: str, holds: str) -> None:
    """`--out` can be a directory: neither it nor a directory above it is a file (checked before any work)."""
    if (blocker := file_in_the_way(Path(out))) is not None:
        what = "is a file" if blocker == Path(out) else f"cannot be a directory: {blocker} is a file"
        raise UserError(f"--out {out}: {what}. Fix: a directory for {holds}.")


def check_out_file(path: str, flag: str) -> None:
    """A file to write can be written: it is not a directory, and no directory above it is a file (checked before
    any work)."""
    if Path(path).is_dir():
        raise UserError(f"{flag} {path}: is a directory. Fix: a file path, e.g. {Path(path) / 'out.md'}.")
    if (blocker := file_in_the_way(Path(path).parent)) is not None:
        raise UserError(f"{flag} {path}: {blocker} is a file, not a directory. Fix: another path.")


def cmd_study(args) -> int:
    from revffn.reports.render.study import write_study
    from revffn.reports.study import plan_for, run_study

    out = Path(args.out)
    docs = Path(args.docs) if args.docs else None
    if docs is not None:
        check_out_file(args.docs, "--docs")
    if args.render:
        if not (out / "study.json").is_file():
            raise UserError(f"--out {args.out}: no study.json there to render. Fix: give the --out DIR of a study.")
        try:
            data = json.loads((out / "study.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:  # cut short, or not JSON
            raise UserError(f"--out {args.out}: study.json is not JSON ({e}). Fix: give the --out DIR of a study that "
                            "finished, or run the study again.") from None
        missing = [k for k in ("plan", "runs", "summary", "chosen_lr") if not isinstance(data, dict) or k not in data]
        if missing:
            raise UserError(f"--out {args.out}: study.json is not a study revffn wrote (no {', '.join(missing)}). Fix: "
                            "give the --out DIR of a study that finished, or run the study again.")
        written = write_study(data, out, docs)
    else:
        check_out_dir(args.out, "the study's runs, study.json and its page")
        if (out / "study.json").exists():
            raise UserError(f"--out {args.out}: holds a study already (study.json). Fix: choose a new directory, or "
                            "delete it first.")
        if args.methods is not None and not args.methods.strip():
            raise UserError("--methods: empty, which would run every method. Fix: a comma-separated list, e.g. "
                            "--methods full,revffn, or drop --methods for every method.")
        methods = tuple(args.methods.split(",")) if args.methods else None
        if args.base:  # here, where a Hub ID may still download: the study's processes run offline
            from revffn.models.loading import check_model_ref, model_kind, resolve_model_ref

            check_model_ref(args.base, "--base")
            if model_kind(args.base) in ("tiny", "config"):  # each of its runs failed, then the page did
                raise UserError(f"--base {args.base}: a preset built with random weights; a study measures what "
                                "fine-tuning keeps of a pretrained model. Fix: leave --base out (builtin:base), or "
                                "builtin:smollm2, builtin:smollm2-moe or a pretrained model's directory or Hub ID.")
            resolve_model_ref(args.base, "--base")
        seeds = tuple(range(args.seeds)) if args.seeds else None
        plan = plan_for(args.quick, args.base, heal_steps=args.heal_steps or 0, methods=methods, jobs=args.jobs,
                        threads=args.threads, steps=args.steps, seeds=seeds, sets=args.set, lr_grids=args.lr_grid)
        data = run_study(plan, out, args.argv)
        written = write_study(data, out, docs)
        failed = [r["name"] for r in data["runs"] if r["status"] != "ok"]
        if failed:
            print(f"revffn study: failed runs: {', '.join(failed)}", file=sys.stderr)
            print(f"revffn study: wrote {', '.join(written)} in {out}")
            return 1
    print(f"revffn study: wrote {', '.join(written)} in {out}")
    return 0


def cmd_archs(args) -> int:
    from revffn.models.tiny_any import model_families
    from revffn.reports.archs import run_archs
    from revffn.reports.render.archs import render_markdown, summary

    known = model_families()
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else None
    unknown = [t for t in types or [] if t not in known]
    if unknown:
        near = "".join(closest(t, known) for t in unknown)
        raise UserError(f"--types: {', '.join(unknown)} not among the {len(known)} causal-LM model types of this "
                        f"transformers (MoE or dense).{near} Fix: a model_type (config.json's), e.g. "
                        f"{', '.join(sorted(known)[:4])}, ... (`revffn archs` without --types checks them all)")

    for flag, path in (("--out", args.out), ("--json-out", args.json_out)):
        if path:
            check_out_file(path, flag)
    if args.out and args.json_out and Path(args.out).resolve() == Path(args.json_out).resolve():
        raise UserError(f"--out and --json-out name the same file ({args.out!r}): the page would overwrite the JSON. "
                        "Fix: two file names, e.g. --out archs.md --json-out archs.json.")

    from revffn.progress import progress

    with progress("archs", "model", every=0, bar=False, disable=args.json) as bar:
        data = run_archs(types, timeout=args.timeout, argv=args.argv,
                         progress=lambda i, n, row: bar(i, n, f"{row['family']:<5} {row['model_type']:<24} "
                                                              f"{row['status']}"))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=1) + "\n")
    text = render_markdown(data)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps(data) if args.json else text if not args.out else summary(data))
    failed = [r for r in data["results"] if r["status"] in ("wrong", "unfaithful", "crash", "build-error")]
    return 1 if failed else 0


def cmd_estimate(args) -> int:
    from revffn.memory.estimate import configurations, estimate, format_estimate, gpus_needed, parse_size
    from revffn.methods import method_class
    from revffn.models.loading import config_overrides, hf_config, model_kind, parse_dtype
    from revffn.models.model_config import check_width
    from revffn.training.config import parse_overrides

    if args.gpu_mem is not None:
        parse_size(args.gpu_mem)
    method = method_class(args.method, key="--method")
    model_kind(args.model, "--model")
    try:
        options = parse_overrides(args.option)
    except UserError as e:  # (its example is a training key's)
        raise UserError(f"--option: {e}".replace("e.g. max_steps=100", "e.g. --option optimizer=adamw8bit")) from None
    check_width(args.model, args.layers, args.hidden, compute=parse_dtype(args.dtype, "--dtype"), device="cuda")
    config = hf_config(args.model, **config_overrides(args.model, args.layers, args.hidden))
    parallel = {"world_size": args.world_size, "distributed": args.distributed}
    est = estimate(config, method, args.batch, args.seq, args.dtype, **parallel, **options)
    if args.gpu_mem is not None:
        est["configurations"] = configurations(config, method, args.batch, args.seq, args.dtype, args.gpu_mem,
                                               **parallel, **{k: v for k, v in options.items()
                                                              if k not in ("optimizer", "optimizer_in_backward",
                                                                           "offload")})
        if args.distributed == "fsdp":
            est["gpus_needed"] = gpus_needed(config, method, args.batch, args.seq, args.dtype, args.gpu_mem,
                                             **options)
    if args.json:
        if args.gpu_mem is not None:
            est["gpu_mem"], est["fits"] = args.gpu_mem, est["total"] <= parse_size(args.gpu_mem)
        print(json.dumps(est))
    else:
        print(format_estimate(est, args.gpu_mem))
    return 0


def written_manifest(out) -> str:
    """The revffn.json `out` holds as written (with the `files` `staged_dir` lists), on one line."""
    return json.dumps(json.loads((Path(out) / "revffn.json").read_text()))


def cmd_convert(args) -> int:
    from revffn.training.export import HEAL_TARGET, ConvertSpec, run_convert

    spec = ConvertSpec(args.model, args.out, args.calibration_data, args.calibration_tokens,
                       heal_steps=args.heal_steps, heal_data=args.heal_data, heal_batch_size=args.heal_batch_size,
                       heal_lr=args.heal_lr, heal_warmup_steps=args.heal_warmup_steps, heal_norms=args.heal_norms,
                       heal_hidden_coef=args.heal_hidden_coef, adapter_skip=not args.no_adapter_skip,
                       eval_data=args.eval_data, heal_eval_steps=args.heal_eval_steps, stream_dtype=args.stream_dtype,
                       seed=args.seed, overwrite=args.overwrite, stream_width=args.stream_width, device=args.device,
                       coupling=args.coupling, buffer_momentum=args.buffer_momentum,
                       **({"buffer_bits": args.buffer_bits} if args.buffer_bits else {}))
    manifest = run_convert(spec)
    gap = manifest["conversion_gap"]
    figures = ", ".join(f"{k} {v:.4f}" for k, v in gap.items() if k != "data")
    heal = manifest["heal"] or {}
    reached, target = "", f"base + {HEAL_TARGET}"
    if "tokens_to_target" in heal:
        n = heal["tokens_to_target"]
        reached = f"; {target} reached after {n:,} heal tokens" if n is not None else \
            f"; {target} not reached in {heal['tokens']:,} heal tokens"
    print(written_manifest(args.out) if args.json else f"revffn convert: wrote {args.out}"
          + (f" (loss on {gap['data']}: {figures}{reached})" if gap.get("data") else ""))
    return 0


def cmd_upcycle(args) -> int:
    import torch
    from transformers import AutoConfig

    from revffn.conversion.upcycle import check_upcycle, upcycle_bytes, upcycle_into
    from revffn.memory.measure import refuse_beyond_free
    from revffn.models.cache import check_replaceable, staged_dir
    from revffn.models.loading import check_model_ref, resolve_model_ref

    check_model_ref(args.model, "MODEL")
    out = Path(args.out)
    check_replaceable(out, args.overwrite, source=args.model)
    src = Path(resolve_model_ref(args.model, "MODEL"))
    if not src.is_dir():  # a tiny or config preset: built in memory, random weights, no files to upcycle
        raise UserError(f"MODEL: {args.model!r} names no model directory (a tiny or config preset is built in "
                        "memory with random weights; upcycle reads a pretrained model's files). Nothing was written. "
                        "Fix: a model directory, a Hub ID, a GGUF file or builtin:smollm2.")
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    check_upcycle(config, args.experts, args.top_k, args.arch, key="MODEL")
    refuse_beyond_free(upcycle_bytes(config, args.experts, args.top_k, args.arch), torch.device("cpu"),
                       f"--experts {args.experts}: upcycling MODEL (the dense model and the MoE, fp32)",
                       "fewer --experts, or a machine with more memory")
    with staged_dir(out) as tmp:
        manifest = upcycle_into(args.model, src, tmp, args.experts, args.top_k, args.arch, args.seed, key="MODEL",
                                config=config)
    print(written_manifest(out) if args.json else
          f"revffn upcycle: wrote {args.out} ({manifest['arch']}, {manifest['experts']} experts, top-"
          f"{manifest['top_k']}, {manifest['parameters'] / 1e6:.1f} M parameters; max |Δlogit| against the dense "
          f"model {manifest['max_abs_dlogit']:.2e}, fp32)")
    return 0


def cmd_train(args) -> int:
    from revffn.training.config import load_config
    from revffn.training.loop import TrainingDiverged, run
    from revffn.training.watch import STALL_EXIT, Stalled

    cfg = load_config(args.config, args.overrides)
    try:
        summary = run(cfg)
    except TrainingDiverged as e:
        print(f"revffn train: diverged: {e}", file=sys.stderr)
        return 1
    except Stalled as e:  # the last attempt under max_restarts; without it the watchdog exits 3 itself
        print(f"revffn train: stalled: {e}", file=sys.stderr)
        return STALL_EXIT
    if summary.get("main", True):  # under torchrun, rank 0 alone says it
        scored = (f"; eval exact match {100 * summary['eval_exact_match']:.1f} % of {summary['eval_scored']}"
                  if summary.get("eval_exact_match") is not None else "")
        print(f"revffn train: done. {summary['steps']} steps{scored}; final model in {summary['final_dir']}; "
              f"report in {cfg.output_dir}/report.md")
    return 0


def cmd_validate(args) -> int:
    from revffn.training.config import load_config
    from revffn.training.parallel import STRATEGIES, check_strategy
    from revffn.training.setup import check_on_skeleton, prepare_run

    cfg = load_config(args.config, args.overrides)
    launch = ""  # a config torchrun launches, checked before it is: what its strategy refuses, then the rest as one
    if cfg.distributed in STRATEGIES and "RANK" not in os.environ:  # process runs it
        check_strategy(cfg, cfg.distributed)
        launch = f"; distributed={cfg.distributed}: its checks passed, the rest checked as one process (run: torchrun)"
        cfg = cfg.replace(distributed="none")
    plan = prepare_run(cfg)
    unchecked = check_on_skeleton(cfg, plan)
    s = plan.train_set.stats
    data = ("streamed (its first example reads)" if cfg.streaming else f"{s['n_examples']} examples, "
            f"{s['n_truncated']} truncated ({s['n_cut']} inside what they train on), {s['n_dropped']} dropped, "
            f"{s['n_train_tokens']} trained tokens")
    if "RANK" in os.environ:  # under torchrun: each rank checked its own data shard and device; rank 0 says it
        launch = f"; distributed={plan.distributed}: checked on each of {os.environ.get('WORLD_SIZE', '?')} processes"
        if os.environ["RANK"] != "0":
            return 0
    print(f"config OK: method={cfg.method} model={cfg.model} device={plan.device}; data: {data}"
          + (f"; eval_data: {plan.eval_set.stats['n_examples']} examples" if plan.eval_set else "") + launch
          + ("; the method prepared on the model's modules" if unchecked is None else
             f"; the method could not be prepared without weights ({unchecked}): training checks it"))
    return 0


def _load_for_cli(model_dir: str, seed: int = 0):
    """A final/ directory, any HF directory, a Hub ID, builtin:base, or a tiny preset (random init, shipped
    tokenizer)."""
    ref, tok = _tokenizer_for_cli(model_dir)
    return _model_for_cli(ref, tok, seed), tok


def _tokenizer_for_cli(model_dir: str):
    """(the model's reference, resolved: a tiny preset's name or a directory; its tokenizer), no weights read."""
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import check_model_ref, resolve_model_ref
    from revffn.models.model_config import check_vocabulary
    from revffn.models.presets import TINY_PRESETS

    check_model_ref(model_dir, "MODEL_DIR")
    if model_dir in TINY_PRESETS:
        return model_dir, load_tokenizer(None)
    model_dir = resolve_model_ref(model_dir, "MODEL_DIR")
    tokenizer = load_tokenizer(model_dir)
    check_vocabulary(model_dir, tokenizer, "MODEL_DIR")
    return model_dir, tokenizer


def _model_for_cli(ref: str, tok, seed: int = 0):
    from revffn.conversion.causal_lm import CausalLM
    from revffn.models.loading import load, load_hf
    from revffn.models.presets import TINY_PRESETS

    if ref in TINY_PRESETS:
        return CausalLM(load_hf(ref, seed=seed, vocab_size=len(tok))).eval()
    return load(ref)


def cmd_generate(args) -> int:
    from revffn.data.templates import chat_prompts
    from revffn.models.generation import check_context, generate_texts, positions
    from revffn.models.model_config import context_length

    for i, prompt in enumerate(args.prompt):  # (--prompt appends: always a list)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8 arrive as surrogates
            raise UserError(f"--prompt{f' {i + 1}' if i else ''}: not UTF-8 text (a byte at character {e.start}). "
                            "Fix: give the prompt as UTF-8 text (check the terminal's or the script's encoding).") \
                from None
    ref, tok = _tokenizer_for_cli(args.model_dir)
    prompts = chat_prompts(args.prompt, tok)
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in prompts]
    names = [f"--prompt {i + 1}" for i in range(len(prompts))] if len(prompts) > 1 else None
    context = context_length(ref, {})  # from the config: before the weights are read
    check_context(context, lengths, args.max_new_tokens, "--max-new-tokens", names)
    model = _model_for_cli(ref, tok)
    if context is None:  # a config that did not read without the model
        check_context(positions(model.config), lengths, args.max_new_tokens, "--max-new-tokens", names)
    for text in generate_texts(model, tok, prompts, max_new_tokens=args.max_new_tokens):
        print(text)
    return 0


def cmd_eval(args) -> int:
    from revffn.data.formats import load_examples
    from revffn.training.evaluate import evaluate

    model, tok = _load_for_cli(args.model_dir)
    examples = load_examples(args.data, "--data")
    report = evaluate(model, tok, examples, args.max_seq_length, args.batch_size, args.max_new_tokens, args.limit,
                      args.match, key="--max-new-tokens")
    report["model"], report["data"] = args.model_dir, args.data
    if args.loglikelihoods:  # what lm-eval's `hf` model scores on the task `revffn.reports.lm_eval_task` writes
        from revffn.reports.lm_eval_task import loglikelihoods, task_rows

        report["loglikelihoods"] = loglikelihoods(model, tok, task_rows(examples, tok))
    if args.json:
        print(json.dumps(report))
    else:
        em = "n/a" if report["exact_match"] is None else f"{100 * report['exact_match']:.1f}%"
        print(f"{args.model_dir} on {args.data}: loss {report['loss']:.4f}, perplexity {report['perplexity']:.2f}, "
              f"{report['match']} match {em} ({report['n_scored']} scored of {report['n_examples']})")
        for s in report["samples"]:
            print(f"  prompt: {s['prompt']!r}\n    reference:  {s['reference']!r}\n    prediction: {s['prediction']!r}")
        if args.loglikelihoods:
            ll = report["loglikelihoods"]
            print("  log-likelihood of each reference given its prompt (summed log-prob; --json lists them): "
                  + (f"mean {sum(ll) / len(ll):.4f} over {len(ll)}, first {ll[0]:.4f}" if ll else "none"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="revffn", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="environment check: versions, devices, memory probe, bf16, a tiny reversible "
                       "parity run, disk at --output-dir (exit 1 when one fails)")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="the device to check (auto: "
                   "CUDA when there is one)")
    d.add_argument("--output-dir", default="runs", help="where runs will go: free disk and write access (default: "
                   "%(default)s)")
    d.add_argument("--probe-mib", type=_positive, default=None, help="memory probe size (default: 90%% of the GPU's "
                   "free memory; on the host 1 GiB, at most half of what is available)")
    d.add_argument("--json", action="store_true", help="print exactly one JSON object")
    d.set_defaults(fn=cmd_doctor)

    c = sub.add_parser("check", help="consistency check: reversible vs plain-autograd gradients")
    c.add_argument("--model", default="tiny-qwen2-moe", help="preset name or local HF directory")
    c.add_argument("--layers", type=_positive, default=None, help="override num_hidden_layers")
    c.add_argument("--dtype", default="float32", help="float32 | bfloat16 (compute; streams: --stream-dtype)")
    c.add_argument("--stream-dtype", default="auto", choices=["auto", "float32", "float64"],
                   help="the streams' dtype; auto (training's default): float64 where float32 streams rebuild the "
                   "layer inputs more than 3e-2 of the stream scale off (a deep pretrained model, e.g. "
                   "builtin:smollm2), else float32")
    c.add_argument("--batch", type=_positive, default=2)
    c.add_argument("--seq", type=_positive, default=32)
    c.add_argument("--seed", type=_nonnegative, default=0)
    c.add_argument("--adapter-init", default="coordinate", choices=["coordinate", "zero", "random"])
    c.add_argument("--hidden", type=_positive, default=None, help="override hidden_size (other widths keep ratio)")
    c.add_argument("--stream-width", default="full", choices=["full", "half"], help="the reversible streams' width")
    c.add_argument("--coupling", default="buffered", choices=["additive", "buffered"], help="buffered (the decoder "
                   "layers whole on fixed-point streams; revffn.coupling's default) | additive (adapters)")
    c.add_argument("--buffer-momentum", default="positive", choices=["positive", "negative"], help="the buffered "
                   "coupling's momentum sign (revffn.buffer_momentum)")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where the check runs")
    c.add_argument("--json", action="store_true", help="print exactly one JSON object")
    c.set_defaults(fn=cmd_check)

    b = sub.add_parser("bench", help="peak memory, saved activations and tokens/s per method (fresh process each)")
    b.add_argument("--model", default="tiny-qwen2-moe", help="tiny preset, config-only preset or local HF directory")
    b.add_argument("--methods", default=None, help="comma-separated methods (default: every registered method); "
                   "NAME:KEY=VALUE[:...] adds a variant, e.g. revffn:optimizer=adafactor:optimizer_in_backward=true")
    b.add_argument("--layers", type=_positive, default=None, help="override num_hidden_layers")
    b.add_argument("--hidden", type=_positive, default=None, help="override hidden_size (other widths keep ratio)")
    b.add_argument("--batch", type=_positive, default=4)
    b.add_argument("--seq", type=_positive, default=512)
    b.add_argument("--steps", type=_positive, default=3, help="timed optimizer steps (after one warm-up step)")
    b.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16")
    b.add_argument("--device", default="auto", help="auto | cpu | cuda")
    b.add_argument("--seed", type=_nonnegative, default=0)
    b.add_argument("--threads", type=_positive, default=None, help="torch threads per worker (default: torch's)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="training-config override for every method, e.g. revffn.stream_dtype=bfloat16")
    b.add_argument("--timeout", type=_positive_float, default=None,
                   help="seconds per method before it counts as an error")
    b.add_argument("--nproc", type=_positive, default=1, help="torchrun ranks per method (--batch is per rank); with 2 "
                   "or more, each method is also measured in one process, for the per-rank ratio")
    b.add_argument("--distributed", default=None, help="fsdp (default with --nproc 2+) | ddp")
    b.add_argument("--peers", default="", metavar="PEER[,PEER]", help="also run the tools users would run instead, "
                   "each without and with gradient checkpointing: hf-trainer (transformers.Trainer), trl-sft "
                   "(TRL's SFTTrainer, where installed); NAME+ckpt: only the run with checkpointing")
    b.add_argument("--repeat", type=_positive, default=1, help="measure each method N times, fresh processes each "
                   "time; the row holds the medians (start-up and tokens/s vary run to run)")
    b.add_argument("--sweep", default=None, metavar="VAR=V1,V2,...", help="layers=4,8,16 | seq=256,512 | batch=... "
                   "| hidden=...: every method at every value; writes sweep.json/md/png")
    b.add_argument("--out", default=None, help="output directory")
    b.add_argument("--render", default=None, metavar="DIR", help="only re-render DIR's .md/.png from its JSON")
    b.set_defaults(fn=cmd_bench)

    s = sub.add_parser("estimate", help="analytic memory estimate of one training step (needs only the config)")
    s.add_argument("--model", required=True, help="tiny preset, config-only preset (qwen1.5-moe-a2.7b, ...) or dir")
    s.add_argument("--method", default="revffn")
    s.add_argument("--batch", type=_positive, default=1, help="sequences per GPU")
    s.add_argument("--seq", type=_positive, default=2048)
    s.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32")
    s.add_argument("--layers", type=_positive, default=None, help="override num_hidden_layers")
    s.add_argument("--hidden", type=_positive, default=None, help="override hidden_size")
    s.add_argument("--gpu-mem", default=None, help="e.g. 80GB or 80GiB: say whether it fits (fsdp: on how many "
                   "GPUs)")
    s.add_argument("--world-size", type=_positive, default=1, help="data-parallel GPUs (default 1)")
    s.add_argument("--distributed", default="none", help="none | ddp | fsdp: the per-GPU memory of that "
                   "data-parallel strategy (default none)")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="estimator option: r=8, group_size=2, freeze_router=false, padded=false, ...")
    s.add_argument("--json", action="store_true", help="print exactly one JSON object")
    s.set_defaults(fn=cmd_estimate)

    a = sub.add_parser("archs", help="architecture sweep: every HF causal LM, MoE and dense, tiny, reversible vs "
                       "plain gradients")
    a.add_argument("--types", default=None, help="comma-separated model types, MoE or dense (default: every "
                   "causal-LM type)")
    a.add_argument("--timeout", type=_positive_float, default=60.0,
                   help="seconds per model type before it counts as a crash")
    a.add_argument("--out", default=None, metavar="FILE.md", help="write the Markdown table there (e.g. "
                   "docs/architectures.md)")
    a.add_argument("--json-out", default=None, metavar="FILE.json", help="also write the full JSON document there")
    a.add_argument("--json", action="store_true", help="print exactly one JSON object")
    a.set_defaults(fn=cmd_archs)

    q = sub.add_parser("study", help="quality study: every method fine-tunes a pretrained base (--base) on built-in "
                       "tasks")
    q.add_argument("--out", required=True, help="output directory (study.json, study.md, plots, runs/)")
    q.add_argument("--base", default=None, help="the pretrained model to fine-tune (default builtin:base; a real "
                   "model, e.g. builtin:smollm2 or builtin:smollm2-moe, gets the real-base plan: full, lora and "
                   "revffn on commas, 3 seeds, forgetting on builtin:pydoc_text and builtin:smollm2_probes)")
    q.add_argument("--steps", type=_positive, default=None, help="optimizer steps per run (the budget; default "
                   "300 on builtin:base, 60 on a real base)")
    q.add_argument("--seeds", type=_positive, default=None, help="seeds per method at its chosen LR (default 2 on "
                   "builtin:base, 3 on a real base)")
    q.add_argument("--heal-steps", type=_positive, default=None, help="a real base only: heal the study's one "
                   "conversion this many steps on the calibration text at lr 1e-4 before every RevFFN run (default: "
                   "none, the CPU budget; a GPU affords 400: docs/conversion.md)")
    q.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE", help="a method's option in "
                   "every run of it (repeatable), e.g. revffn.train_adapters=false")
    q.add_argument("--lr-grid", action="append", default=[], metavar="METHOD=LR,LR", help="the LRs a method's is "
                   "chosen from (repeatable), e.g. revffn=1e-4,3e-4")
    q.add_argument("--quick", action="store_true", help="tiny smoke version (< 1 min): 2 steps, one task, one seed")
    q.add_argument("--docs", default=None, metavar="PATH", help="also write the report to PATH (e.g. docs/study.md)")
    q.add_argument("--methods", default=None, help="comma-separated subset of the study's methods (default: every "
                   "registered method with a declared LR grid)")
    q.add_argument("--render", action="store_true", help="only re-render --out's study.md/plots from its study.json")
    q.add_argument("--jobs", type=_positive, default=None, help="runs at once, each a fresh process (default 1)")
    q.add_argument("--threads", type=_positive, default=None, help="torch threads per run (default: cores / jobs "
                   "when --jobs > 1, else torch's)")
    q.set_defaults(fn=cmd_study)

    k = sub.add_parser("convert", help="convert a model to RevFFN once (buffered; or additive: calibrated, optionally "
                       "healed) into a directory that `revffn train model=DIR method=revffn` starts from")
    k.add_argument("model", help="builtin:base, builtin:smollm2 or builtin:smollm2-moe, a tiny preset, a local HF "
                   "model directory, a GGUF file or a Hub ID")
    k.add_argument("--out", required=True, help="the directory to write (model, tokenizer, revffn.json)")
    k.add_argument("--calibration-data", default=DEFAULT_CALIBRATION, help="general text, not task data: a data "
                   "source (README: Data formats) or self (sampled from the model) (default: %(default)s)")
    k.add_argument("--calibration-tokens", type=_positive, default=32768, help="calibration tokens (default: "
                   "%(default)s, in rows of 128)")
    k.add_argument("--heal-steps", type=_nonnegative, default=0,
                   help="KL self-distillation steps on the adapters (0: none)")
    k.add_argument("--heal-data", default=DEFAULT_CALIBRATION, help="a data source (README: Data formats) or "
                   "self (sampled from the model) (default: %(default)s)")
    k.add_argument("--heal-batch-size", type=_positive, default=8, help="rows of 128 tokens per heal step")
    k.add_argument("--heal-lr", type=_heal_lr, default=None, help="heal AdamW peak LR (cosine to a tenth); auto "
                   "(the default): the best of one AdamW-sized step at 1e-6 ... 1e-3, scored on a second heal batch")
    k.add_argument("--heal-warmup-steps", type=_nonnegative, default=None, help="linear LR warm-up steps (default: "
                   "a tenth of --heal-steps, at least 20 and at most half)")
    k.add_argument("--heal-norms", action="store_true", help="train the blocks' RMSNorm weights in the heal too")
    k.add_argument("--heal-hidden-coef", type=_nonnegative_float, default=0.0, help="add this x the per-layer "
                   "hidden-state MSE to the heal's KL (0: none; > 0 runs the plain twin, more activation memory)")
    k.add_argument("--no-adapter-skip", action="store_true", help="P_up / P_down only: no skip per branch "
                   "(revffn.adapter_skip: false)")
    k.add_argument("--stream-width", default="full", help="full (two d-wide streams, the default) | half (two d/2 "
                   "streams, the paper's; revffn.stream_width)")
    k.add_argument("--coupling", default="buffered", help="buffered (the default: the decoder layers whole on "
                   "fixed-point streams, the model to 2^-buffer_bits: no calibration, no heal) | additive (adapters, "
                   "calibrated and optionally healed; revffn.coupling)")
    k.add_argument("--buffer-bits", type=_positive, default=None, help="the buffered coupling's bits a coordinate "
                   "a layer (1-8; default: revffn.buffer_bits's, 6)")
    k.add_argument("--buffer-momentum", default="positive", choices=["positive", "negative"],
                   help="the buffered coupling's momentum sign: positive (the default) | negative (the form before "
                   "stop 50; revffn.buffer_momentum)")
    k.add_argument("--eval-data", default=None, help="where the conversion gap is measured (default: "
                   "builtin:retention_test for builtin:base, else none)")
    k.add_argument("--heal-eval-steps", type=_nonnegative, default=0, help="measure the loss on the eval set every "
                   "N heal steps: the heal's curve and its tokens-to-target (base + 0.2 nats, HEAL_TARGET) in "
                   "revffn.json")
    k.add_argument("--stream-dtype", default="auto", help="auto | float32 | bfloat16 | float64 (the residual "
                   "streams; auto: float64 where float32 streams would not rebuild the calibrated model's layer "
                   "inputs to 3e-2 of the stream scale, as on a deep real model, else float32)")
    k.add_argument("--seed", type=_nonnegative, default=0)
    k.add_argument("--device", default="cpu", help="cpu | cuda | auto: where the model is calibrated, healed "
                   "and measured (a 30-layer model's calibration takes about 30 min on 2 CPU cores)")
    k.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    k.add_argument("--json", action="store_true", help="print the written revffn.json as one JSON object")
    k.set_defaults(fn=cmd_convert)

    u = sub.add_parser("upcycle", help="sparse upcycling: a dense llama/mistral/qwen2 model to an MoE that equals it "
                       "at init (checked: max |Δlogit| in DIR/revffn.json)")
    u.add_argument("model", help="a dense model: builtin:smollm2, a local HF directory, a GGUF file or a Hub ID")
    u.add_argument("--experts", type=_positive, required=True, help="experts per layer (E >= 2)")
    u.add_argument("--top-k", type=_positive, required=True, help="experts per token (1..E), renormalized")
    u.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen2_moe"], help="the MoE architecture "
                   "(default: %(default)s)")
    u.add_argument("--out", required=True, help="the directory to write (model, tokenizer, revffn.json)")
    u.add_argument("--seed", type=_nonnegative, default=0, help="router init seed")
    u.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    u.add_argument("--json", action="store_true", help="print the written revffn.json as one JSON object")
    u.set_defaults(fn=cmd_upcycle)

    t = sub.add_parser("train", help="fine-tune a model from a YAML config (no config: the quickstart)")
    t.add_argument("config", nargs="?", default=None, help="YAML config; omit for the built-in quickstart")
    t.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys reach method sections)")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check a config, its data, and the method on the model's modules (built "
                       "without weights) without training")
    v.add_argument("config", nargs="?", default=None, help="YAML config, as `revffn train` takes it; omit for the "
                   "built-in quickstart")
    v.add_argument("overrides", nargs="*", help="key=value overrides, as `revffn train` takes them")
    v.set_defaults(fn=cmd_validate)

    g = sub.add_parser("generate", help="greedy generation from a trained model")
    g.add_argument("model_dir", help="a run's final/ directory, an HF directory, or a tiny preset")
    g.add_argument("--prompt", action="append", required=True, help="user prompt (repeatable)")
    g.add_argument("--max-new-tokens", type=_positive, default=64)
    g.set_defaults(fn=cmd_generate)

    e = sub.add_parser("eval", help="loss, perplexity and exact-match accuracy on a data file")
    e.add_argument("model_dir", help="a run's final/ directory, an HF directory, a Hub ID, builtin:NAME, or a tiny "
                   "preset")
    e.add_argument("--data", required=True, help="a data file (JSON/JSONL/parquet/arrow/csv), a save_to_disk "
                   "directory, hf:NAME[:CONFIG][@SPLIT] or builtin:NAME")
    e.add_argument("--json", action="store_true", help="print the report (with each scored sample) as one JSON "
                   "object")
    e.add_argument("--limit", type=_nonnegative, default=None, help="score at most N examples by exact match")
    e.add_argument("--loglikelihoods", action="store_true", help="also report each example's summed log-prob of "
                   "its response given the prompt, as lm-eval scores it (docs/outputs.md)")
    e.add_argument("--match", choices=("exact", "contains"), default="exact",
                   help="exact: the whitespace-collapsed generation equals the reference (or its `Answer:` line "
                   "does); contains: it contains the reference, case-insensitive (default: %(default)s)")
    e.add_argument("--batch-size", type=_positive, default=16, help="examples a forward (default: %(default)s)")
    e.add_argument("--max-new-tokens", type=_positive, default=48, help="greedy tokens generated for exact match "
                   "(default: %(default)s)")
    e.add_argument("--max-seq-length", type=_sequence_length, default=512, help="tokens an example is cut to for "
                   "the loss, as training cuts it (default: %(default)s)")
    e.set_defaults(fn=cmd_eval)
    return p


class _Interrupts:
    """While in use (the main thread, Python's own handler in place): each Ctrl-C is noted, and raises
    KeyboardInterrupt as Python's handler does."""

    seen = False

    def __enter__(self):
        main_thread = threading.current_thread() is threading.main_thread()
        self.previous = signal.getsignal(signal.SIGINT) if main_thread else None
        if self.previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._interrupted)
        return self

    def _interrupted(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, self.previous)


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    # cuBLAS reads its workspace setting once, at a process's first matmul, which convert's and the study's base
    # evaluations run before a model with the buffered coupling asks for it
    # (`reversible.buffered.deterministic_kernels`): set here, for this process and the workers it starts; no
    # effect off CUDA
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if "TRANSFORMERS_VERBOSITY" not in os.environ:  # read as transformers is imported: here and in child processes
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        if "transformers" in sys.modules:  # (imported already, by a caller of main)
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "validate") and len(argv) > 1 and "=" in argv[1]:
        argv.insert(1, "")  # `revffn train key=value`: overrides on the quickstart
    args = parser.parse_args(argv)
    args.argv = list(argv)
    library_bars_off()
    if getattr(args, "config", None) == "":
        args.config = None
    interrupts = _Interrupts()
    try:
        with interrupts:
            return args.fn(args)
    except UserError as e:
        print(f"revffn {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"revffn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): as Python's docs advise, no traceback, and
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except Exception as e:
        if interrupts.seen:  # a Ctrl-C raised inside an import may surface as another error (transformers' lazy
            print(f"revffn {args.command}: interrupted", file=sys.stderr)  # modules: a ModuleNotFoundError)
            return 130
        if (why := disk_fault(e)) is not None:  # (an OSError, or a library's own: safetensors' "File too large")
            print(f"revffn {args.command}: error: a write failed: {why} ({one_line(e)}). Fix: free space, or write "
                  "the output elsewhere.", file=sys.stderr)
            try:
                sys.stdout.flush()  # what was printed before reaches a stdout that still takes it
            except OSError:  # stdout is the full one: no second error at exit's flush
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return DiskFull.exit_code
        traceback.print_exc()
        print(f"revffn {args.command}: failed (see the traceback above)", file=sys.stderr)
        return 1
