"""`revffn archs`: the architecture sweep. Every HF causal LM, MoE and dense, tiny, trained one step both ways.

For each model type of `model_families()` (family `moe`: the config has an MoE key; `dense`: every
other causal-LM type): build the tiny model (`tiny_model_for`: fp32, seed 0, every dropout /
jitter key > 0), `convert()` it, and run one batch (2 x 16 tokens, the last row
padded) in train mode twice from the same RNG seed: the plain twin (`model.reversible = False`),
then the reversible stack. Loss and EVERY parameter gradient are compared (max relative error per
parameter, floored as `revffn check` does: `reports.check.grad_error`). Status:

    exact        max relative grad error <= 1e-5 and equal loss, and nothing of the HF model left out;
                 an fp32 error up to 1e-3 counts when the same setting with fp64 residual streams is
                 <= 1e-5: it is the rounding of rebuilding X_1 = Y_1 - F(X_2) in fp32 when the
                 branch output dwarfs the stream (`fp32_rounding`, `fp64_stream_error`)
    wrong        a silent error: the reversible gradients differ (the worst outcome)
    unfaithful   exact against the plain twin, but the converted model silently leaves out part of
                 the HF one (a post-norm, a multiplier, a residual weight: see the gaps below)
    refused      convert (or the forward) raised a UserError; its message is the reason
    crash        any other exception (type, message, where), or the time limit
    build-error  the tiny model itself could not be built

Diagnostics, never part of the status: `rng_used` (the plain forward drew from the CPU generator)
against `rng_replayed` (the engine records RNG state), per randomness setting (`variants`);
`discrete_ops_unrecorded` (top-k / argmax / sort / max-with-dim / sampling calls on values in the
reversible forward that the engine did not record: choices the backward would take afresh);
`layer_gap`, `embed_gap`, `logits_gap` (see `layout_gaps`); `no_grad` (trainable parameters the
converted model never uses, beyond those the HF model itself leaves without gradient).

    revffn archs --out docs/architectures.md --json-out archs.json
    revffn archs --types mixtral,jamba,llama --json
"""

from __future__ import annotations

import contextlib
import math
import platform
import re
import signal
import sys
import threading
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode

from revffn.archs.architectures import spec_for
from revffn.archs.layout import check_convertible, logits_transform, reference_layer
from revffn.archs.spec import config_value, get_path
from revffn.conversion.convert import convert
from revffn.conversion.loss import head_logits
from revffn.errors import UserError
from revffn.models.tiny_any import STOCHASTIC, model_families, stochastic_keys, tiny_model_for
from revffn.reports.check import grad_error, make_batch

TOL = 1e-5
BATCH, SEQ = 2, 16
DISCRETE = (torch.topk, torch.Tensor.topk, torch.argmax, torch.Tensor.argmax, torch.argsort, torch.Tensor.argsort,
            torch.sort, torch.Tensor.sort, torch.multinomial, torch.Tensor.multinomial)
WITH_DIM = (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)  # with a dim they return indices
STATUSES = ("exact", "wrong", "unfaithful", "refused", "crash", "build-error")
FAMILIES = ("moe", "dense")
GAPS = ("layer_gap", "embed_gap", "logits_gap")
GAP_TOL = 1e-4  # fp32 recomputation of the same ops agrees to ~1e-6
ROUNDING_TOL = 1e-3  # above TOL but below this, fp32 streams are rechecked as fp64 (see _run)
THREADS = 1  # torch intra-op threads during the sweep (see run_archs)


class SweepTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise `SweepTimeout` in the body after `seconds` (main thread only; elsewhere no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise SweepTimeout(f"over the {seconds:g} s limit")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _where(exc: BaseException, revffn_only: bool = False) -> str:
    """file:line of the innermost frame (the op that raised), or of the innermost revffn frame."""
    tb = [f for f in traceback.extract_tb(exc.__traceback__)
          if f.filename != __file__ and (not revffn_only or "/revffn/" in f.filename)]
    if not tb:
        return ""
    f = tb[-1]
    path = f.filename.split("site-packages/")[-1].split("/revffn/")[-1]
    return f"{path}:{f.lineno} ({f.name})"


class DiscreteOps(TorchFunctionMode):
    """Counts the index-choosing ops (top-k, argmax, sort, sampling) on values that a reversible
    forward makes without the engine recording them: decisions the backward recomputation would take
    afresh on a rebuilt input, where a near-tie can flip.

    It sits below the engine's recording mode (`reversible.replay`), which re-issues every call it
    records from its own frame; calls from revffn's frames (those, and the load-balancing count) are
    not counted, so what remains was made outside any recorded sub-block."""

    def __init__(self):
        super().__init__()
        self.outside = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with_dim = len(args) > 1 and isinstance(args[1], int) or "dim" in kwargs
        chooses = func in DISCRETE or (func in WITH_DIM and with_dim)
        if (chooses and args and torch.is_tensor(args[0]) and args[0].is_floating_point()
                and "/revffn/" not in sys._getframe(1).f_code.co_filename):
            self.outside += 1  # a choice made on values (sorting expert indices is not one)
        return func(*args, **kwargs)


def _step(model, ids, mask, labels, reversible: bool, seed: int, count_discrete: bool = False):
    """One forward + backward from `seed`; returns loss, grads, whether the CPU generator was used,
    and (count_discrete) the index-choosing ops on values the engine did not record."""
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    torch.manual_seed(seed)
    before = torch.get_rng_state()
    counter = DiscreteOps() if count_discrete else contextlib.nullcontext()
    with counter:
        out = model(ids, attention_mask=mask, labels=labels, return_logits=False)
    rng_used = not torch.equal(before, torch.get_rng_state())
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), grads, rng_used, (counter.outside if count_discrete else None)


def _pattern(name: str) -> str:
    """'hf.model.layers.1.base_layer.post_feedforward_layernorm.weight' -> 'post_feedforward_layernorm.weight'
    (the same for the unconverted 'model.layers.1.post_feedforward_layernorm.weight')."""
    name = re.sub(r"\.\d+(\.|$)", r".*\1", name).removeprefix("hf.")
    return name.split(".*.", 1)[-1].removeprefix("base_layer.")


def layout_gaps(hf, spec, ids, mask) -> dict[str, float | None]:
    """How far the HF model is from what the converted one computes around its streams, at full
    width in eval mode, as max |ref - hf| / max |hf|; 0 when nothing is left out:

    - layer_gap: every decoder layer against what its spec says it computes (`layout.reference_layer`:
      h + a + mlp_branch(h + a), a = attn_branch(h), with post-norms, multipliers, ...), with the
      kwargs HF passed it (F and G at full width);
    - embed_gap: the first layer's input against `spec.embed(ids)` (times the embedding multiplier);
    - logits_gap: HF's logits against the head on `spec.final_norm(last layer's output)`, scaled and
      soft-capped as the spec says (`layout.logits_transform`).
    None where not measurable (the reference itself fails).
    """
    layers = get_path(hf, spec.layers)
    seen: list = []
    config = hf.config

    def hook(module, args, kwargs, output):
        h = args[0] if args else kwargs.get("hidden_states")
        seen.append((module, h, kwargs, output[0] if isinstance(output, tuple) else output))

    def rel(ref, y) -> float:
        return ((ref - y).abs().max() / y.abs().max().clamp(min=1e-30)).item()

    def reference(layer, h, kw):
        return reference_layer(layer, spec, config, h, kw.get("position_embeddings"), kw.get("attention_mask"))

    def embed(ids):
        return get_path(hf, spec.embed)(ids) * float(config_value(config, spec.embed_scale_key, 1.0))

    def head(last):
        return head_logits(get_path(hf, spec.final_norm)(last), get_path(hf, spec.head),
                           *logits_transform(spec, config))

    gaps: dict[str, float | None] = {"layer_gap": None, "embed_gap": None, "logits_gap": None}
    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    was_training = hf.training
    try:
        hf.eval()
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for key, fn in (("embed_gap", lambda: rel(embed(ids), seen[0][1])),
                            ("logits_gap", lambda: rel(head(seen[-1][3]), logits)),
                            ("layer_gap", lambda: max(rel(reference(m, h, kw), y) for m, h, kw, y in seen))):
                with contextlib.suppress(Exception):
                    gaps[key] = fn()
    except Exception:
        pass
    finally:
        for handle in handles:
            handle.remove()
        hf.train(was_training)
    return gaps


def sweep_one(model_type: str, seed: int = 0, batch: int = BATCH, seq: int = SEQ, timeout: float | None = 60.0,
              diagnose: bool = True) -> dict:
    """Build, convert and compare one model type; never raises (see module docstring)."""
    row = {"model_type": model_type, "family": model_families().get(model_type), "status": None,
           "max_rel_grad_error": None, "worst_param": None, "loss_diff": None, "reason": "", "stage": "build",
           "seconds": None}
    t0 = time.perf_counter()
    try:
        with time_limit(timeout):
            _run(row, model_type, seed, batch, seq, diagnose)
    except UserError as e:
        row.update(status="refused", reason=str(e))
    except Exception as e:  # noqa: BLE001 - every failure is a result
        status = "build-error" if row["stage"] == "build" else "crash"
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        row.update(status=status, reason=f"{type(e).__name__}: {msg}", where=_where(e), revffn_frame=_where(e, True))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def variants(model_type: str) -> dict[str, float | dict[str, float]]:
    """The randomness settings each type is compared under: every keyed dropout / jitter on, each
    key alone (when there are several), and none (randomness that no config key controls)."""
    keys = stochastic_keys(model_type)
    out: dict = {"all": STOCHASTIC}
    if len(keys) > 1:
        out.update({k: {k: STOCHASTIC} for k in keys})
    if keys:
        out["none"] = 0.0
    return out


def _run(row: dict, model_type: str, seed: int, batch: int, seq: int, diagnose: bool) -> None:
    settings = variants(model_type)
    hf = tiny_model_for(model_type, seed=seed)
    hf.train()
    row["hf_class"] = type(hf).__name__
    row["layers"] = getattr(hf.config, "num_hidden_layers", None)
    ids, mask, labels = make_batch(hf.config.get_text_config().vocab_size, batch, seq, seed)  # (a wrapper's)
    row["stage"] = "convert"
    spec = spec_for(hf)  # the UserErrors convert would raise, before the probes below
    check_convertible(hf, spec)
    if diagnose:
        row.update(layout_gaps(hf, spec, ids, mask))
        row["hf_no_grad"] = _hf_no_grad(hf, ids, mask, labels)
    row["variants"] = {}
    for name, stochastic in settings.items():
        if name != "all":
            row["stage"] = f"build ({name})"
            hf = tiny_model_for(model_type, seed=seed, stochastic=stochastic)
        row["stage"] = "convert" if name == "all" else f"convert ({name})"
        model = convert(hf)
        model.train()
        row["stage"] = "plain" if name == "all" else f"plain ({name})"
        loss_plain, g_plain, rng_used, _ = _step(model, ids, mask, labels, False, seed)
        if not (math.isfinite(loss_plain) and all(torch.isfinite(g).all() for g in g_plain.values())):
            raise FloatingPointError(f"the plain twin's loss or gradients are not finite (loss {loss_plain})")
        if name == "all":
            row["router_taps"] = sum(getattr(b, "router_tap", None) is not None for b in model.blocks)
            no_grad = {_pattern(n) for n, p in model.named_parameters() if p.requires_grad and n not in g_plain}
            row["no_grad"] = sorted(no_grad - set(row.get("hf_no_grad") or ()))
        row["stage"] = "reversible" if name == "all" else f"reversible ({name})"
        loss_rev, g_rev, _, discrete = _step(model, ids, mask, labels, True, seed, name == "all")
        if name == "all":
            row["discrete_ops_unrecorded"] = discrete
        err, worst = grad_error(g_plain, g_rev)
        row["variants"][name] = {"max_rel_grad_error": err, "worst_param": worst and _pattern(worst),
                                 "loss_diff": abs(loss_rev - loss_plain), "rng_used": rng_used,
                                 "rng_replayed": getattr(model, "has_dropout", None)}  # None: the engine decides
        del model, hf  # the next setting builds its own
    row["stage"] = "compare"
    for name, v in row["variants"].items():
        if TOL < v["max_rel_grad_error"] <= ROUNDING_TOL and v["loss_diff"] <= TOL:
            # fp32 streams lose the low bits of X_1 = Y_1 - F(X_2) when |F| >> |X_1| (a post-normed
            # branch on a tiny random model's 0.02-scale embeddings); fp64 streams rebuild X exactly,
            # so the same setting there separates that rounding from a real error (unreplayed noise
            # stays wrong)
            row["stage"] = f"reversible fp64 streams ({name})"
            v["fp64_stream_error"] = _stream_fp64_error(model_type, seed, settings[name], ids, mask, labels)
    row["stage"] = "compare"

    def judged(v: dict) -> float:  # the fp32 error, or the fp64 one where that separated rounding out
        fp64 = v.get("fp64_stream_error")
        return fp64 if fp64 is not None and fp64 <= TOL else v["max_rel_grad_error"]

    name, worst = max(row["variants"].items(), key=lambda kv: (judged(kv[1]), kv[1]["loss_diff"]))
    row.update(max_rel_grad_error=max(v["max_rel_grad_error"] for v in row["variants"].values()),
               worst_param=worst["worst_param"], loss_diff=max(v["loss_diff"] for v in row["variants"].values()))
    rounding = [v for v in row["variants"].values() if judged(v) != v["max_rel_grad_error"]]
    if rounding:
        row["fp32_rounding"] = max(v["max_rel_grad_error"] for v in rounding)
        row["fp64_stream_error"] = max(v["fp64_stream_error"] for v in rounding)
    worst = {**worst, "max_rel_grad_error": judged(worst)}
    if worst["max_rel_grad_error"] <= TOL and row["loss_diff"] <= TOL:
        left_out = [f"{k} {row[k]:.2g}" for k in GAPS if (row.get(k) or 0) > GAP_TOL]
        left_out += [f"no gradient for {', '.join(row['no_grad'])}"] if row.get("no_grad") else []
        if left_out:
            row["status"] = "unfaithful"
            row["reason"] = "exact against its plain twin, but the converted model leaves out part of the HF one: " \
                            + "; ".join(left_out)
        else:
            row["status"] = "exact"
        return
    row["status"] = "wrong"
    what = "every key on" if name == "all" else "no dropout / jitter key on" if name == "none" else f"only {name} on"
    row["reason"] = f"with {what}: gradient of {worst['worst_param']} off by {worst['max_rel_grad_error']:.3g}"
    if worst["rng_used"] and worst["rng_replayed"] is False:
        row["reason"] += " (the forward drew random numbers; the engine did not replay them)"


def compare(model, ids, mask, labels, seed: int = 0) -> tuple[float, str | None, float]:
    """One training step of a converted `model` as the plain twin and reversibly, from the same seed:
    (max relative gradient error, its parameter, |loss difference|)."""
    model.train()
    loss_plain, g_plain, _, _ = _step(model, ids, mask, labels, False, seed)
    loss_rev, g_rev, _, _ = _step(model, ids, mask, labels, True, seed)
    err, worst = grad_error(g_plain, g_rev)
    return err, worst, abs(loss_rev - loss_plain)


def _stream_fp64_error(model_type: str, seed: int, stochastic, ids, mask, labels) -> float:
    """The reversible-vs-plain gradient error of one randomness setting with fp64 residual streams."""
    model = convert(tiny_model_for(model_type, seed=seed, stochastic=stochastic), stream_dtype=torch.float64)
    return compare(model, ids, mask, labels, seed)[0]


def _hf_no_grad(hf, ids, mask, labels) -> list[str] | None:
    """Trainable parameters without a gradient in the unconverted model (e.g. a detached indexer)."""
    try:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        out = sorted({_pattern(n) for n, p in hf.named_parameters() if p.requires_grad and p.grad is None})
        hf.zero_grad(set_to_none=True)
        return out
    except Exception:
        return None


def run_archs(types: list[str] | None = None, seed: int = 0, timeout: float | None = 60.0, diagnose: bool = True,
              argv: list[str] | None = None, progress=None) -> dict:
    """Sweep `types` (default: every causal-LM type, MoE then dense); the archs.json document, with
    `counts` per status over all rows and `family_counts` per family."""
    import transformers

    from revffn.reports.bench import _git

    if not types:
        families = model_families()
        types = [mt for family in FAMILIES for mt, f in families.items() if f == family]
    t0 = time.perf_counter()
    rows = []
    before = torch.get_num_threads()
    # tiny models: per-op overhead dominates, so one intra-op thread is fastest, and it stays fast
    # when another process holds a core (two threads on one free core are several times slower)
    torch.set_num_threads(THREADS)
    try:
        for i, mt in enumerate(types, 1):
            with torch.random.fork_rng(devices=[]):
                rows.append(sweep_one(mt, seed=seed, timeout=timeout, diagnose=diagnose))
            if progress is not None:
                progress(i, len(types), rows[-1])
    finally:
        torch.set_num_threads(before)
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    family_counts = {family: {s: sum(r["status"] == s for r in rows if r["family"] == family) for s in STATUSES}
                     for family in FAMILIES}
    return {
        "run_info": {"command": " ".join(["revffn", *argv]) if argv is not None else None, "seed": seed,
                     "batch": BATCH, "seq": SEQ, "tolerance": TOL, "timeout_s": timeout, "git_commit": _git("rev-parse",
                     "HEAD"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "wall_s": round(time.perf_counter() - t0, 1)},
        "meta_info": {"python": platform.python_version(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "torch_threads": THREADS},
        "counts": counts,
        "family_counts": family_counts,
        "results": rows,
    }
