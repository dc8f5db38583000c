"""Bytes one decoder layer saves for backward, by what needs a gradient (used by `estimate`).

Autograd saves a tensor only when a gradient that needs it will be computed: a Linear keeps its
input only if its weight trains, an RMSNorm keeps its fp32 input and 1/rms only if its input needs
a gradient and its normalised input only if its weight trains, and nothing is saved for a layer
whose input and weights all need no gradient. `Grad` says, per layer, what needs one; the functions
below follow transformers 5.x modules as they run (RMSNorm in fp32, SDPA, grouped_mm experts) and
peft 0.21-0.22 / revffn adapters, and are checked against `SavedTensorLog` on the tiny presets
(`tests/memory/test_estimate_agreement.py`).

`m` is the estimator's `Dims` (model geometry); sizes are bytes, `s` the weights' dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grad:
    """What needs a gradient in one layer's forward."""

    inp: bool = True  # the layer's input (the residual stream)
    w: bool = True  # its base weights: norms, attention, MLP / experts
    router: bool = True  # its router weight
    adapter: str = ""  # "", "lora", "dora", "refta": adapters on q/k/v/o (lora/dora: also MLP Linears, experts)
    rank: int = 16
    rewritten: bool = False  # peft retargets MLP Linear names to their weights (lora: ParamWrapper; dora: none)
    cast: bool = False  # adapters in fp32 on a bf16 model (peft): each adapted Linear casts its input


FULL = Grad()
FROZEN = Grad(inp=True, w=False, router=False)


def norm_saved(n: int, width: int, s: int, rows: int | None = None, inp: bool = True, w: bool = True) -> int:
    """RMSNorm (fp32 inside): fp32 input and 1/rms per row if the input needs a gradient, the
    normalised input in the model dtype if the weight trains."""
    return (n * width * 4 + 4 * (rows if rows is not None else n)) * inp + n * width * s * w


def adapter_saved(g: Grad, n: int, s: int, fan_in: int, fan_out: int) -> int:
    """What an adapter on one Linear (n rows) adds; its input is counted by the caller unless the
    adapter casts it to its own dtype (`g.cast`: then each adapter keeps its own copy).

    lora: the A output (n x r). refta: A x and G A x (n x r each). dora: the A output, the base and
    LoRA outputs (n x out each) and the magnitude scale; its weight-norm path (an in x in identity
    through A and B) is detached and freed within the forward."""
    r, a = g.rank, 4 if g.cast else s
    copy = n * fan_in * a * g.cast
    if g.adapter == "lora":
        return copy + n * r * a
    if g.adapter == "refta":
        return 2 * n * r * s
    if g.adapter == "dora":
        return copy + n * r * a + n * fan_out * (s + a) + 3 * fan_out * a
    return 0


def _keeps_input(g: Grad, how: str) -> bool:
    """Whether an adapted (or trained) Linear keeps its input in the model dtype."""
    return g.w or how == "param" or (how == "linear" and not g.cast)


def mlp_adapter(g: Grad) -> str:
    """How a gate/up/down Linear of a dense MLP or shared expert is adapted: '', 'linear' or 'param'."""
    if g.adapter not in ("lora", "dora"):
        return ""
    if g.rewritten:
        return "param" if g.adapter == "lora" else ""
    return "linear"


def mlp_saved(g: Grad, n: int, d: int, inter: int, s: int) -> int:
    """A gated MLP (gate/up/down) on n rows, its input excluded: gate out (SiLU input), act, up out;
    act*up (down's input) if down's weight or adapter needs it; adapter extras."""
    how = mlp_adapter(g)
    total = 3 * n * inter * s + n * inter * s * _keeps_input(g, how)
    if how == "linear":
        total += sum(adapter_saved(g, n, s, fi, fo) for fi, fo in ((d, inter), (d, inter), (inter, d)))
    elif how == "param":  # ParamWrapper: W + BA materialised per forward, kept for the input gradient
        total += 3 * d * inter * s + 3 * g.rank * (d + inter) * s * g.cast  # (+ A, B cast to the model dtype)
    return total


def attn_saved(m, B: int, T: int, s: int, padded: bool, impl: str, g: Grad = FULL) -> int:
    """input_layernorm + attention, up to o_proj (its input is the attention output)."""
    N, q, kvn = B * T, B * T * m.heads * m.hd, B * T * m.kv * m.hd
    ad = bool(g.adapter)  # every adapter targets q/k/v/o
    keep = g.w or (ad and not g.cast)
    total = norm_saved(N, m.d, s, inp=g.inp, w=g.w)
    total += N * m.d * s * keep  # the norm output: q/k/v input
    if not (g.inp or g.w or ad):
        return total
    if m.qk_norm == "head":
        total += norm_saved(N * m.heads, m.hd, s, w=g.w) + norm_saved(N * m.kv, m.hd, s, w=g.w)
    elif m.qk_norm == "full":
        total += norm_saved(N, m.heads * m.hd, s, w=g.w) + norm_saved(N, m.kv * m.hd, s, w=g.w)
    if impl == "eager":  # q, k, v repeated to all heads; probs in fp32 (+ the cast); o_proj input copy
        probs = B * m.heads * T * T
        total += 3 * q * s + probs * (4 + (s if s != 4 else 0)) + probs * (m.attn_dropout > 0)
        o_in = q * s
    else:  # SDPA: q, k, v, out, logsumexp; k/v repeated and the float mask kept when a mask is given
        kv = q if padded else kvn
        total += 2 * q * s + 2 * kv * s + 4 * B * m.heads * T + (B * T * T * s if padded else 0)
        o_in = q * s if m.partial_rope else 0  # out not in (B, T, H, hd) layout: o_proj copies it
    total += o_in * keep
    qd, kd = m.heads * m.hd, m.kv * m.hd
    return total + sum(adapter_saved(g, N, s, fi, fo) for fi, fo in ((m.d, qd), (m.d, kd), (m.d, kd), (qd, m.d)))


def router_saved(m, N: int, s: int, trains: bool = True) -> int:
    E, k = m.experts, m.top_k
    if m.router == "sigmoid_group":  # fp32 logits input, sigmoid, group top-2, group mask, top-k
        gr, tg = m.groups
        return N * m.d * 4 * (s != 4) * trains + N * E * 5 + N * gr * 16 + N * tg * 8 + N * k * 12 + N * 4
    return N * E * 4 + N * k * 8 + (N * k * 4 + N * 4 if m.norm_topk else 0)  # probs, top-k (+ renorm)


def ffn_saved(m, i: int, B: int, T: int, s: int, g: Grad = FULL) -> int:
    """post_attention_layernorm + MoE block (router, grouped_mm experts, shared expert) or dense MLP."""
    N = B * T
    inp = g.inp or g.w or bool(g.adapter)  # the residual plus the attention output
    total = norm_saved(N, m.d, s, inp=inp, w=g.w)
    how = mlp_adapter(g)
    if not m.moe[i]:
        return total + N * m.d * s * _keeps_input(g, how) + mlp_saved(g, N, m.d, m.dense_inter, s)
    shared = m.shared_inter > 0
    total += N * m.d * s * (g.router or (shared and _keeps_input(g, how)))  # the MoE input, kept by its Linears
    S, inter = N * m.top_k, m.moe_inter
    w_exp = g.w or g.adapter == "lora"  # lora adapts every expert through a materialised W + BA
    # gate_up out, act, down out; gathered inputs and act*up if the experts' weights need grads;
    # routing weights, 3 int64 index tensors, offsets
    total += router_saved(m, N, s, g.router) + S * (m.d + 3 * inter) * s + S * (m.d + inter) * s * w_exp
    total += S * (4 + 24) + m.experts * 4
    if g.adapter == "lora":  # W + BA of gate_up and down (+ A, B cast to the model dtype)
        total += m.experts * 3 * m.d * inter * s + m.experts * g.rank * (2 * m.d + 3 * inter) * s * g.cast
    if shared:
        total += mlp_saved(g, N, m.d, m.shared_inter, s) + (N * m.d * s + N * s if m.shared_gate else 0)
    return total


def layer_saved(m, i: int, B: int, T: int, s: int, padded: bool, impl: str, g: Grad | None = FULL) -> int:
    """One decoder layer; 0 when nothing in it needs a gradient (`g` None)."""
    if g is None:
        return 0
    return attn_saved(m, B, T, s, padded, impl, g) + ffn_saved(m, i, B, T, s, g)


def outside_saved(m, B: int, T: int, s: int, embed: bool = True, final_inp: bool = True,
                  final_w: bool = True) -> int:
    """Token ids (if the embedding trains), RoPE cos/sin, final norm, the loss's (B*(T-1), d) hidden
    copy and its labels."""
    rows = B * (T - 1)
    return (B * T * 8 * embed + 2 * T * m.rope_dim * s + norm_saved(B * T, m.d, s, inp=final_inp, w=final_w)
            + rows * m.d * s + rows * 8)


def aux_saved(m, N: int, layers: int) -> int:
    """The load-balancing loss of an unconverted model with a trainable router: softmax(logits) of
    each MoE layer whose logits need a gradient, and the row mask."""
    return (layers * N * m.experts * 4 + N * 4) if m.aux and layers else 0


def hift_saved(m, B: int, T: int, s: int, padded: bool, impl: str, group_size: int) -> int:
    """HiFT's peak over its groups: units [embedding, layer 0..L-1, head]; the active group trains,
    layers above its lowest unit pass gradients through frozen weights, layers below save nothing."""
    L, best = m.layers, 0
    for start in range(0, L + 2, group_size):
        group = set(range(start, min(start + group_size, L + 2)))
        lo, total, aux_layers = start, 0, 0
        for i in range(L):
            u = i + 1
            g = Grad(inp=lo < u) if u in group else FROZEN if u > lo else None
            total += layer_saved(m, i, B, T, s, padded, impl, g)
            aux_layers += m.moe[i] and g is not None
        routers_train = any(1 <= u <= L for u in group)
        total += aux_saved(m, B * T, aux_layers if routers_train else 0)
        total += outside_saved(m, B, T, s, embed=0 in group, final_inp=lo < L + 1, final_w=L + 1 in group)
        best = max(best, total)
    return best
