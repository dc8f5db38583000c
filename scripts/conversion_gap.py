"""The conversion-gap tables of docs/conversion.md: what converting a model to RevFFN costs on held-out text,
per stream width, adapter init, calibration text and heal text.

    python scripts/conversion_gap.py --out runs/conversion_gap --docs docs/conversion.md --jobs 2   # ~30 min, 2 cores
    python scripts/conversion_gap.py --out runs/gap-quick --quick                            # smoke: ~2 min
    python scripts/conversion_gap.py --model builtin:smollm2 --out runs/gap-smollm2 --docs docs/conversion.md
    python scripts/conversion_gap.py --model builtin:smollm2-moe --device cuda --out runs/gap-moe   # a GPU: minutes
    python scripts/conversion_gap.py --render runs/gap-moe/conversion_smollm2_moe.json --docs docs/conversion.md

`builtin:base` (the default) is measured on its held-out pretraining text (`builtin:retention_test`); a real
model (`builtin:smollm2`, `builtin:smollm2-moe`) on Python's reference manual (`builtin:pydoc_text`), with
`self` and the rest of the manual (`builtin:pydoc_calibration`, disjoint from the evaluation text) as
calibration and heal text, and half- against full-width streams (`--stream-width`); each converted model's
knowledge probes (`builtin:smollm2_probes`, containment) and, for a healed row, the heal tokens until the
held-out loss first reached base + 0.2 nats (`--heal-eval-steps`). Each model's table sits between its own
markers in the page.

Every calibrated row is one `revffn convert` run in a fresh process (its revffn.json gives the losses, the
wall times and the process's peak RSS). Text sources: `self` (sampled from the base: no data), general
text (documents of the base's own pretraining corpus, `scripts/corpus.py`, none of them held out),
task text (`builtin:commas_train`), and a mix (the general text plus every `commas_train` example).
Rows marked "no skip" are the paper's four adapters (`--no-adapter-skip`); the others have the skips.
Results go to OUT/conversion.json (and beside the page with --docs: docs/conversion.json); the table is
rendered from them. A rerun with the same --out reuses the rows whose model directory is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from revffn.data import DEFAULT_CALIBRATION  # the calibrated init's default text
from revffn.training.export import heal_warmup

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 32768  # calibration tokens: 256 rows x 128
TASK_TOKENS = 16384  # commas_train holds ~25k tokens


def write_sources(out: Path, n_general: int = 3000, seed: int = 0) -> dict[str, str]:
    """general.jsonl (pretraining-corpus documents) and mix.jsonl (those + every commas_train example)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from corpus import pretraining_corpus

    train, _ = pretraining_corpus(seed, 20000)
    docs = random.Random(seed + 7).sample(train, n_general)
    general = out / "general.jsonl"
    general.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    task = (ROOT / "revffn" / "assets" / "data" / "commas_train.jsonl").read_text()
    (out / "mix.jsonl").write_text(general.read_text() + task)
    return {"self": "self", "general": str(general), "task": "builtin:commas_train", "mix": str(out / "mix.jsonl")}


REAL_EVAL, REAL_CALIBRATION, REAL_PROBES = "builtin:pydoc_text", "builtin:pydoc_calibration", "builtin:smollm2_probes"


def plain_rows(model: str = "builtin:base", eval_data: str = "builtin:retention_test",
               widths: tuple[str, ...] = ("half",), device: str = "cpu") -> list[dict]:
    """base, and the uncalibrated inits (no data involved), at each stream width, measured on `device`."""
    import torch

    from revffn.conversion.causal_lm import CausalLM
    from revffn.conversion.convert import convert
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load_hf, resolve_model_ref
    from revffn.training.evaluate import retention_loss
    from revffn.training.export import convert_device

    tok = load_tokenizer(resolve_model_ref(model))
    dev = convert_device(device)
    rows = [{"name": "base (unconverted)",
             "loss": retention_loss(CausalLM(load_hf(model)).to(dev).eval(), tok, eval_data)}]
    for width in widths:
        for init in ("coordinate", "zero") if width == "half" else ("coordinate",):
            torch.manual_seed(0)
            converted = convert(load_hf(model).to(dev), adapter_init=init, stream_width=width).eval()
            label = f"`{init}`" + ("" if widths == ("half",) else f" ({width} width)")
            rows.append({"name": label, "loss": retention_loss(converted, tok, eval_data)})
    return rows


def convert_row(name: str, out: Path, src: dict, calibration: str, tokens: int, heal: str | None, steps: int,
                threads: int, skip: bool = True, model: str = "builtin:base", width: str = "half",
                eval_data: str | None = None, device: str = "cpu", heal_lr: str = "auto", heal_eval_steps: int = 0,
                probes: str | None = None) -> dict:
    """One `revffn convert` in a fresh process (`calibration`, `heal`: keys of `src`); the row from its revffn.json
    (and, with `probes`, the converted model's probe accuracy from `revffn eval --match contains`)."""
    target = out / "models" / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [sys.executable, "-m", "revffn", "convert", model, "--out", str(target), "--overwrite", "--coupling",
           "additive", "--calibration-data", src[calibration], "--calibration-tokens", str(tokens),
           "--stream-width", width]
    if eval_data:
        cmd += ["--eval-data", eval_data]
    if heal:
        cmd += ["--heal-steps", str(steps), "--heal-data", src[heal], "--heal-lr", heal_lr]
        if heal_eval_steps and eval_data:
            cmd += ["--heal-eval-steps", str(heal_eval_steps)]
    if device != "cpu":
        cmd += ["--device", device]
    if not skip:
        cmd += ["--no-adapter-skip"]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # the checkout, then the caller's
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    done = target / "revffn.json"
    want = {"calibration_data": src[calibration], "calibration_tokens": tokens, "heal_steps": steps if heal else 0,
            "heal_data": src[heal] if heal else DEFAULT_CALIBRATION, "adapter_skip": skip, "stream_width": width,
            "heal_lr": (None if heal_lr == "auto" else float(heal_lr)) if heal else None}
    def reusable(m: dict) -> bool:  # converted before with these flags and, healed, the warm-up today's rule gives
        old_rule = max(steps // 10, 1)  # (a manifest before the warm-up's floor, stop 54, names none: a tenth's)
        return all(m["convert"].get(k) == v for k, v in want.items()) and (
            not heal or (m["heal"] or {}).get("warmup_steps", old_rule) == heal_warmup(steps))

    if not (done.is_file() and reusable(json.loads(done.read_text()))):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)  # not done before (a rerun resumes)
        if proc.returncode != 0:
            return {"name": name, "status": f"exit {proc.returncode}", "error": proc.stderr[-2000:]}
    m = json.loads(done.read_text())
    gap, cal, hl = m["conversion_gap"], m["calibration"], m["heal"]
    row = {"name": name, "status": "ok", "adapter_skip": skip, "stream_width": width, "calibration_data": calibration,
           "calibration_tokens": cal["tokens"], "heal_data": heal, "heal_steps": steps if heal else 0,
           "heal_lr": hl["lr"] if hl else None, "tokens_to_target": hl.get("tokens_to_target") if hl else None,
           "heal_curve": hl.get("curve") if hl else None, "heal_warmup": hl.get("warmup_steps") if hl else None,
           "heal_kl_max_over_first": hl["kl_max"] / hl["kl_first"] if hl else None,
           "loss_calibrated": gap["calibrated"], "loss": gap.get("healed", gap["calibrated"]),
           "calibration_s": cal["wall_s"] + cal["data_wall_s"], "heal_s": hl["wall_s"] if hl else None,
           "peak_rss_bytes": m["peak_rss_bytes"], **_gpu(m), "accumulator_bytes": cal["accumulator_bytes"],
           "kept_bytes": cal["kept_bytes"], "worst_residual": max(cal["residuals"].values()),
           "wall_s": m["wall_s"], "command": " ".join(cmd[1:]).replace(str(out), "OUT")}
    if probes:
        row["probes"] = probe_accuracy(str(target), probes, env)
    return row


def _gpu(manifest: dict) -> dict:
    """The GPU's peak of a conversion run on CUDA (`peak_gpu_bytes`; `peak_rss_bytes` is the host's)."""
    return {"peak_gpu_bytes": manifest["peak_gpu_bytes"]} if "peak_gpu_bytes" in manifest else {}


def buffered_row(bits: int, out: Path, threads: int, model: str, eval_data: str, device: str = "cpu",
                 probes: str | None = None, momentum: str = "positive") -> dict:
    """`revffn convert MODEL --coupling buffered --buffer-bits BITS --buffer-momentum MOMENTUM` in a fresh process:
    every decoder layer whole on fixed-point streams (no adapters, nothing to calibrate or heal); the row from its
    revffn.json and probes."""
    name = f"buffered coupling, {bits} bits, {momentum} momentum (no adapters)"
    target = out / "models" / f"buffered_{bits}_{momentum}"
    cmd = [sys.executable, "-m", "revffn", "convert", model, "--out", str(target), "--overwrite", "--coupling",
           "buffered", "--buffer-bits", str(bits), "--buffer-momentum", momentum, "--eval-data", eval_data] + (
               ["--device", device] if device != "cpu" else [])
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    done = target / "revffn.json"
    held = json.loads(done.read_text())["convert"] if done.is_file() else {}
    if (held.get("buffer_bits"), held.get("buffer_momentum")) != (bits, momentum):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"name": name, "status": f"exit {proc.returncode}", "error": proc.stderr[-2000:]}
    m = json.loads(done.read_text())
    row = {"name": name, "status": "ok", "coupling": "buffered", "buffer_bits": bits, "buffer_momentum": momentum,
           "loss": m["conversion_gap"]["buffered"], "calibration_s": 0.0, "peak_rss_bytes": m["peak_rss_bytes"],
           **_gpu(m),
           "wall_s": m["wall_s"], "tokens_to_target": 0, "command": " ".join(cmd[1:]).replace(str(out), "OUT")}
    if probes:
        row["probes"] = probe_accuracy(str(target), probes, env)
    return row


def probe_accuracy(model: str, probes: str, env: dict | None = None) -> float | None:
    """`revffn eval MODEL --data PROBES --match contains` in a fresh process: the fraction answered (None: failed)."""
    proc = subprocess.run([sys.executable, "-m", "revffn", "eval", model, "--data", probes, "--match", "contains",
                           "--max-new-tokens", "24", "--json"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  probes of {model} failed: {proc.stderr[-1000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout)["exact_match"]


def render(data: dict) -> str:
    """docs/conversion.md's table from conversion.json."""
    base = data["rows"][0]["loss"]
    extra = any("probes" in r for r in data["rows"])  # a real model's table: probes and tokens-to-target too
    gpu = any("peak_gpu_bytes" in r for r in data["rows"])  # run on a GPU: its peak beside the host's
    lines = ["| conversion | calibration text | heal | loss | Δ vs base | calibration s | heal s | "
             + ("peak RSS; GPU |" if gpu else "peak RSS |")
             + (" probes | heal tokens to base + 0.2 |" if extra else ""),
             "|---|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if extra else "")]
    for r in data["rows"]:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['name']} | | | {r['status']} | | | | |" + (" | |" if extra else ""))
            continue
        if extra:
            p = r.get("probes", data.get("base_probes") if r is data["rows"][0] else None)
            reached = r.get("tokens_to_target")
            tail = (f" {'–' if p is None else f'{100 * p:.0f} %'} | "
                    + ("0 (no heal) |" if r.get("coupling") == "buffered" else f"{reached:,} |" if reached is not None
                       else "not reached |" if r.get("heal_curve") else "– |"))
        else:
            tail = ""
        cal = f"{r['calibration_data']} ({r['calibration_tokens']} tok)" if "calibration_data" in r else "–"
        heal = (f"{r['heal_data']}, {r['heal_steps']} steps" + (f", lr {r['heal_lr']:g}" if r.get("heal_lr") else "")
                + (f", warm-up {r['heal_warmup']}" if r.get("heal_warmup") is not None else "")
                + (f"; KL max {r['heal_kl_max_over_first']:.2f}x first" if r.get("heal_kl_max_over_first") else "")
                if r.get("heal_data") else "–")
        rss = (f"{r['peak_rss_bytes'] / 2**20:.0f} MiB" if "peak_rss_bytes" in r else "–") + (
            f"; {r['peak_gpu_bytes'] / 2**20:.0f} MiB" if "peak_gpu_bytes" in r else "")
        cs = f"{r['calibration_s']:.0f}" if "calibration_s" in r else "–"
        hs = f"{r['heal_s']:.0f}" if r.get("heal_s") is not None else "–"
        lines.append(f"| {r['name']} | {cal} | {heal} | **{r['loss']:.3f}** | {r['loss'] - base:+.3f} | {cs} | {hs} "
                     f"| {rss} |" + tail)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="work directory (sources, converted models, conversion.json)")
    parser.add_argument("--docs", default=None, help="rewrite the table between the markers of this page")
    parser.add_argument("--heal-steps", type=int, default=400, help="heal steps per heal row (default %(default)s)")
    parser.add_argument("--long-steps", type=int, default=800, help="steps of the longer `self` heal row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1: steadiest on 2 cores)")
    parser.add_argument("--jobs", type=int, default=1, help="rows converted at once, each a fresh process")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few tokens and steps")
    parser.add_argument("--rows", default=None, help="a real model's rows to run, by index (0: half "
                        "width, self; 1: full, self; 2: full, pydoc; 3: full, pydoc x2 tokens; 4: 2 + a heal on pydoc "
                        "at 1e-4; 5: full, stdlib + a heal on stdlib at auto, the additive defaults; 6: full, stdlib, "
                        "the default calibration alone; 7, 8: the buffered coupling at 4 and 6 bits, positive "
                        "momentum; 9, 10: the same, negative momentum); default all")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="where each row converts")
    parser.add_argument("--render", default=None, metavar="JSON", help="only render a conversion JSON written before "
                        "(e.g. one a GPU wrote) into --docs")
    parser.add_argument("--model", default="builtin:base", help="builtin:base (default) or a real model: "
                        "builtin:smollm2, builtin:smollm2-moe")
    args = parser.parse_args()
    if args.render:
        if not Path(args.render).is_file():
            parser.error(f"--render {args.render}: no such file (a conversion JSON: OUT/conversion_MODEL.json)")
        data = json.loads(Path(args.render).read_text())
        model = data.get("model", "builtin:base").removeprefix("builtin:")
        real = "model" in data
        marker, suffix = (f"conversion-gap:{model}", "_" + model.replace("-", "_")) if real else ("conversion-gap", "")
        return publish(data, None, args.docs, marker, suffix)
    if not args.out:
        parser.error("--out is required (but with --render)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model != "builtin:base":
        return real_model(args, out)
    src = write_sources(out)
    tokens, task_tokens, steps, long = TOKENS, TASK_TOKENS, args.heal_steps, args.long_steps
    if args.quick:
        tokens, task_tokens, steps, long = 1024, 1024, 4, 8
    rows = plain_rows()
    plan = [("calibrated", "self", tokens, None, 0, False), ("calibrated + heal", "self", tokens, "self", long, False)]
    plan += [("calibrated", "self", tokens, None, 0, True), ("calibrated", "general", tokens, None, 0, True),
             ("calibrated", "task", task_tokens, None, 0, True)]
    plan += [("calibrated + heal", "self", tokens, h, steps, True) for h in ("self", "general", "task", "mix")]
    plan += [("calibrated + heal", "self", tokens, "self", long, True),
             ("calibrated + heal", "general", tokens, "general", long, True)]

    def run(item):
        kind, cal, n, heal, n_steps, skip = item
        name = f"{kind} ({cal}" + (f"; heal {heal} x{n_steps}" if heal else "") + ("" if skip else "; no skip") + ")"
        print(f"{name} ...", file=sys.stderr, flush=True)
        row = convert_row(name, out, src, cal, n, heal, n_steps, args.threads, skip)
        print(f"  -> {json.dumps(row)}", file=sys.stderr, flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:  # each row is its own process
        rows += list(pool.map(run, plan))
    data = {"rows": rows, "command": "python scripts/conversion_gap.py " + " ".join(sys.argv[1:]),
            "threads": args.threads, "sources": {k: v.replace(str(out), "OUT") for k, v in src.items()}}
    publish(data, out, args.docs, "conversion-gap", "")


def real_model(args, out: Path) -> None:
    """A real model's table: half- against full-width streams, `self` against real calibration text, more
    calibration tokens, and the heal on the full-width default."""
    src = {"self": "self", "pydoc": REAL_CALIBRATION, "stdlib": DEFAULT_CALIBRATION}
    tokens, steps = (1024, 4) if args.quick else (TOKENS, args.heal_steps)
    # (width, calibration text, tokens, heal text, heal steps, heal lr): the heal on the manual at 1e-4 is the best
    # of docs/conversion.md's CPU schedules; the defaults (calibrated and healed on builtin:stdlib_text at --heal-lr
    # auto; a heal on `self` until stop 46) are row 5, the default calibration alone row 6
    plan = [("half", "self", tokens, None, 0, "auto"), ("full", "self", tokens, None, 0, "auto"),
            ("full", "pydoc", tokens, None, 0, "auto"), ("full", "pydoc", 2 * tokens, None, 0, "auto"),
            ("full", "pydoc", tokens, "pydoc", steps, "1e-4"), ("full", "stdlib", tokens, "stdlib", steps, "auto"),
            ("full", "stdlib", tokens, None, 0, "auto"), ("buffered", 4, "positive"), ("buffered", 6, "positive"),
            ("buffered", 4, "negative"), ("buffered", 6, "negative")]
    if args.rows:  # a subset (a CPU budget); rows converted before, in OUT, are read back rather than redone
        plan = [plan[int(i)] for i in args.rows.split(",")]

    def run(item):
        if item[0] == "buffered":
            print(f"buffered, {item[1]} bits, {item[2]} momentum ...", file=sys.stderr, flush=True)
            return buffered_row(item[1], out, args.threads, args.model, REAL_EVAL, args.device, REAL_PROBES, item[2])
        width, cal, n, heal, n_steps, lr = item
        name = f"calibrated ({width} width; {cal} {n // 1024}k" + (f"; heal {heal} x{n_steps}" if heal else "") + ")"
        print(f"{name} ...", file=sys.stderr, flush=True)
        row = convert_row(name, out, src, cal, n, heal, n_steps, args.threads, True, args.model, width, REAL_EVAL,
                          args.device, lr, max(1, n_steps // 8), REAL_PROBES)
        print(f"  -> {json.dumps(row)}", file=sys.stderr, flush=True)
        return row

    rows = plain_rows(args.model, REAL_EVAL, ("half", "full"), args.device)
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        rows += list(pool.map(run, plan))
    data = {"model": args.model, "rows": rows, "base_probes": probe_accuracy(args.model, REAL_PROBES),
            "device": args.device, "command": "python scripts/conversion_gap.py " + " ".join(sys.argv[1:]),
            "threads": args.threads, "eval_data": REAL_EVAL, "sources": src}
    publish(data, out, args.docs, f"conversion-gap:{args.model.removeprefix('builtin:')}",
            "_" + args.model.removeprefix("builtin:").replace("-", "_"))
    failed = [r["name"] for r in rows if r.get("status", "ok") != "ok" or r.get("probes", 0) is None]
    if failed or data["base_probes"] is None:
        names = ", ".join(failed) or "the base"
        sys.exit(f"conversion_gap.py: rows that failed (or whose probes did not run): {names}")


def publish(data: dict, out: Path | None, docs: str | None, marker: str, suffix: str) -> None:
    """OUT/conversion{suffix}.json (`out` None: rendering a JSON written before), the table on stdout and, with
    `docs`, between the page's `marker` lines (the JSON beside the page)."""
    if out is not None:
        (out / f"conversion{suffix}.json").write_text(json.dumps(data, indent=1) + "\n")
    table = render(data)
    print(table)
    if docs:
        page = Path(docs)
        (page.parent / f"conversion{suffix}.json").write_text(json.dumps(data, indent=1) + "\n")
        text = page.read_text()
        start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
        if start not in text:  # a new model's table: appended with its markers
            text = text.rstrip("\n") + f"\n\n{start}{end}\n"
        head, rest = text.split(start, 1)
        page.write_text(head + start + table + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()
