"""The trainer's parallelism: a device mesh from ``parallel:`` (:mod:`.mesh`), tensor parallel
(:mod:`.tensor`), context parallel (:mod:`.context`), activation recomputation (:mod:`.recompute`),
FSDP2 (:mod:`.fsdp`), communication time (:mod:`.clock`), and the set-up and gradient
bookkeeping that tie them together (:mod:`.setup`)."""
