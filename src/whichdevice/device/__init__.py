"""Which device: the request (argument, WHICHDEVICE_DEVICE or detection), detection in the registry's
order, the device string and, among several, the least busy device.

May import: core/, hardware/, model/, launch/.
"""
