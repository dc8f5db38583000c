"""OLMoE: softmax top-k router, q/k RMSNorm inside attention, no shared expert, full attention."""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="olmoe")
