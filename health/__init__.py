"""Node health probes: host today; Neuron and NVIDIA next.

Stands alone: imports nothing else of the project.
"""
