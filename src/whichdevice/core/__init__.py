"""Records every layer shares, and nothing that decides: errors, trace steps, probe results and backend
records, installed package versions, the environment a resolution reads, sizes.

May import: nothing of whichdevice's.
"""
