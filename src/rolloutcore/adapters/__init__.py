"""Adapters: engine effects behind the port (``rolloutcore.port.LifecycleAdapter``)."""
