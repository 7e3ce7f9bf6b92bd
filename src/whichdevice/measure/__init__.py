"""What the CPU measures of itself, and the estimate made from it: the calibration (its cache, its
figures), the timing probes (cache-resident matmuls, one-token attention) and the memory probes
(weights streamed from memory, oneDNN's packing), the job estimate priced from those figures, and
the packing plan it makes. The rules that read them are precision/ (the dtype) and tuning/ (what
prepare() installs).

May import: core/, hardware/, model/.
"""
