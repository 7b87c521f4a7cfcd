"""`ascend_vlm.verify`: where a model drifts from its stock reference, layer by layer and op by
op, against the noise floor of its dtype.

One module per concern:

* `capture_points`: where to capture (every vision block, the projector, every decoder layer
  and, inside, each attention, norm, MLP/MoE, linear attention and RoPE application), found
  from the family descriptors (or the generic path's plan);
* `capture`: the ledger feature that hands each capture to a sink as the module returns;
* `reference`: the stock reference (fp32 or fp64 on the CPU) and the noise-floor model (stock,
  test dtype, CPU) built from the model's own weights, or a given reference checked;
* `errors`: relative L2, max abs and cosine, as sums over inputs;
* `verifier`: the three runs per input and the comparison (`verify`);
* `report`: `VerifyReport` (table, JSON); `plot`: the error-vs-depth picture;
* `end_to_end`: top-1 agreement, KL of the next-token distributions, the first differing greedy
  token and the paired accuracy of the model against the reference;
* `replay` (with `repro_codec`): a flagged module's (or fused op's) call saved as a
  self-contained ``.pt`` repro and re-run against float64; `repro_names`: the classes and
  functions a repro may name;
* `cli`: ``python -m ascend_vlm verify``.
"""

from ascend_vlm.verification.report import ModuleError, VerifyReport
from ascend_vlm.verification.verifier import verify

__all__ = ["ModuleError", "VerifyReport", "verify"]
