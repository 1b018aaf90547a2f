"""The Neuron backend of the reference trainer: Llama on neuronx-distributed (NxD).

Selected with ``backend = "neuron"`` and tuned by the config's ``[neuron]`` table. It
trains with tensor parallelism (TP), pipeline parallelism (PP), sequence parallelism and
ZeRO-1 on Trainium, writes NxD-layout checkpoints (``step_N/`` with NxD's ``checkpoint``
and ``done`` markers, which the supervisor's scanner knows), and announces its graph
compilation as the ``compile`` phase.

| module | job |
|---|---|
| ``config.py`` | the ``[neuron]`` table (stdlib only: ``--check-config`` reads it) |
| ``layout.py`` | world size and config to the parallel layout and the batch split (pure) |
| ``checkpoints.py`` | checkpoint directory names and NxD's markers (pure) |
| ``launch.py`` | a trn1.32xlarge node's torchrun line, precompile step and environment (pure) |
| ``model.py`` | the Llama decoder built from NxD's parallel layers (needs the Neuron SDK) |
| ``train.py`` | the training loop (needs the Neuron SDK, imported when it starts) |

Only ``model.py`` and ``train.py`` need torch-neuronx and neuronx-distributed; the rest
is tested anywhere and may be imported by the supervisor.
"""
