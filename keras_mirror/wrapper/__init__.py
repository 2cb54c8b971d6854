"""What `MirroredModel` does around Keras's own `fit`, `evaluate`, `predict`.

`mirrored_model.py` is thin; its helpers live here, one concern per
module: `_compile` (the user's compile state), `_rebuild` (the model
argument, building), `_validate`, `_arguments` and `_targets` (argument
and input checks), `_inputs` (input adaptation, counting steps),
`_on_batch`, `_resume` (step-backup resume), `_replica_attributes`,
`_user_model` (what callbacks see), `_rendering` (`summary`), `_files`
(atomic writes, weights files). None of them imports `mirrored_model`.
"""
