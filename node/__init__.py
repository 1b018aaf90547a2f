"""What runs on a training node beside the ranks, started by the launchers (never by the
daemon's own process): ``python -m node.agent`` (the node's own word that it lives, its
ranks' slots, the attempt's fence) and ``python -m node.compile_cache`` (a node's warm
compile cache). Both import the standard library, psutil, ``wire`` and the trainer's
publisher; nothing of the daemon. The probes a node runs are ``health``.
"""
