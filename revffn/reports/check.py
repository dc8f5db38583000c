"""`revffn check`: is the reversible backward exact for this model?

Build or load a model, convert it, run forward and backward on one batch twice, reversible and
plain twin, and compare: rebuilt layer inputs against the cached ones, gradients against the
plain twin (and, for bf16, both against an fp32 run on the same weights), saved bytes for
backward (activations, choice records and RNG records apart), routing flips. Exit code 0
passed, 1 over tolerance, 2 bad input.

The gradient error is per parameter, relative, with its denominator floored at 1e-3 x the largest
parameter-gradient norm (`grad_error`): a gradient that is zero up to rounding is not judged on
its noise. With fp32 streams, an error above the tolerances but within `ROUNDING_TOL` (the
reconstruction relative to the largest stream value, `stream_scale`) is rechecked with fp64 streams, which
decide: a real model's large activations round by more than a tiny model's. `routing_record_bytes`
counts the indices of every recorded choice (router top-k,
indexer top-k, max ...), `rng_record_bytes` the RNG states.

    revffn check --model tiny-qwen2-moe --layers 4 --json
"""

from __future__ import annotations

import copy
import math

import torch

from revffn.conversion.convert import AUTO, convert, describe_streams, pick_stream_dtype
from revffn.memory.measure import saved_bytes_of_stack
from revffn.reversible.buffered import DEFAULT_MOMENTUM, deterministic_kernels

TOL = {"max_rel_grad_error": 1e-5, "max_reconstruction_error": 1e-4, "err_ratio_vs_fp32": 1.25}
# fp32 streams of a real model: activations in the hundreds (SmolLM2's massive activations) round by more
# than the tiny models' absolute tolerances. Up to ROUNDING_TOL the fp32 error passes when the same check
# with fp64 streams is within TOL, as in `revffn archs`: the math is exact, the error is fp32 rounding.
# Full-width streams both carry the massive coordinates (SmolLM2-MoE, 4 layers: max |X| 1106, relative gradient
# error 2.2e-3 in fp32, 1.5e-8 with fp64 streams; half width: 472, 1.1e-3).
ROUNDING_TOL = {"max_rel_grad_error": 1e-2, "max_reconstruction_error": 1e-5}  # the latter relative to max |X|
GRAD_FLOOR = 1e-3  # relative to the largest parameter-gradient norm; see grad_error


def make_batch(vocab: int, batch: int, seq: int, seed: int):
    """Random tokens; the last row is right-padded over its final quarter (masks get exercised)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1 and seq >= 4:
        mask[-1, seq - seq // 4 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _step(model, ids, mask, labels, reversible: bool, probe_store: dict | None, seed: int):
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    torch.manual_seed(seed)  # every run draws the same dropout / jitter: the comparison is of one function
    probe = None
    if probe_store is not None:
        def probe(i, X_1, X_2):
            probe_store[i] = (X_1.detach().float().clone(), X_2.detach().float().clone())
    with saved_bytes_of_stack(model) as log:
        out = model(ids, attention_mask=mask, labels=labels, return_logits=False, probe=probe)
    stats = model.last_stack_stats
    saved = log.stack_bytes(stats)  # routing and RNG records apart
    records = {"routing": stats.get("record_bytes", 0), "rng": stats.get("rng_bytes", 0)}
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), grads, saved, records


def grad_error(g_plain: dict, g_rev: dict) -> tuple[float, str | None]:
    """Max over parameters of ||g_rev - g_plain|| / max(||g_plain||, GRAD_FLOOR * largest ||g_plain||),
    and the worst parameter's name.

    The floor keeps a gradient that is zero up to rounding from being judged on its rounding noise:
    a top-1 router with renormalised weights (hunyuan_v1_moe) always weighs its expert 1, so its
    router gradient is ~1e-10 and any recomputation changes it by 100 %. An error that large relative
    to the model's largest gradient is still caught. A gradient present on one side only counts as
    an infinite error; NaN counts as the worst.
    """
    if set(g_plain) != set(g_rev):
        return math.inf, sorted(set(g_plain) ^ set(g_rev))[0]
    norms = {n: g.norm().item() for n, g in g_plain.items()}
    floor = GRAD_FLOOR * max(norms.values(), default=0.0)
    worst, name = 0.0, None
    for n in sorted(g_plain):
        den = max(norms[n], floor)
        diff = (g_rev[n] - g_plain[n]).norm().item()
        err = diff / den if den > 0 else diff
        if math.isnan(err):
            return err, n  # NaN is the worst there is
        if err > worst:
            worst, name = err, n
    return worst, name


def _flat(grads: dict, names) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1) for n in names])


def check_bytes(model: str, layers: int | None, hidden: int | None, dtype: str, batch: int,
                seq: int) -> tuple[int, int] | None:
    """The check's peak, at least (`run_check` holds more), in two parts: the models (the fp32 model and its
    converted copy, their parameters counted on the meta device) and one plain-autograd step's activations and
    logits (`revffn estimate`'s, of `full` in the check's dtype; 0 for a layout the estimate does not model).
    None where transformers cannot build the config on the meta device: the check builds it its own way."""
    from revffn.archs.spec import meta_params
    from revffn.memory.estimate import estimate
    from revffn.methods import method_class
    from revffn.models.loading import config_overrides, hf_config

    config = hf_config(model, **config_overrides(model, layers, hidden, shipped_vocab=False))
    low = dtype in ("bfloat16", "bf16")
    try:
        models = meta_params(config) * (4 + (2 if low else 4))
    except Exception:
        return None
    try:
        est = estimate(config, method_class("full"), batch, seq, "bfloat16" if low else "float32")
    except Exception:  # (a floor: what the estimate cannot say is left out, never an error of the check's own)
        return models, 0
    return models, est["activations"] + est["logits"]


def run_check(model: str = "tiny-qwen2-moe", layers: int | None = None, dtype: str = "float32", batch: int = 2,
              seq: int = 32, seed: int = 0, adapter_init: str = "coordinate",
              stream_dtype: torch.dtype | str = torch.float32, device: str = "cpu", hidden: int | None = None,
              stream_width: str = "full", coupling: str = "additive", buffer_momentum: str = DEFAULT_MOMENTUM) -> dict:
    """Run the consistency check; returns the report dict (see module docstring).

    `stream_dtype` "auto": what training picks (`pick_stream_dtype`, on the converted model), reported under
    "streams". `coupling` buffered: the decoder layers whole on fixed-point streams (no adapters; `adapter_init`,
    `stream_width` and `stream_dtype` do not apply), with `buffer_momentum` (positive | negative).

    `model` may also be a config-only preset (`qwen1.5-moe-a2.7b`, ...): random init at that geometry;
    `hidden` scales its widths (as `revffn bench --hidden`). `device`: cpu | cuda | auto."""
    from revffn.models.loading import build_hf, config_overrides

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if coupling == "buffered":
        deterministic_kernels(dev)  # before the first matmul
    overrides = config_overrides(model, layers, hidden, shipped_vocab=False)
    hf32 = build_hf(model, torch.float32, seed, dev, **overrides).to(dev)
    hf32.train()
    low = dtype in ("bfloat16", "bf16")
    if low:  # every model below shares the bf16-representable weights
        with torch.no_grad():
            for p in hf32.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    ids, mask, labels = (t.to(dev) for t in make_batch(hf32.config.vocab_size, batch, seq, seed))
    with torch.no_grad():
        loss_unconverted = hf32(input_ids=ids, attention_mask=mask, labels=labels).loss.item()

    auto = stream_dtype == AUTO
    conv = convert(copy.deepcopy(hf32).to(torch.bfloat16 if low else torch.float32), adapter_init=adapter_init,
                   stream_dtype=torch.float32 if auto else stream_dtype,
                   adapter_skip=True,  # the trained default: the skips' grads too
                   stream_width=stream_width, coupling=coupling, buffer_momentum=buffer_momentum)
    streams = pick_stream_dtype(conv) if auto and coupling == "additive" else None
    stream_dtype = conv.stream_dtype
    conv.train()
    conv.debug.track_routing_flips = True
    with torch.no_grad():
        conv.eval()
        loss_converted = conv(ids, attention_mask=mask, labels=labels, return_logits=False).loss.item()
        conv.train()

    cached, rebuilt = {}, {}
    loss_plain, g_plain, saved_plain, _ = _step(conv, ids, mask, labels, False, cached, seed)
    loss_rev, g_rev, saved_rev, records = _step(conv, ids, mask, labels, True, rebuilt, seed)
    flips = conv.routing_flips()

    recon = max(max((a - b).abs().max().item() for a, b in zip(cached[i], rebuilt[i])) for i in cached)
    scale = max(max(a.abs().max().item() for a in cached[i]) for i in cached)
    names = sorted(g_plain)
    rel, worst_param = grad_error(g_plain, g_rev)
    report = {
        "model": model, "model_type": hf32.config.model_type, "layers": hf32.config.num_hidden_layers,
        "device": str(dev),
        "dtype": "bfloat16" if low else "float32", "batch": batch, "seq": seq, "seed": seed,
        "adapter_init": adapter_init, "stream_dtype": str(stream_dtype).removeprefix("torch."),
        "stream_width": stream_width, "coupling": coupling, **({"streams": streams} if streams else {}),
        **({"buffer_momentum": buffer_momentum} if coupling == "buffered" else {}),
        "loss_unconverted": loss_unconverted, "loss_converted": loss_converted,
        "conversion_gap": loss_converted - loss_unconverted,
        "loss_reversible": loss_rev, "loss_plain": loss_plain,
        "max_reconstruction_error": recon, "max_rel_grad_error": rel, "worst_param": worst_param,
        "routing_flips": flips,
        "saved_bytes_reversible": saved_rev, "saved_bytes_plain": saved_plain,
        "routing_record_bytes": records["routing"], "rng_record_bytes": records["rng"],
    }
    if low:
        ref = convert(copy.deepcopy(hf32), adapter_init=adapter_init, adapter_skip=True, stream_width=stream_width,
                      coupling=coupling)
        ref.load_state_dict({k: v.float() for k, v in conv.state_dict().items()})
        ref.train()
        _, g_fp32, _, _ = _step(ref, ids, mask, labels, False, None, seed)
        truth = _flat(g_fp32, names)
        num = (_flat(g_rev, names) - truth).norm().item()
        den = (_flat(g_plain, names) - truth).norm().item()
        report["err_ratio_vs_fp32"] = num / den if den > 0 else (1.0 if num == 0 else math.inf)
        passed = report["err_ratio_vs_fp32"] <= TOL["err_ratio_vs_fp32"]
    else:
        passed = rel <= TOL["max_rel_grad_error"] and recon <= TOL["max_reconstruction_error"]
        rounding = (rel <= ROUNDING_TOL["max_rel_grad_error"]
                    and recon <= ROUNDING_TOL["max_reconstruction_error"] * scale)
        if not passed and rounding and stream_dtype == torch.float32 and coupling == "additive":
            exact = run_check(model, layers, dtype, batch, seq, seed, adapter_init, torch.float64, device, hidden,
                              stream_width)
            report["fp64_streams"] = {k: exact[k] for k in ("max_reconstruction_error", "max_rel_grad_error")}
            passed = exact["passed"]
        report["stream_scale"] = scale
    report["passed"] = bool(passed and math.isfinite(loss_converted) and math.isfinite(loss_rev))
    return report


def format_report(r: dict) -> str:
    lines = [f"revffn check: {r['model']} ({r['model_type']}), {r['layers']} layers, {r['dtype']}, "
             f"batch {r['batch']} x seq {r['seq']}, on {r.get('device', 'cpu')}, "
             + (f"adapter_init={r['adapter_init']}, {r['stream_dtype']} streams" if r.get("coupling", "additive")
                == "additive" else "the buffered coupling (int64 fixed-point streams)")]
    if "streams" in r:
        lines.append("  " + describe_streams(r["streams"]))
    keys = ["loss_unconverted", "loss_converted", "conversion_gap", "max_reconstruction_error",
            "max_rel_grad_error", "worst_param", "err_ratio_vs_fp32", "routing_flips", "saved_bytes_reversible",
            "saved_bytes_plain", "routing_record_bytes", "rng_record_bytes", "stream_scale"]
    for k in keys:
        if k in r:
            v = r[k]
            # bf16 is judged on err_ratio_vs_fp32 only; fp32 on the other two tolerances
            judged = (k == "err_ratio_vs_fp32") == (r["dtype"] == "bfloat16")
            tol = f"  (tolerance {TOL[k]:g})" if k in TOL and judged else ""
            if tol and "fp64_streams" in r and isinstance(v, float) and v > TOL[k]:  # judged again in fp64, below
                tol = f"  (tolerance {TOL[k]:g}: over by the fp32 streams' rounding, judged in fp64 below)"
            lines.append(f"  {k:<26} {v:.4g}{tol}" if isinstance(v, float) else f"  {k:<26} {v}{tol}")
    if "fp64_streams" in r:
        f = r["fp64_streams"]
        lines.append(f"  fp32 rounding: with fp64 streams, reconstruction {f['max_reconstruction_error']:.3g}, "
                     f"rel. grad error {f['max_rel_grad_error']:.3g} (tolerances {TOL['max_reconstruction_error']:g}, "
                     f"{TOL['max_rel_grad_error']:g})")
    lines.append("  PASSED" if r["passed"] else "  FAILED")
    return "\n".join(lines)
