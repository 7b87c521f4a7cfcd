"""Probes of the internals of other libraries (transformers, torch, accelerate, kernels, PEFT)
that ascend_vlm relies on, one module per subject; the only place that reads their private
names.

No public contract covers these details. Each has a probe beside the code that uses it: a
function that checks it against the installed packages without building a model and returns why
it does not hold, or None. Each probe says when it can go (:mod:`.probe`).

* :mod:`.versions`: the supported transformers range (``LOWEST_SUPPORTED`` .. ``NEWEST_TESTED``).
* :mod:`.probe`: the :class:`~.probe.Probe` record.
* :mod:`.attention`: the attention interface, configs' attention implementation, packed
  segments, the output capture.
* :mod:`.module_internals`: norm and MLP attributes, SiLU, accelerate hooks.
* :mod:`.decorators`: rebuilding decorated forwards (``deprecate_kwarg``, kernels).
* :mod:`.experts`: MoE experts modules' weights, layout flags and call.
* :mod:`.gated_delta`: the gated delta rule and convolution functions a Gated DeltaNet forward
  calls.
* :mod:`.cache`: the KV cache's layers and keyword.
* :mod:`.torch_internals`: torch's mode stacks, fake tensors, version counter, int8 matmul.
* :mod:`.peft_layers`: switching a PEFT layer's active adapter.
* :mod:`.quantizer`: the quantizer hooks and weight-loading ops quantizing while loading uses.
* :mod:`.distributed_loading`: FSDP2 at load time (``DistributedConfig``) and Trainer training
  such a model without DDP.
* :mod:`.fsdp_state`: making an FSDP2 unit the root before its first forward.
* :mod:`.post_import`: running a function once another library's module is imported (how
  ``import ascend_vlm`` registers its attention with transformers without importing it).
* :mod:`.module_state`: a module's own tensors and children, a config's implementations
  (rebuilding a module for a replay repro).

The probes that read the family specs of :mod:`ascend_vlm.models` (classes, attributes,
attention routing, RoPE, vision towers, sub-configs) and ``patch``'s version gate, which runs
every probe, live above the models, in :mod:`ascend_vlm.patching.family_probes` and
:mod:`ascend_vlm.patching.version_gate`.
"""
