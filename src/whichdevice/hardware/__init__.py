"""What this machine has: the backend registry, the visible-devices variables, env-setup hooks, the
probes (read, then interpret) and the compatibility of the installed stack. (What the CPU measures of
itself is measure/.)

May import: core/.
"""
