"""The verdict on the wire: how ``python -m health --wire`` prints it for the supervisor.

Through ``srun``, the output of every node's probe arrives on one stream, and Slurm forwards
a task's output in messages of at most 1024 bytes: a longer line is cut, and pieces of other
nodes' lines land in between. So the verdict (compact JSON, ASCII only) is sent in short
lines that each name the node and their place::

    tsup-probe node2 1/3 {"node": "node2", "status": "unhealthy", ...
    tsup-probe node2 2/3 ...
    tsup-probe node2 3/3 ...}

``answers`` puts each node's verdict back together from any interleaving, and leaves out a
node whose lines are not all there (the caller records that node's probe as failed).
"""

from __future__ import annotations

TAG = "tsup-probe"
WIDTH = 700  # characters of JSON per line: with the tag and node name, well under 1024 bytes


def lines(node: str, doc_json: str) -> list[str]:
    pieces = [doc_json[i:i + WIDTH] for i in range(0, len(doc_json), WIDTH)] or [""]
    return [f"{TAG} {node} {i}/{len(pieces)} {piece}" for i, piece in enumerate(pieces, 1)]


def answers(output: str) -> dict[str, str]:
    """node -> its verdict's JSON text, for every node whose lines all arrived."""
    parts: dict[str, dict[int, str]] = {}
    totals: dict[str, int] = {}
    for line in output.splitlines():
        fields = line.split(" ", 3)
        if len(fields) < 3 or fields[0] != TAG:
            continue
        node, place = fields[1], fields[2]
        seq, _, total = place.partition("/")
        if not (seq.isdigit() and total.isdigit()) or not 1 <= int(seq) <= int(total):
            continue
        if totals.setdefault(node, int(total)) != int(total):
            continue  # two probes of one node in one stream: keep the first
        parts.setdefault(node, {})[int(seq)] = fields[3] if len(fields) == 4 else ""
    return {node: "".join(got[i] for i in range(1, totals[node] + 1))
            for node, got in parts.items() if len(got) == totals[node]}
