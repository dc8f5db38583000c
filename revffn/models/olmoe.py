"""OLMoE: softmax top-k router, q/k RMSNorm inside attention, no shared expert, full attention."""

from revffn.models.spec import ArchSpec, register

SPEC = register(ArchSpec(model_type="olmoe"))
