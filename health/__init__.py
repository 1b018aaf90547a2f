"""Node health probes: host, Neuron (neuron-ls, neuron-monitor, nccom-test) and NVIDIA
(nvidia-smi, DCGM, nccl-tests); ``python -m health`` on a node.

Stands alone: imports nothing else of the project.
"""
