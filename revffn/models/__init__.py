"""HF architectures (one spec file each), tiny presets, and the RevFFN converter."""

from revffn.models import mixtral, olmoe, qwen2_moe, qwen3_moe

ARCHITECTURES = {m.SPEC.model_type: m.SPEC for m in (qwen2_moe, qwen3_moe, mixtral, olmoe)}
