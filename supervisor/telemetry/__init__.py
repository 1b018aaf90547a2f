"""The daemon's MQTT side: the embedded broker (broker.py) and who may do what on it
(access.py, pure), the daemon's connection to a broker (link.py), the telemetry view that
connection feeds (view.py; gate.py decides which messages it acts on, records.py keeps
what each sender said), and the outbox that publishes the daemon's recorded events and
fences (outbox.py). The wire format is wire/'s.
"""
