"""Integrations with other libraries, each an optional extra (``pip install fastlock[tooz]``).

- :mod:`fastlock.contrib.tooz` - the ``fastlock://`` driver of tooz (locks, groups, elections).
"""
