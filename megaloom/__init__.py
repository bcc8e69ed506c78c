"""megaloom: a dataflow runtime for fine-grained accelerator task graphs."""
