"""Node health probes: host, Neuron (neuron-ls, neuron-monitor, nccom-test), NVIDIA
(nvidia-smi, DCGM, nccl-tests), EFA (fi_info, port state and counters) and the MQTT
broker as the node reaches it (``broker``); ``python -m health`` on a node. Across nodes:
``python -m health.allreduce`` under any launcher, and the link test's rule (``links``),
which the supervisor runs on pairs of nodes.

Stands alone: imports nothing else of the project.
"""
