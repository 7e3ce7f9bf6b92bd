"""Which dtype: what the hardware computes fast, what the checkpoint stores, what the CPU's calibration
measured, and the mixed precision training runs with.

May import: core/, hardware/, model/, launch/, device/, measure/.
"""
