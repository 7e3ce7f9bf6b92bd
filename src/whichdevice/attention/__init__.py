"""Which attention implementation: sdpa, eager, FlashAttention (with the package or a Hub kernel),
whichdevice's CPU decode attention, and Hub kernels (use_kernels).

May import: core/, hardware/, model/, launch/, device/, measure/, precision/.
"""
