"""The reference trainer: Llama pre-training on torch (FSDP2), supervised by training-supervisor.

Importing this package imports nothing heavy: ``python -m trainer --check-config`` must
not pay for torch (what the supervisor shares with the ranks is ``wire``). The entry points
are ``python -m trainer`` (trainer/__main__.py) and ``trainer.train.train``.
"""
