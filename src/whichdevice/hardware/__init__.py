"""What this machine has: the backend registry, the visible-devices variables, env-setup hooks, the
probes (read, then interpret), the compatibility of the installed stack, and the CPU's calibration.

May import: core/.
"""
