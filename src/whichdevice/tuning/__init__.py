"""What ``res.prepare(model)`` installs, the only part that acts on what the user owns: one ``Tuning``
record decided per resolution (CPU: one-row decode steps through torch's GEMV kernel, weights packed
ahead; NVIDIA GPU: generate's static cache), installed on a model, a PEFT model or a pipeline, and
taken back by ``unprepare``. What is guaranteed is written once, in docs/tuning.md.

May import: core/ ... memory/.
"""
