"""training-supervisor: keeps large training runs training.

Layers, outermost first (import-linter holds them: ``make lint``): ``cli`` and the API
(api/) -> ``daemon`` (composition and lifecycle) -> ``service`` and ``reconciler``
(observe, decide, persist, act) -> ports and adapters (``store``, ``launchers``,
``slurm``, ``telemetry``, ``broker``, ``checkpoint_scan``) -> the pure core (``domain``,
``policy``).
"""
