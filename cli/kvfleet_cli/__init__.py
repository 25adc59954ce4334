"""The ``kvfleet`` console script (``main``) and ``kvfleet up`` (``up``): a thin layer that starts the
components; it imports none of them until a sub-command names one."""
