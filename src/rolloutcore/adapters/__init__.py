"""Adapters: engine effects behind the port (``rolloutcore.control.port.LifecycleAdapter``)."""
