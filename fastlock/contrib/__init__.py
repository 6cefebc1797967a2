"""Recipes for the frameworks Python services already take their locks in.

Each module imports its framework only when used; install it with the extra
of the same name (``pip install fastlock[celery]``):

:mod:`fastlock.contrib.celery`
    :func:`~fastlock.contrib.celery.exclusive_task`: a task runs at most once
    at a time per key, with the fencing token passed to it.
:mod:`fastlock.contrib.django`
    A client from ``settings.FASTLOCK``, a ``lock()`` context manager and
    :class:`~fastlock.contrib.django.LockedCommand` for management commands.
:mod:`fastlock.contrib.fastapi`
    :class:`~fastlock.contrib.fastapi.Leadership`: a lifespan that keeps one
    leader per deployment and stops leader-only work when leadership is lost
    (FastAPI and any Starlette app).
:mod:`fastlock.contrib.tooz`
    the ``fastlock://`` driver of tooz (locks, group membership, elections), extra ``tooz``.
"""
