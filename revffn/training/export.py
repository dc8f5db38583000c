"""`revffn convert`: convert a pretrained model to RevFFN once, calibrated and (optionally) healed,
and write it with its conversion-gap figures; `revffn train model=DIR method=revffn` then starts
from it without converting again, so one heal serves many tasks.

    revffn convert builtin:base --out runs/base-rev --heal-steps 400
    revffn train model=runs/base-rev output_dir=runs/qs

Everything is checked before the model is loaded (bad input: exit 2, nothing written), and DIR is
written aside and renamed into place. DIR holds the converted model as transformers loads it with
remote code (`models.hf_remote`: config.json, the base HF config with `auto_map`, `model.safetensors`, the
two modeling files), the tokenizer and `revffn.json` (`format: revffn`, the calibration and heal reports, and
the loss on the eval set of the base, of the plain `coordinate` conversion, after calibration and
after the heal). The eval set defaults to `builtin:retention_test` for `builtin:base` (its held-out
pretraining text); other models report no gap unless `eval_data` is given.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from revffn.conversion.causal_lm import CausalLM
from revffn.conversion.convert import (
    AUTO,
    COUPLINGS,
    STREAM_DTYPES,
    STREAM_WIDTHS,
    convert,
    describe_streams,
    pick_stream_dtype,
    stream_name,
)
from revffn.data import DEFAULT_CALIBRATION
from revffn.data.calibration import SELF, file_rows
from revffn.data.formats import load_examples
from revffn.data.tokenizer import model_tokenizer
from revffn.errors import UserError, unread
from revffn.memory.measure import peak_memory_bytes, peak_rss_bytes
from revffn.methods.base import write_manifest
from revffn.methods.calibration import calibrate_model, check_source, log_line
from revffn.models.cache import check_replaceable
from revffn.models.generation import save_generation_config
from revffn.models.hf_remote import save_converted
from revffn.models.loading import check_model_ref, is_converted, load_hf
from revffn.models.model_config import check_vocabulary
from revffn.models.presets import TINY_PRESETS
from revffn.progress import progress
from revffn.reversible.buffered import DEFAULT_BUFFER_BITS, DEFAULT_MOMENTUM, MOMENTUM_SIGNS
from revffn.training.config import load_config
from revffn.training.evaluate import RETENTION_SET, retention_loss
from revffn.training.step import build_run, train_step


@dataclass
class ConvertSpec:
    """What `revffn convert` does (its flags)."""

    model: str
    out: str
    calibration_data: str = DEFAULT_CALIBRATION
    calibration_tokens: int = 32768
    heal_steps: int = 0
    heal_data: str = DEFAULT_CALIBRATION
    heal_batch_size: int = 8
    heal_lr: float | None = None  # None: `probe_heal_lr` picks it (--heal-lr auto)
    heal_warmup_steps: int | None = None  # None: `heal_warmup`'s rule
    heal_norms: bool = False
    heal_hidden_coef: float = 0.0
    adapter_skip: bool = True
    stream_width: str = "full"
    eval_data: str | None = None
    heal_eval_steps: int = 0  # measure the loss on eval_data every N heal steps (0: only before and after)
    stream_dtype: str = AUTO  # auto: float32 or float64, measured once calibrated (`pick_stream_dtype`)
    seed: int = 0
    overwrite: bool = False
    device: str = "cpu"  # cpu | cuda | auto: where the model is calibrated, healed and measured
    coupling: str = "buffered"  # the decoder layers whole (no adapters: nothing to calibrate or heal); or additive
    buffer_bits: int = DEFAULT_BUFFER_BITS
    buffer_momentum: str = DEFAULT_MOMENTUM


def gpu_peak(model: torch.nn.Module) -> dict:
    """{"peak_gpu_bytes": CUDA's peak allocated} for a model on a GPU (the host's is `peak_rss_bytes`); {} on CPU."""
    device = next(model.parameters()).device
    return {"peak_gpu_bytes": peak_memory_bytes(device)} if device.type == "cuda" else {}


def convert_device(device: str) -> torch.device:
    """`--device`: cpu, cuda (refused where torch sees no CUDA device) or auto (cuda where there is one)."""
    if device not in ("cpu", "cuda", "auto"):
        raise UserError(f"--device: unknown device {device!r}. Fix: cpu, cuda or auto.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here. Nothing was written. Fix: --device cpu, or "
                        "--device auto (cuda where there is one).")
    return torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                        "cpu" if device == "auto" else device)


ADDITIVE_FLAGS = {"--calibration-data": "calibration_data", "--calibration-tokens": "calibration_tokens",
                  "--stream-dtype": "stream_dtype", "--stream-width": "stream_width",
                  "--no-adapter-skip": "adapter_skip"}
HEAL_FLAGS = {"--heal-data": "heal_data", "--heal-batch-size": "heal_batch_size", "--heal-lr": "heal_lr",
              "--heal-norms": "heal_norms", "--heal-hidden-coef": "heal_hidden_coef"}
BUFFERED_FLAGS = {"--buffer-bits": "buffer_bits", "--buffer-momentum": "buffer_momentum"}


def unused_flags(spec: ConvertSpec) -> None:
    """A flag set to other than its default that this conversion would not read is refused, naming what reads it:
    the adapters' flags under the buffered coupling, the buffer's under the additive one, the heal's without
    --heal-steps."""
    default = ConvertSpec(spec.model, spec.out)
    if spec.coupling == "buffered":
        table, reads, has = {**ADDITIVE_FLAGS, **HEAL_FLAGS}, "--coupling additive", "the buffered coupling (the " \
            "default: every layer whole, no adapters to calibrate or heal)"
    elif spec.heal_steps:
        table, reads, has = BUFFERED_FLAGS, "--coupling buffered", "the additive coupling"
    else:
        table, reads, has = {**BUFFERED_FLAGS, **HEAL_FLAGS}, "", "the additive coupling and no --heal-steps"
    for flag, name in table.items():
        if getattr(spec, name) != getattr(default, name):
            needs = reads or ("--coupling buffered" if flag in BUFFERED_FLAGS else "--heal-steps N")
            raise UserError(unread(flag, needs, f"this conversion has {has}", f"drop {flag}, or give {needs}",
                                   written=False))


def validate(spec: ConvertSpec):
    """Every check that needs no model; returns the tokenizer. Raises UserError naming the flag."""
    check_model_ref(spec.model, "MODEL")
    if is_converted(spec.model, "MODEL"):
        raise UserError(f"MODEL: {spec.model!r} is already converted to RevFFN. Fix: give the unconverted base model.")
    if spec.stream_dtype not in (AUTO, *STREAM_DTYPES):
        raise UserError(f"--stream-dtype: unknown dtype {spec.stream_dtype!r}. Fix: use one of "
                        f"{', '.join((AUTO, *STREAM_DTYPES))}.")
    convert_device(spec.device)
    if spec.stream_width not in STREAM_WIDTHS:
        raise UserError(f"--stream-width: unknown width {spec.stream_width!r}. Fix: one of {', '.join(STREAM_WIDTHS)}.")
    if spec.coupling not in COUPLINGS:
        raise UserError(f"--coupling: unknown coupling {spec.coupling!r}. Fix: one of {', '.join(COUPLINGS)}.")
    if spec.coupling == "buffered" and spec.heal_steps:
        raise UserError(f"--heal-steps {spec.heal_steps}: the buffered coupling has no adapters to heal (it is the "
                        "model to 2^-buffer_bits as converted). Fix: drop --heal-steps, or --coupling additive.")
    if not 1 <= spec.buffer_bits <= 8:
        raise UserError(f"--buffer-bits {spec.buffer_bits}: the buffered coupling keeps 1 to 8 bits. Fix: 1 to 8.")
    if spec.buffer_momentum not in MOMENTUM_SIGNS:
        raise UserError(f"--buffer-momentum: unknown momentum {spec.buffer_momentum!r}. Fix: one of "
                        f"{', '.join(MOMENTUM_SIGNS)}.")
    unused_flags(spec)
    if spec.heal_warmup_steps is not None:
        if not spec.heal_steps:
            raise UserError(f"--heal-warmup-steps {spec.heal_warmup_steps}: there is no heal to warm up. Fix: give "
                            "--heal-steps too, or drop --heal-warmup-steps.")
        if not 0 <= spec.heal_warmup_steps <= spec.heal_steps:
            raise UserError(f"--heal-warmup-steps {spec.heal_warmup_steps}: outside 0 to --heal-steps "
                            f"{spec.heal_steps} (more never reaches the LR). Fix: 0 to --heal-steps, or drop it "
                            "(the default rule).")
    if spec.heal_hidden_coef < 0:
        raise UserError(f"--heal-hidden-coef: {spec.heal_hidden_coef} is negative. Fix: give 0 (off) or a "
                        "positive weight.")
    check_replaceable(Path(spec.out), spec.overwrite, source=spec.model)
    tokenizer = model_tokenizer(spec.model)  # (a Hub ID: its tokenizer files only, not the weights yet)
    check_vocabulary(spec.model, tokenizer, "MODEL")
    if spec.calibration_data != SELF:
        file_rows(spec.calibration_data, tokenizer, spec.calibration_tokens, "--calibration-data",
                  budget_key="--calibration-tokens")
    if spec.heal_steps and spec.heal_data != SELF:
        file_rows(spec.heal_data, tokenizer, None, "--heal-data")
    if spec.eval_data:
        load_examples(spec.eval_data, "--eval-data")
    if spec.heal_eval_steps and not (spec.heal_steps and eval_set(spec)):
        raise UserError(f"--heal-eval-steps {spec.heal_eval_steps}: there is no heal or no eval set to measure. "
                        "Fix: give --heal-steps and --eval-data too, or drop --heal-eval-steps.")
    check_source(spec.calibration_data, "--calibration-data")
    if spec.heal_steps:
        check_source(spec.heal_data, "--heal-data")
    return tokenizer


def eval_set(spec: ConvertSpec) -> str | None:
    return spec.eval_data or (RETENTION_SET if spec.model == "builtin:base" else None)


def run_convert(spec: ConvertSpec, log=log_line) -> dict:
    """Convert, calibrate, heal, measure and write `spec.out`; returns the manifest written."""
    tokenizer = validate(spec)
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    data = eval_set(spec)
    hf = load_hf(spec.model, seed=spec.seed, **({"vocab_size": len(tokenizer)} if spec.model in TINY_PRESETS else {}))
    hf.to(convert_device(spec.device))
    gap: dict = {"data": data}
    if data:
        gap["base"] = retention_loss(CausalLM(hf).eval(), tokenizer, data, label="base")
    model = convert(hf, adapter_init="calibrated", stream_dtype=STREAM_DTYPES.get(spec.stream_dtype, torch.float32),
                    adapter_skip=spec.adapter_skip, stream_width=spec.stream_width, coupling=spec.coupling,
                    buffer_bits=spec.buffer_bits, buffer_momentum=spec.buffer_momentum).eval()
    buffered = spec.coupling == "buffered"
    if data:
        gap["buffered" if buffered else "coordinate"] = retention_loss(model, tokenizer, data, label="converted")
    calibration = None if buffered else calibrate_model(model, tokenizer, spec.calibration_data,
                                                        spec.calibration_tokens, "--calibration-data", spec.seed, log,
                                                        "--calibration-tokens")
    if data and not buffered:
        gap["calibrated"] = retention_loss(model, tokenizer, data, label="calibrated")
    streams = None
    if spec.stream_dtype == AUTO and not buffered:  # the heal and the written model use what the calibrated model needs
        streams = pick_stream_dtype(model)
        log(describe_streams(streams))
        spec = replace(spec, stream_dtype=streams["stream_dtype"])
    heal = None
    if spec.heal_steps:
        measure = (lambda: retention_loss(model, tokenizer, data, label="healing")) if spec.heal_eval_steps else None
        heal = heal_converted(model, spec, log, measure, gap.get("base"))
        if data:  # (measured along the heal: its last point is the healed model's)
            gap["healed"] = (heal["curve"][-1][2] if heal.get("curve") else
                             retention_loss(model, tokenizer, data, label="healed"))
    if data:
        log("loss on " + data + ": " + ", ".join(f"{k} {v:.4f}" for k, v in gap.items() if k != "data"))
    manifest = {"format": "revffn", "method": "revffn", **({} if buffered else {"adapter_init": "calibrated"}),
                "stream_dtype": stream_name(model), **({"streams": streams} if streams else {}),
                "converted_from": spec.model, "convert": asdict(spec),
                "conversion_gap": gap, "calibration": calibration, "heal": heal,
                "wall_s": round(time.perf_counter() - t0, 2), "peak_rss_bytes": peak_rss_bytes(), **gpu_peak(model)}
    _write(model.cpu(), tokenizer, Path(spec.out), manifest)
    return manifest


HEAL_WARMUP_FLOOR = 20
"""The fewest warm-up steps a heal gets (unless that is more than half of it). On the full-width calibrated
SmolLM2 at lr 1e-4 (32768 calibration tokens, 40 steps) the largest logged KL was 2.46x the first with 4 warm-up
steps and 1.29x with 20; a 60-step heal warmed over 6 reached 2.1x, a 160-step one over 16 1.26x (16384 tokens;
docs/conversion.md): a tenth of a short heal is too short for adapters whose inputs span
rms 0.017 to 2085, since AdamW's first steps move every weight by about the LR whatever its gradient's scale."""


def heal_warmup(steps: int, asked: int | None = None) -> int:
    """The heal's linear warm-up in steps: `asked` (--heal-warmup-steps), else a tenth of the heal but at least
    HEAL_WARMUP_FLOOR steps and at most half of it (at least 1)."""
    if asked is not None:
        return asked
    return min(max(steps // 10, HEAL_WARMUP_FLOOR), max(steps // 2, 1))


def heal_config(spec: ConvertSpec, lr: float):
    """The training run `--heal-steps` is: the revffn method's stage 1 for all of its steps (a heal only, no
    stage 2) at `lr` (its peak), with a linear warm-up (`heal_warmup`) and cosine to a tenth, clipped at 1."""
    steps, quoted = spec.heal_steps, json.dumps  # a JSON string is a YAML string: paths stay paths
    return load_config(None, [
        f"model={quoted(spec.model)}", "method=revffn", f"max_steps={steps}", f"seed={spec.seed}", "dtype=float32",
        f"learning_rate={lr}", f"warmup_steps={heal_warmup(steps, spec.heal_warmup_steps)}",
        "lr_scheduler_type=cosine",
        "min_lr_ratio=0.1", "max_grad_norm=1.0", "weight_decay=0.0",
        f"per_device_train_batch_size={spec.heal_batch_size}", "gradient_accumulation_steps=1", "output_dir=unused",
        "revffn.coupling=additive", f"revffn.adapter_warmup_steps={steps}",
        f"revffn.heal_data={quoted(spec.heal_data)}",
        f"revffn.heal_norms={str(spec.heal_norms).lower()}", f"revffn.heal_hidden_coef={spec.heal_hidden_coef}",
        f"revffn.stream_width={spec.stream_width}", f"revffn.adapter_skip={str(spec.adapter_skip).lower()}",
        f"revffn.stream_dtype={spec.stream_dtype}"])


PROBE_LRS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
"""The peak learning rates `--heal-lr auto` tries. On the full-width calibrated SmolLM2-135M one such step raises the
KL from 1.03 to 1.14 at 1e-5 and to 16.5 at 1e-4, where builtin:base heals at 1e-3 (docs/conversion.md)."""


def probe_heal_lr(run) -> dict:
    """The heal's peak LR, measured (an LR range test): AdamW's first step moves every trainable weight by
    lr·sign(grad), so each candidate of `PROBE_LRS` takes that step, from the current adapters and the gradient of
    the first heal batch, and is scored by the KL on the second (a step that only fits its own batch does not
    count). The lowest wins; the smallest candidate when none lowers the KL. The adapters are put back.
    Returns {"lr", "kl_0" (the second batch's, before), "kl_after": {lr: KL}}."""
    model, method = run.model, run.method
    method.set_trainable(model, 0)

    def batch_at(step: int) -> tuple[dict, int]:
        batch = {k: v.to(run.device) for k, v in method.step_batches(model, step, [])[0].items()}
        return batch, max(int((batch["labels"][:, 1:] != -100).sum()), 1)

    def kl(batch, n) -> float:
        with torch.no_grad():
            return float(method.forward(model, batch, 0)[0].loss_sum) / n

    (fit, n_fit), (score, n_score) = batch_at(0), batch_at(1)
    out, _ = method.forward(model, fit, 0)
    (out.loss_sum / n_fit).backward()
    params = [p for p in run.params if p.grad is not None]
    before = [p.detach().clone() for p in params]
    kl_0, kl_after = kl(score, n_score), {}
    try:
        with torch.no_grad():
            for lr in PROBE_LRS:
                for p, p_0 in zip(params, before):
                    p.copy_(p_0 - lr * p.grad.sign())
                kl_after[lr] = kl(score, n_score)
    finally:
        with torch.no_grad():
            for p, p_0 in zip(params, before):
                p.copy_(p_0)
                p.grad = None
    finite = {lr: v for lr, v in kl_after.items() if math.isfinite(v)}
    best = min(finite, key=finite.get) if finite else PROBE_LRS[0]
    return {"lr": best if finite.get(best, math.inf) < kl_0 else PROBE_LRS[0], "kl_0": kl_0, "kl_after": kl_after}


def set_peak_lr(run, lr: float) -> None:
    """Make `lr` the run's peak LR (its schedule is a pure function of the config: `schedule.lr_at`)."""
    run.cfg = run.cfg.replace(learning_rate=lr)


HEAL_TARGET = 0.2
"""Nats/token above the base that a heal aims at: the heal report's tokens-to-target counts the heal tokens
until the measured loss first reaches base + HEAL_TARGET."""


def heal_converted(model, spec: ConvertSpec, log=log_line, measure=None, base_loss: float | None = None) -> dict:
    """`--heal-steps` steps of the revffn method's stage 1 on the converted `model`, through the training loop's
    step (`build_run` / `train_step`), at `--heal-lr` or, with auto, at `probe_heal_lr`'s; returns the heal report.
    `measure` (with `--heal-eval-steps`): the held-out loss, taken every that many steps into the report's
    `curve` ([step, heal tokens, loss]) and `tokens_to_target` (with `base_loss`: the heal tokens until the loss
    first reaches base + HEAL_TARGET; None: not reached).
    A heal whose KL turns non-finite, or ends at more than 1.5x where it started, is an error naming --heal-lr
    (nothing is written)."""
    device = next(model.parameters()).device
    run = build_run(heal_config(spec, spec.heal_lr or PROBE_LRS[-1]), device, hf=model)
    probe = None
    if spec.heal_lr is None:
        probe = probe_heal_lr(run)
        set_peak_lr(run, probe["lr"])
        log(f"--heal-lr auto: {probe['lr']:g} (KL {probe['kl_0']:.4f} on the second heal batch; after one "
            "AdamW-sized step " + ", ".join(f"{lr:g}: {kl:.3g}" for lr, kl in probe["kl_after"].items()) + ")")
    lr = run.cfg.learning_rate
    log(f"healing the adapters: {spec.heal_steps} steps x {spec.heal_batch_size} x 128 tokens of {spec.heal_data}, "
        f"lr {lr:g} (warm-up {run.cfg.warmup_steps} steps)")
    t0, kls, tokens, curve = time.perf_counter(), [], 0, []
    every = max(1, min(50, spec.heal_steps // 10))  # a log line per tenth of the heal, at most every 50 steps
    with progress("heal", "step", spec.heal_steps) as bar:
        for step in range(spec.heal_steps):
            result = train_step(run, step, [])
            kl = float(result.loss_sum) / max(result.n_tokens, 1)
            if not math.isfinite(kl):
                raise UserError(f"--heal-lr: the heal diverged at step {step + 1} (KL {kl}). Nothing was written. "
                                f"Fix: a lower --heal-lr (e.g. {lr / 4:g}), or --heal-lr auto.")
            kls.append(kl)
            tokens += result.n_tokens
            bar(step + 1, spec.heal_steps, f"KL {kl:.3f}")
            if (step + 1) % every == 0:
                log(f"heal step {step + 1}/{spec.heal_steps}: KL {sum(kls[-every:]) / every:.4f}")
            if measure is not None and ((step + 1) % spec.heal_eval_steps == 0 or step + 1 == spec.heal_steps):
                curve.append([step + 1, tokens, measure()])
                log(f"heal step {step + 1}: held-out loss {curve[-1][2]:.4f} after {tokens:,} heal tokens")
    model.eval()
    model.reversible = run.method.reversible  # (the plain twin ran a heal with --heal-hidden-coef)
    tail = kls[-10:]
    report = {"steps": spec.heal_steps, "lr": lr, "warmup_steps": run.cfg.warmup_steps, "lr_probe": probe,
              "train_norms": spec.heal_norms,
              "hidden_coef": spec.heal_hidden_coef, "kl_first": kls[0], "kl_max": max(kls),
              "kl_last": sum(tail) / len(tail), "kl": [round(k, 5) for k in kls], "tokens": tokens,
              "wall_s": round(time.perf_counter() - t0, 2), "data": spec.heal_data,
              "batch_size": spec.heal_batch_size, "peak_rss_bytes": peak_rss_bytes(), **gpu_peak(model)}
    if measure is not None:
        target = None if base_loss is None else base_loss + HEAL_TARGET
        report.update(curve=curve, target=target, tokens_to_target=next(
            (t for _, t, loss in curve if target is not None and loss <= target), None))
    log(f"healed in {report['wall_s']:.1f} s: KL {report['kl_first']:.4f} -> {report['kl_last']:.4f} (max "
        f"{report['kl_max']:.4f})")
    k = 5  # a heal of 10 steps or more is judged by its last 5 steps' mean (one batch's KL varies by ~1.5x)
    if len(kls) >= 2 * k and sum(kls[-k:]) / k > 1.5 * kls[0]:
        raise UserError(f"--heal-lr: the heal diverged (KL {kls[0]:.4f} at its first step, a mean of "
                        f"{sum(kls[-k:]) / k:.4f} over its last {k}). Nothing was written. Fix: a lower --heal-lr "
                        f"(e.g. {lr / 4:g}), or --heal-lr auto.")
    return report


def _write(model, tokenizer, out: Path, manifest: dict) -> None:
    """The model directory, written aside and renamed into place (`models.cache.staged_dir`)."""
    from revffn.models.cache import staged_dir

    with staged_dir(out) as tmp:
        save_converted(model, tmp)
        tokenizer.save_pretrained(tmp)
        save_generation_config(tmp, tokenizer)
        write_manifest(tmp, **manifest)
