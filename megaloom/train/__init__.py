"""The trainer: a YAML config in (:mod:`.config`), a trained transformers model, metrics, traces
and checkpoints out (:mod:`.trainer`). Beside it: token streams (:mod:`.data`), data, FSDP and
expert parallel set-up (:mod:`.parallel`), training checkpoints in the comm layer's DCP format
(:mod:`.checkpoint`), the progress bar and metrics log (:mod:`.progress`) and step traces
(:mod:`.step_trace`). ``megaloom train`` runs it from the command line."""
