"""The reference trainer: Llama pre-training on torch (FSDP2), supervised by training-supervisor.

Importing this package imports nothing heavy: ``python -m trainer --check-config`` and
the supervisor's use of ``trainer.protocol`` must not pay for torch. The entry points
are ``python -m trainer`` (trainer/__main__.py) and ``trainer.train.train``.
"""
