"""Sparse upcycling (Komatsuzaki et al. 2022): a dense Llama / Mistral / Qwen2 model becomes an MoE that
equals it at init, checked.

Each dense MLP is copied into E identical experts of a `MixtralForCausalLM` or `Qwen2MoeForCausalLM`;
the router is small and random (std 0.02, seeded). With top-k routing renormalized to sum to 1, the MoE
output is sum_k w_k * MLP(x) = MLP(x) whatever the router chooses, so the model equals the dense one up to
float rounding. Attention, norms, embeddings and head are copied unchanged.

    revffn upcycle builtin:smollm2 --experts 4 --top-k 2 --out runs/smollm2-moe

What can be exact is checked before anything is written, and what was built is measured:

- refused (`UserError`): an MoE as input, a source type other than llama / mistral / qwen2, E < 2 or
  top-k outside 1..E, a target that lacks one of the source's parameters (Qwen2's q/k/v biases in
  Mixtral, a Llama with `attention_bias` or `mlp_bias`), a config key of the source the target cannot
  express (a sliding window in a target without one);
- measured: the max |logit difference| against the dense model on a fixed batch (fp32), written into
  `DIR/revffn.json`; above `TOLERANCE` the directory is not written. Without renormalized top-k routing
  (`renormalize=False`, Qwen2-MoE's `norm_topk_prob: false`) the weights of the k chosen experts sum to
  less than 1 and this check refuses the result.

Qwen2-MoE always has a shared expert behind a sigmoid gate; it is built I/E wide with a zero down
projection, so it adds exactly 0 at init and learns from there. The q/k/v biases Qwen2-MoE always has
start at 0 for a source without them.

Anchor: mergekit's `mergekit-moe` builds the same kind of model (Mixtral, from several dense models) but
neither checks nor reports that the result equals its source.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from revffn.archs.architectures import has_moe_keys
from revffn.archs.spec import meta_params
from revffn.errors import UserError
from revffn.progress import progress

SOURCES = ("llama", "mistral", "qwen2")
TARGETS = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig"}
TOLERANCE = 1e-4  # max |Δlogit|, fp32
ROUTER_STD = 0.02
# config keys never carried over from the source: bookkeeping, or set by the upcycle itself
_SKIP_KEYS = {"model_type", "architectures", "transformers_version", "_name_or_path", "dtype", "id2label",
              "label2id", "intermediate_size", "quantization_config", "auto_map"}
# source keys whose value decides attention or the MLP; a target config without them could not express them
_ACTIVE_KEYS = {"attention_bias": False, "mlp_bias": False, "sliding_window": None, "use_sliding_window": False}
_MLP = ("gate_proj", "up_proj", "down_proj")


def check_upcycle(config, experts: int, top_k: int, arch: str, key: str = "model") -> None:
    """Refuse what cannot equal the dense model at init (see the module docstring), before any weight is read."""
    mt = config.model_type
    if arch not in TARGETS:
        raise UserError(f"--arch: unknown target {arch!r}. Fix: --arch mixtral or --arch qwen2_moe.")
    if has_moe_keys(config.to_dict()):
        raise UserError(f"{key}: it is a {mt} model, already a Mixture-of-Experts; upcycling turns a dense model into "
                        "an MoE. Fix: fine-tune it directly (revffn train model=...), or upcycle its dense original.")
    if mt not in SOURCES:
        raise UserError(f"{key}: upcycling reads dense {', '.join(SOURCES)} models; this one is {mt!r}. Fix: give a "
                        "model of one of those types (Llama, Mistral, Qwen2 layouts).")
    if experts < 2:
        raise UserError(f"--experts {experts}: an MoE needs at least 2 experts. Fix: --experts 2 or more.")
    if not 1 <= top_k <= experts:
        raise UserError(f"--top-k {top_k}: each token picks top-k of the {experts} experts, so top-k must be 1..E "
                        f"(E < top-k cannot route). Fix: --top-k between 1 and {experts}.")
    target = _target_defaults(arch)
    source = config.to_dict()
    lost = [f"{k}={source[k]!r}" for k, neutral in _ACTIVE_KEYS.items()
            if source.get(k, neutral) not in (neutral, 0) and k not in target]
    if lost:
        raise UserError(f"{key}: {arch} cannot express the source's {', '.join(lost)}, so the MoE would not equal the "
                        "dense model. Fix: choose the other --arch, or a source without it.")


def _target_defaults(arch: str) -> dict:
    import transformers

    return getattr(transformers, TARGETS[arch])().to_dict()


def moe_config(config, experts: int, top_k: int, arch: str, renormalize: bool = True):
    """The target MoE config: every key both configs share copied from the dense one, the MoE keys set."""
    import transformers

    target = _target_defaults(arch)
    fields = {k: v for k, v in config.to_dict().items() if k in target and k not in _SKIP_KEYS}
    inter = config.intermediate_size
    if arch == "mixtral":
        fields.update(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=inter,
                      router_jitter_noise=0.0)
    else:
        fields.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                      intermediate_size=inter, shared_expert_intermediate_size=max(8, inter // experts),
                      norm_topk_prob=renormalize, decoder_sparse_step=1, mlp_only_layers=[],
                      qkv_bias=True)
    out = getattr(transformers, TARGETS[arch])(**fields)
    out._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    return out


def upcycle_bytes(config, experts: int, top_k: int, arch: str) -> int:
    """The fp32 bytes `upcycle_into` holds at once, at least: the dense model and its MoE twin, counted on the meta
    device (nothing allocated)."""
    return 4 * (meta_params(config) + meta_params(moe_config(config, experts, top_k, arch)))


@torch.no_grad()
def upcycle(dense, experts: int, top_k: int, arch: str = "mixtral", seed: int = 0, renormalize: bool = True,
            key: str = "model"):
    """The MoE twin of HF causal LM `dense` (see the module docstring); its dtype is `dense`'s."""
    from transformers import AutoModelForCausalLM

    check_upcycle(dense.config, experts, top_k, arch, key)
    config = moe_config(dense.config, experts, top_k, arch, renormalize)
    dtype = next(dense.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        moe = AutoModelForCausalLM.from_config(config, dtype=dtype)
    src = dense.state_dict()
    dst = moe.state_dict()
    done: set[str] = set()
    for name, value in src.items():
        parts = name.split(".")
        if "mlp" in parts and parts[-2] in _MLP:
            continue
        if name not in dst or dst[name].shape != value.shape:
            raise UserError(f"{key}: the dense model's {name} {tuple(value.shape)} has no place in {arch} "
                            f"({'no such parameter' if name not in dst else tuple(dst[name].shape)}). Fix: the other "
                            "--arch, or a source of a layout it holds.")
        dst[name].copy_(value)
        done.add(name)
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        gate, up, down = (src[f"{mlp}.{p}.weight"] for p in _MLP)
        dst[f"{mlp}.experts.gate_up_proj"].copy_(torch.cat([gate, up], 0).expand(experts, -1, -1))
        dst[f"{mlp}.experts.down_proj"].copy_(down.expand(experts, -1, -1))
        dst[f"{mlp}.gate.weight"].normal_(0.0, ROUTER_STD)
        done |= {f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj", f"{mlp}.gate.weight"}
        if arch == "qwen2_moe":
            dst[f"{mlp}.shared_expert.down_proj.weight"].zero_()  # adds exactly 0 at init
            done |= {f"{mlp}.shared_expert.{p}.weight" for p in _MLP} | {f"{mlp}.shared_expert_gate.weight"}
    for name in dst:
        if name not in done and name.endswith(".bias") and "self_attn" in name:
            dst[name].zero_()  # Qwen2-MoE's q/k/v biases for a source without them
            done.add(name)
    left = sorted(n for n in dst if n not in done and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if left:
        raise UserError(f"{key}: {arch} has parameters the dense model cannot fill: {', '.join(left[:4])}"
                        f"{' ...' if len(left) > 4 else ''}. Fix: the other --arch.")
    moe.tie_weights()
    return moe


@torch.no_grad()
def max_logit_delta(dense, moe, vocab: int, seed: int = 0, batch: int = 2, seq: int = 64) -> float:
    """max |logits(moe) - logits(dense)| on a fixed random batch, both in fp32 and eval mode."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    a = dense.float().eval()(input_ids=ids).logits
    b = moe.float().eval()(input_ids=ids).logits
    return (a - b).abs().max().item()


def save_here(model, out: Path) -> None:
    """`model.save_pretrained(out)` from whichever process calls it. Cache entries (`models.cache`) are built by
    the process holding their file lock, which under torchrun may be any rank; transformers (5.25) writes nothing
    off rank 0 once a process group exists (`should_save_on_this_rank`), which left an entry of tokenizer files
    only. Raises RuntimeError if config.json was still not written."""
    if hasattr(model, "should_save_on_this_rank"):
        model.should_save_on_this_rank = lambda is_main_process: is_main_process  # this instance, this call
        try:
            model.save_pretrained(out)
        finally:
            del model.should_save_on_this_rank
    else:
        model.save_pretrained(out)
    if not (Path(out) / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no config.json into {out}")


def upcycle_into(model: str, src: Path, out: Path, experts: int, top_k: int, arch: str = "mixtral", seed: int = 0,
                 key: str = "model", renormalize: bool = True, config=None) -> dict:
    """Upcycle model reference `model`, resolved to the HF directory `src`, into the empty directory `out`: the
    MoE (safetensors, fp32), the tokenizer, and revffn.json with the measured max |Δlogit|; nothing when it is
    not exact. `config`: `src`'s, where the caller has read and checked it. Returns revffn.json."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if config is None:
        config = AutoConfig.from_pretrained(src, local_files_only=True)
        check_upcycle(config, experts, top_k, arch, key)  # before the weights are read
    with progress("upcycle", "stage", 4) as bar:
        dense = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float32,
                                                     use_kernels=False)  # no Hub kernels (models.loading.load_hf)
        bar(1, 4, "loaded")
        moe = upcycle(dense, experts, top_k, arch, seed, renormalize, key)
        bar(2, 4, "upcycled")
        delta = max_logit_delta(dense, moe, config.vocab_size, seed)
        bar(3, 4, f"max |Δlogit| {delta:.2g}")
        if not delta <= TOLERANCE:
            raise UserError(f"{key}: the upcycled {arch} differs from the dense model by max |Δlogit| {delta:.3g} > "
                            f"{TOLERANCE:g} (fp32), so it does not equal it at init"
                            + ("" if renormalize else " (top-k routing is not renormalized)")
                            + ". Nothing was written. Fix: renormalized top-k routing (the default).")
        manifest = {"format": "hf", "upcycled_from": model, "arch": arch, "experts": experts, "top_k": top_k,
                    "router_std": ROUTER_STD, "seed": seed, "max_abs_dlogit": delta, "tolerance": TOLERANCE,
                    "parameters": sum(p.numel() for p in moe.parameters())}
        save_here(moe, out)
        AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(out)
        if dense.generation_config is not None:
            dense.generation_config.save_pretrained(out)
        bar(4, 4, "saved")
    (Path(out) / "revffn.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
