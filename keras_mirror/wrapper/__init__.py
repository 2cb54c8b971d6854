"""What `MirroredModel` does around Keras's own `fit`, `evaluate`, `predict`.

`mirrored_model.py` is thin; its helpers live here, one concern per
module: `_compile` (the user's compile state, the build before a step),
`_rebuild` (the model argument), `_fit_input` (the one pass over the
input, calling its stages in order: `_first`, `_validate`, `_contents`,
`_grouping`, `_inputs`), `_arguments` (scalar arguments),
`_on_batch`, `_resume` (step-backup resume), `_replica_attributes`,
`_user_model` (what callbacks see), `_rendering` (`summary`), `_files`
(atomic writes, weights files). None of them imports `mirrored_model`.
"""
