"""training-supervisor: keeps large training runs training.

Layers, outermost first: ``cli``/``daemon`` (composition and lifecycle) -> ``reconciler``
(observe, decide, persist, act) -> ports and adapters (``store``, ``launcher``,
``telemetry``, ``broker``, ``checkpoint_scan``) -> the pure core (``domain``, ``policy``).
"""
