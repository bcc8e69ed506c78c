"""megaloom inside transformers models: the Hugging Face MoE adapters (:mod:`.hf_moe`: build a
model, read its MoE blocks), the swapped-in modules (:mod:`.swaps`: ``MegaMoEBlock``,
``make_gate``), the generic module replacement (:mod:`.replace`: rules and plans) and the one
replacement plan of a config (:mod:`.plan`: ``replace`` and ``low_precision`` sections,
targets and formats as registries)."""
